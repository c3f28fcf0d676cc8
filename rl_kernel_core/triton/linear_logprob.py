"""Triton ``linear_logprob``: log-probs and entropies from hidden states, never holding ``[N, V]``.

The math and the kernels live in :mod:`rl_kernel_core.triton._linear_kernels`; this module is
the autograd wrapper and the backend registration.

* one route (``TUNING.route``) for every pass, so the backward recomputes the forward's logit
  bits and a row's log-prob is the same with or without entropy or grad.
* forward: one pass per chunk of rows forms each ``[BLOCK_M, BLOCK_N]`` logits tile (``tl.dot``
  on the gemm route, a cuBLAS fp32 chunk on the chunked route) and reduces it to tile
  statistics, merged per row in a fixed order into ``logprob``, ``entropy`` and ``lse``. Only
  ``lse`` and ``entropy`` (``[N]`` fp32) are saved for the backward.
* no-grad forward (``torch.no_grad()`` or no input requiring grad: the old/ref log-prob passes):
  the same kernels, no autograd node and nothing saved.
* backward: per fixed-size chunk of rows, recompute the logits and write
  ``dl = dL/d logits`` in the pass (one buffer ``[chunk, V]``), then cuBLAS ``dh = dl @ W``
  (fixed shape) and ``dW += dl^T @ h``: four matrix products with the forward in all.

Deterministic and batch invariant as the kernel module states; extra memory is the chunk buffer
plus, with ``TUNING.wgrad_fp32``, the fp32 ``dW`` accumulator while the backward runs.

Vocab parallel (``tp_group``): :mod:`rl_kernel_core.triton._vocab_parallel` (forward bitwise equal
for every TP size; ``dh`` summed over the group, ``dW``/``db`` shards local).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core._autograd import single_backward
from rl_kernel_core.triton import _linear_kernels as K
from rl_kernel_core.triton import _vocab_parallel as VP


def _fp32_rows(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if g is None else g.to(torch.float32).contiguous()


def _forward(hidden, weight, bias, targets, inv_temp, ignore_index, return_entropy, tp_group, buffers):
    """``(logprob, entropy or None, lse)``: single-process (``tp_group`` None) or vocab-parallel."""
    if tp_group is None:
        return K.forward_stats(hidden, weight, bias, targets, inv_temp, ignore_index, buffers.route_for(hidden), return_entropy, buffers)
    return VP.forward_stats(hidden, weight, bias, targets, inv_temp, ignore_index, return_entropy, tp_group)


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, return_entropy, tp_group, buffers):
        inv_temp = 1.0 / temperature
        lp, ent, lse = _forward(hidden, weight, bias, targets, inv_temp, ignore_index, return_entropy, tp_group, buffers)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.inv_temp, ctx.ignore_index, ctx.tp_group, ctx.buffers = inv_temp, ignore_index, tp_group, buffers
        ctx.set_materialize_grads(False)
        return (lp, ent) if return_entropy else lp

    @staticmethod
    @single_backward("linear_logprob (triton and native backends)")
    def backward(ctx, g_lp, g_ent=None):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_lp is None and g_ent is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None, None, None
        g_lp = _fp32_rows(g_lp) if g_lp is not None else torch.zeros_like(lse)
        need_b = need_b and bias is not None
        group, ignore_index = ctx.tp_group, ctx.ignore_index
        if group is None:
            sink = K.GradSink(hidden, weight, need_h, need_w, need_b)
            route = ctx.buffers.route_for(hidden)
        else:  # this rank's shard: shard-local target ids, dh summed over the group, the forward's gemm route
            sink = VP.ShardGradSink(hidden, weight, need_h, need_w, need_b, group)
            rank = torch.distributed.get_rank(group)
            targets, ignore_index = VP.local_targets(targets, ignore_index, rank, weight.shape[0]), VP.IGNORED
            route = VP.ROUTE
        K.backward_chunks(
            hidden, weight, bias, targets, lse, ent, g_lp, _fp32_rows(g_ent),
            ctx.inv_temp, ignore_index, route, sink, ctx.buffers,
        )
        dh, dw, db = sink.grads()
        return dh, dw, db, None, None, None, None, None, None


def _supports(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, tp_group) -> Optional[str]:
    if hidden.dtype == torch.float64:
        return "the triton kernels accumulate in fp32; fp64 inputs need the torch backend"
    if tp_group is not None:
        return VP.shard_reason(weight)
    return None


@dispatch.register("linear_logprob", "triton", supports=_supports)
def linear_logprob_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor],
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    tp_group: Optional["torch.distributed.ProcessGroup"],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Validated ``hidden [N, D]``, ``weight [V, D]``, ``targets [N]`` → ``(logprob [N], entropy [N] or None)``, fp32.

    16-bit or fp32 ``hidden``/``weight``/``bias`` (one dtype), int64/int32 ``targets`` in
    ``[0, V)`` or ``ignore_index`` (0 log-prob, 0 entropy, no gradient). Differentiable in
    ``hidden``, ``weight`` and ``bias`` through both outputs when grad mode is on and one of
    them requires grad; otherwise runs forward-only and saves nothing.

    With ``tp_group`` (a ``torch.distributed.ProcessGroup``), ``weight [V_local, D]`` and ``bias
    [V_local]`` are this rank's contiguous vocab shard, ``V_local`` a multiple of the gemm-route
    vocab tile, ``targets`` global ids in ``[0, P V_local)``; every rank passes the same
    ``hidden``/``targets`` and upstream gradients. Outputs are replicated and bitwise the same
    for every TP size; ``dh`` is summed over the group, ``dW``/``db`` are this rank's shards.
    """
    return run_chunked(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, tp_group, K.ChunkBuffers)


def run_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor],
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    tp_group: Optional["torch.distributed.ProcessGroup"],
    buffers: type[K.ChunkBuffers],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`linear_logprob_triton` with the per-chunk passes of ``buffers`` (a
    :class:`~rl_kernel_core.triton._linear_kernels.ChunkBuffers` class; the native backend passes
    its CUDA pass): forward-only without grad, else an autograd node whose backward runs the same
    chunk driver. ``tp_group`` is served by the Triton passes only."""
    hidden, weight = K.canonical_layout(hidden), K.canonical_layout(weight)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if needs_grad:
        out = _LinearLogprob.apply(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, tp_group, buffers)
        return out if return_entropy else (out, None)
    lp, ent, _ = _forward(hidden, weight, bias, targets, 1.0 / temperature, ignore_index, return_entropy, tp_group, buffers)
    return lp, ent
