"""Plain-PyTorch reference of ``linear_logprob`` (backend ``torch``), over the row math of
:mod:`rl_kernel_core.logprob.reference` (forward and backward stated there).

For one row the scaled logits are ``z = (h @ W.T + b) / T``; the backward forms ``dL/dz`` as there, then
``dL/d(h W^T + b) = dL/dz / T``, ``dh = dl @ W``, ``dW = dl^T @ h``, ``db = sum_rows dl``.

Memory: as :mod:`rl_kernel_core.logprob.reference`, one chunk of ``[rows, V]`` logits alive at a time
(the backward recomputes each chunk's logits from ``h``). For bf16/fp16 ``weight`` an fp32 copy of
``weight`` (``V x D``, independent of N) is made once per forward and once per backward, and the
backward accumulates ``dW`` in fp32 before casting it to ``weight``'s dtype.

Vocab parallel (``tp_group``): each rank computes ``(max, sum-exp, target logit, sum-exp * shifted
logit)`` over its contiguous shard (rank ``r`` owns global ids ``[r V_local, (r+1) V_local)``), the
``[4, N]`` statistics are all-gathered and merged in rank order (so every rank gets the same bits).
The backward forms the local ``dL/dz``; ``dh`` is all-reduced (sum) over the group, ``dW`` and
``db`` stay local. Upstream gradients must be the same on every rank (the outputs are replicated).

Deterministic run to run, but *not* batch-invariant: the BLAS library may pick a different kernel
for a chunk with fewer rows (the last one, or a small N), which can change a row's low bits; the
batch-invariant guarantee belongs to the GPU kernels.
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.logprob.reference import (
    _acc_dtype,
    _chunk_grad,
    _chunk_stats,
    _finish,
    _local_targets,
    _scale,
    _upstream,
    rows_per_chunk,
)
from rl_kernel_core.opdef import single_backward


def _merge_ranks(gathered: list[torch.Tensor]) -> torch.Tensor:
    """Merge per-rank statistics [4, N] (rank order) into global ones, same bits on every rank."""
    m_all = torch.stack([g[0] for g in gathered])
    big_m = m_all.amax(dim=0)
    s = torch.zeros_like(big_m)
    zt = torch.zeros_like(big_m)
    a = torch.zeros_like(big_m)
    for g in gathered:  # fixed rank order
        m_r, s_r, zt_r, a_r = g.unbind(0)
        # a shard of -inf logits (s_r = 0, m_r = -inf) adds 0, not -inf * 0
        shift = torch.where(s_r > 0, m_r - big_m, torch.zeros_like(big_m))
        scale = torch.where(s_r > 0, torch.exp(shift), torch.zeros_like(big_m))
        s = s + s_r * scale
        a = a + (a_r + shift * s_r) * scale
        zt = zt + zt_r
    return torch.stack((big_m, s, zt, a))


def _scaled_logits(
    h: torch.Tensor, w_t: torch.Tensor, bias: Optional[torch.Tensor], temperature: float
) -> torch.Tensor:
    z = h @ w_t
    if bias is not None:
        z.add_(bias)
    return _scale(z, temperature)


def _shard(tp_group) -> tuple[int, int]:
    """(rank, world size) of ``tp_group``, or (0, 1) without one."""
    if tp_group is None:
        return 0, 1
    return torch.distributed.get_rank(tp_group), torch.distributed.get_world_size(tp_group)


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, return_entropy, tp_group):
        acc = _acc_dtype(hidden.dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        rank, world = _shard(tp_group)
        valid, owned, local_t = _local_targets(targets, ignore_index, rank * vocab, vocab)
        w_t = weight.to(acc).t()
        b = None if bias is None else bias.to(acc)
        stats = torch.empty(4, n, dtype=acc, device=hidden.device)
        step = rows_per_chunk(vocab)
        for i in range(0, n, step):
            z = _scaled_logits(hidden[i : i + step].to(acc), w_t, b, temperature)
            stats[:, i : i + step] = _chunk_stats(z, local_t[i : i + step], owned[i : i + step], return_entropy)
            del z
        if world > 1:
            gathered = [torch.empty_like(stats) for _ in range(world)]
            torch.distributed.all_gather(gathered, stats, group=tp_group)
            stats = _merge_ranks(gathered)
        logprob, lse, entropy = _finish(stats, valid, return_entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.ignore_index, ctx.tp_group = temperature, ignore_index, tp_group
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    @single_backward("linear_logprob (torch backend)")
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse.dtype
        n, vocab = hidden.shape[0], weight.shape[0]
        rank, world = _shard(ctx.tp_group)
        valid, owned, local_t = _local_targets(targets, ctx.ignore_index, rank * vocab, vocab)
        g_lp = _upstream(g_lp, valid, acc)
        g_ent = _upstream(g_ent, valid, acc) if entropy is not None else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        w = weight.to(acc)
        b = None if bias is None else bias.to(acc)
        dh = torch.zeros(n, hidden.shape[1], dtype=acc, device=hidden.device) if need_h else None
        dw = torch.zeros(vocab, hidden.shape[1], dtype=acc, device=hidden.device) if need_w else None
        db = torch.zeros(vocab, dtype=acc, device=hidden.device) if need_b else None
        step = rows_per_chunk(vocab)
        for i in range(0, n, step):
            sl = slice(i, i + step)
            h = hidden[sl].to(acc)
            z = _scaled_logits(h, w.t(), b, ctx.temperature)
            dl = _chunk_grad(z, sl, lse, entropy, local_t, owned, g_lp, g_ent, ctx.temperature)
            if dh is not None:
                torch.mm(dl, w, out=dh[sl])
            if dw is not None:
                dw.addmm_(dl.t(), h)
            if db is not None:
                db.add_(dl.sum(dim=0))
            del z, dl, h
        if need_h and world > 1:
            torch.distributed.all_reduce(dh, group=ctx.tp_group)
        return (
            None if dh is None else dh.to(hidden.dtype),
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


@dispatch.register("linear_logprob", "torch")
def linear_logprob_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor],
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    tp_group=None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference ``linear_logprob`` on validated, contiguous 2-D inputs: ``(logprob[N], entropy[N] or None)``.

    ``hidden [N, D]``, ``weight [V_local, D]``, ``bias [V_local]`` or None (all one float dtype),
    ``targets [N]`` int64/int32 global ids. Outputs are fp32 (fp64 for fp64 inputs).
    """
    return _LinearLogprob.apply(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, tp_group)
