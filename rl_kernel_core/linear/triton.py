"""Triton ``linear_logprob``: log-probs and entropies from hidden states, never holding ``[N, V]``.

The op is the custom op ``rl_kernel::triton_linear_logprob`` and its backward (schemas and
autograd glue in :mod:`rl_kernel_core.linear.opdef`) over the backend-neutral chunk driver
(:mod:`rl_kernel_core.linear.chunks`) with the Triton passes :data:`PASSES`:

* one route (``tuning().route``) for every pass, so the backward recomputes the forward's logit
  bits and a row's log-prob is the same with or without entropy or grad.
* forward: per chunk of rows, the statistics pass (:mod:`.triton_stats`) forms each
  ``[BLOCK_M, BLOCK_N]`` logits tile (``tl.dot`` on the gemm route, a cuBLAS fp32 chunk on the
  chunked route) and reduces it to tile statistics and the target logit, merged per row in a
  fixed order into ``logprob``, ``entropy`` and ``lse``. Only ``lse`` and ``entropy`` (``[N]``
  fp32) are saved for the backward.
* backward: per fixed-size chunk of rows, the gradient pass (:mod:`.triton_grad`) recomputes
  the logits and writes ``dl = dL/d logits`` (one buffer ``[chunk, V]``), then cuBLAS
  ``dh = dl @ W`` (fixed shape) and ``dW += dl^T @ h``: four matrix products with the forward.

Deterministic and batch invariant; extra memory is the chunk buffer plus, with
``tuning().wgrad_fp32``, the fp32 ``dW`` accumulator while the backward runs.

Vocab parallel (``tp_group``): :mod:`rl_kernel_core.linear.triton_vocab_parallel` (forward bitwise equal
for every TP size; ``dh`` summed over the group, ``dW``/``db`` shards local).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.linear import chunks as LC
from rl_kernel_core.linear import opdef
from rl_kernel_core.linear import triton_sm90
from rl_kernel_core.linear import triton_vocab_parallel as VP
from rl_kernel_core.linear.triton_grad import chunk_grad
from rl_kernel_core.linear.triton_stats import chunk_scratch, chunk_stats, forward_rows


PASSES = LC.ChunkPasses(stats=chunk_stats, grad=chunk_grad, scratch=chunk_scratch, stats_rows=forward_rows)
"""The Triton passes the chunk driver runs: the statistics pass and merge of :mod:`.triton_stats`
(``buf.scratch`` holds one chunk's tile statistics) and the gradient pass of :mod:`.triton_grad`."""


def _forward(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, tp_group, tuning):
    """The forward custom op's body (schema :data:`rl_kernel_core.linear.opdef.LINEAR_SCHEMA`)."""
    with LC.tuning_of(tuning):
        if tp_group is None:
            route = LC.tuning().route_for(hidden)
            return LC.linear_forward(
                hidden, weight, bias, targets, temperature, ignore_index, return_entropy, route, PASSES
            )
        lp, ent, lse = VP.forward_stats(
            LC.canonical_layout(hidden),
            LC.canonical_layout(weight),
            bias,
            targets,
            1.0 / temperature,
            ignore_index,
            return_entropy,
            opdef.group_named(tp_group),
        )
        return lp, (lp.new_empty(0) if ent is None else ent), lse


def _backward(*args):
    """The backward custom op's body (arguments: :class:`~rl_kernel_core.linear.chunks.BackwardArgs`):
    ``(dh, dW, db)``, ``[0]`` where not asked for."""
    call = LC.BackwardArgs(*args)
    with LC.tuning_of(call.tuning):  # autograd may run the backward on another thread: the forward's tuning, named
        if call.tp_group is None:
            return LC.linear_backward(call, LC.tuning().route_for(call.hidden), PASSES)
        # this rank's shard: shard-local target ids, dh summed over the group, the forward's gemm route
        group = opdef.group_named(call.tp_group)
        rank, vocab = torch.distributed.get_rank(group), call.weight.shape[0]
        local = VP.local_targets(call.targets, call.ignore_index, rank, vocab)
        hidden, weight = LC.canonical_layout(call.hidden), LC.canonical_layout(call.weight)
        sink = VP.ShardGradSink(
            hidden, weight, call.need_hidden_grad, call.need_weight_grad, call.need_bias_grad, group
        )
        return LC.linear_backward(call._replace(targets=local, ignore_index=VP.IGNORED), VP.ROUTE, PASSES, sink)


def _supports(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, tp_group) -> Optional[str]:
    if hidden.dtype == torch.float64:
        return "the triton kernels accumulate in fp32; fp64 inputs need the torch backend"
    if tp_group is not None:
        return VP.shard_reason(weight)
    return None


linear_logprob = dispatch.register("linear_logprob", "triton", supports=_supports, kernels=triton_sm90.KERNELS)(
    opdef.define_linear_logprob("triton_linear_logprob", _forward, _backward)
)
linear_logprob.__doc__ = """Validated ``hidden [N, D]``, ``weight [V, D]``, ``targets [N]`` → ``(logprob [N], entropy [N] or None)``, fp32.

16-bit or fp32 ``hidden``/``weight``/``bias`` (one dtype), int64/int32 ``targets`` in ``[0, V)``
or ``ignore_index`` (0 log-prob, 0 entropy, no gradient). Differentiable in ``hidden``,
``weight`` and ``bias`` through both outputs.

With ``tp_group`` (a ``torch.distributed.ProcessGroup``), ``weight [V_local, D]`` and ``bias
[V_local]`` are this rank's contiguous vocab shard, ``V_local`` a multiple of the gemm-route vocab
tile, ``targets`` global ids in ``[0, P V_local)``; every rank passes the same ``hidden``/
``targets`` and upstream gradients. Outputs are replicated and bitwise the same for every TP
size; ``dh`` is summed over the group, ``dW``/``db`` are this rank's shards.
"""
