"""Plain-PyTorch reference of ``varlen_attention`` (backend ``torch``): a fixed KV split order.

Each sequence's queries are processed in fixed-shape tiles of :data:`Q_TILE` query rows against
fixed-shape blocks of :data:`KV_BLOCK` keys, always in block order 0, 1, 2, ... with an online
softmax (running max, running sum, running weighted values). Every library call therefore has a
shape that does not depend on the sequence length, the number of sequences or the number of
queries, and a query's reduction visits the same blocks in the same order whether it is computed
in a full prefill or alone in a decode step over a KV cache:

* a block that is entirely masked for a query (a block past its causal end, which a prefill tile
  visits for the tile's later rows) leaves the running state bit for bit unchanged: its max is
  ``-inf`` so the rescale factor is ``exp(0) = 1``, its probabilities are exactly 0 and its value
  product adds exactly 0;
* keys past the end of the cache (the zero padding of the last block in decode) and future keys
  (present in a prefill block) are masked before the softmax and contribute exact zeros.

Accumulation is fp32 (fp64 for fp64 inputs); the output is rounded once to q's dtype. Gradients
come from autograd through these operations (correct, not batch-invariant themselves).
"""

from __future__ import annotations

import math

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode.reference import acc_dtype

Q_TILE: int = 16
"""Query rows per tile."""
KV_BLOCK: int = 16
"""Keys per block; blocks are reduced in increasing order."""


def _pad_to(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    missing = rows - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """q ``[Hq, Lq, D]``, k/v ``[Hq, Lk, D]`` (heads already expanded) -> out ``[Hq, Lq, D]``, lse ``[Hq, Lq]``."""
    hq, lq, d = q.shape
    lk = k.shape[1]
    offset = lk - lq
    n_blocks = max(1, math.ceil(lk / KV_BLOCK))
    k = _pad_to(k, n_blocks * KV_BLOCK, 1)
    v = _pad_to(v, n_blocks * KV_BLOCK, 1)
    outs, lses = [], []
    for start in range(0, lq, Q_TILE):
        rows = min(Q_TILE, lq - start)
        qt = _pad_to(q[:, start : start + rows], Q_TILE, 1)
        qpos = offset + start + torch.arange(Q_TILE, device=q.device)
        last = offset + start + rows - 1
        blocks = min(n_blocks, last // KV_BLOCK + 1) if causal else n_blocks
        m = q.new_full((hq, Q_TILE), -math.inf)
        l = q.new_zeros((hq, Q_TILE))
        acc = q.new_zeros((hq, Q_TILE, d))
        for j in range(blocks):
            kpos = j * KV_BLOCK + torch.arange(KV_BLOCK, device=q.device)
            valid = (kpos < lk).expand(Q_TILE, KV_BLOCK)
            if causal:
                valid = valid & (kpos[None, :] <= qpos[:, None])
            kb = k[:, j * KV_BLOCK : (j + 1) * KV_BLOCK]
            vb = v[:, j * KV_BLOCK : (j + 1) * KV_BLOCK]
            s = torch.where(valid, torch.matmul(qt, kb.transpose(1, 2)) * scale, -math.inf)
            m_new = torch.maximum(m, s.detach().amax(dim=-1))
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, vb)
            m = m_new
        outs.append((acc / l[..., None])[:, :rows])
        lses.append((m + torch.log(l))[:, :rows])
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


@dispatch.register("varlen_attention", "torch")
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, sequence offsets as Python lists -> (out ``[Tq, Hq, D]``
    in q's dtype, lse ``[Tq, Hq]`` fp32)."""
    acc = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = qf[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
        ks = kf[cu_k[b] : cu_k[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = vf[cu_k[b] : cu_k[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        if qs.shape[1] == 0:
            continue
        o, lse = _one_sequence(qs, ks, vs, causal, scale)
        outs.append(o.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)
    return torch.cat(outs).to(q.dtype), torch.cat(lses).float()
