"""Vocab-parallel (``tp_group``) drivers of the Triton ``linear_logprob``.

Rank ``r`` of a group of ``P`` ranks holds the contiguous weight shard of global vocab ids
``[r V_local, (r + 1) V_local)``; every rank passes the same ``hidden`` and ``targets`` (global
ids) and gets the same, replicated, results.

**Forward: the same bits for every TP size.** The single-process forward on the gemm route cuts
the vocab into tiles of ``BLOCK_N`` columns, reduces each (row, tile) to ``(m_j, s_j, a_j)`` (and
the target logit in the tile that holds the target) and merges a row's tiles in ascending order
with ``_merge_kernel`` (:mod:`.triton_stats`). When ``V_local`` is a multiple of ``BLOCK_N``,
local tile ``j`` of rank ``r`` *is* global tile ``r V_local / BLOCK_N + j``: the same operands go
through the same ``tl.dot`` code, so its statistics are the same bits. Each rank computes the
statistics of its shard, one ``all_gather`` per chunk of rows lays every rank's ``[n, tiles_local]``
block side by side in global tile order, the target logit is *selected* from the rank that owns
the target (no arithmetic), and the unchanged merge kernel runs on exactly the numbers the
single-process forward merges, with the same chunk rows. So ``logprob``, ``entropy`` and ``lse``
are bitwise equal for TP = 1, 2, 4, ... and on every rank.

The logits are always formed on the gemm route (:data:`ROUTE`), forward and backward. The
chunked route's cuBLAS product is not promised to give the same per-element bits for a
``[rows, V]`` and a ``[rows, V / P]`` product (cuBLAS picks its kernel and split from the shape),
so it is not used here. Hence the single-process forward (``tp_group=None``) gives the same bits
as every TP size whenever it runs the gemm route too (``tuning().route == "gemm"``, the default);
on the chunked route it agrees within the contract.

**Backward.** Each rank forms ``dl`` for its shard with the global ``lse`` and entropy (its own
rows' targets mapped to shard-local ids), accumulates its ``dW`` and ``db`` shards locally, and
sums the ``dh`` partials ``dl W_local`` over the group: per chunk of rows, an fp32 ``[rows, D]``
partial is all-reduced and rounded once into ``dh``. The upstream gradients must be the same on
every rank (the outputs are replicated; as in the torch backend), and every rank must run the
backward (it holds collectives).

Extra memory of the forward: the local, gathered and merged statistics of one chunk of rows,
at most ``(2 + 1/P)`` times the single-process statistics buffer (``tuning().stats_bytes``); of the
backward: the single-process chunk buffer plus one fp32 ``[chunk_rows, D]`` partial of ``dh``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import triton

from rl_kernel_core.linear import chunks as LC
from rl_kernel_core.linear.triton_stats import launch_merge, launch_stats, stats_rows
from rl_kernel_core.linear.triton_tile import tiles

ROUTE = "gemm"
"""The logits route of every vocab-parallel pass (forward and backward)."""
IGNORED = -1
"""Shard-local id of a row at ``ignore_index`` (what the kernels are told to ignore)."""
_ELSEWHERE = -2
"""Shard-local id of a row whose target another rank owns: matches no column, is not ignored."""


def shard_reason(weight: torch.Tensor) -> Optional[str]:
    """None when ``weight [V_local, D]`` splits into whole vocab tiles, else why not (with the numbers)."""
    v_local = weight.shape[0]
    block_n = tiles(weight.dtype, weight.device, from_logits=False).block_n
    if v_local % block_n:
        return (
            f"vocab-parallel linear_logprob (tp_group) on the triton backend needs V_local (weight.shape[0]) "
            f"to be a multiple of the vocab tile BLOCK_N={block_n} ({weight.dtype} on {weight.device.type}), "
            f"so that shards hold whole tiles and the result is the same for every TP size; got "
            f"V_local={v_local} ({v_local} % {block_n} = {v_local % block_n})"
        )
    return None


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out [P * inp.numel()]`` = every rank's ``inp`` concatenated in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def local_targets(targets: torch.Tensor, ignore_index: int, rank: int, v_local: int) -> torch.Tensor:
    """Shard-local ids (int64 ``[N]``) of global ``targets [N]`` for the kernels of rank ``rank``.

    ``t - rank V_local`` where this rank owns ``t``; :data:`IGNORED` where ``t == ignore_index``
    (the kernels run with ``ignore_index=IGNORED``); ``-2`` where another rank owns ``t`` (no
    column matches it, the row is not ignored). A user ``ignore_index`` inside ``[0, V_local)``
    thus never masks another shard's target.
    """
    t = targets.long()
    local = t - rank * v_local
    out = torch.where((local >= 0) & (local < v_local), local, _ELSEWHERE)
    return torch.where(t == ignore_index, IGNORED, out)


def forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    inv_temp: float,
    ignore_index: int,
    want_entropy: bool,
    group,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(logprob, entropy or None, lse)``, fp32 ``[N]``, the same bits on every rank and for every TP size.

    ``hidden [N, D]``, this rank's ``weight [V_local, D]`` and ``bias [V_local]`` (or None), global
    ``targets [N]``; ``V_local`` a multiple of the gemm-route ``BLOCK_N`` (:func:`shard_reason`).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n_rows, v_local = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    tiles_local = triton.cdiv(v_local, tiles(weight.dtype, dev, from_logits=False).block_n)
    n_tiles = world * tiles_local
    rows = stats_rows(n_tiles)  # the single-process chunking of the same global vocab
    planes = 3 if want_entropy else 2  # (m, s[, a]) sent; the kernels address all three planes
    # per rank and chunk, flat fp32: [z_t (n) | m (n x tiles_local) | s (...) | a (...)]
    local = torch.empty(rows * (1 + 3 * tiles_local), dtype=torch.float32, device=dev)
    gathered = torch.empty(world * rows * (1 + planes * tiles_local), dtype=torch.float32, device=dev)
    merged = torch.empty(3 * rows * n_tiles, dtype=torch.float32, device=dev)

    lp = torch.empty(n_rows, dtype=torch.float32, device=dev)
    ent = torch.empty_like(lp) if want_entropy else None
    lse = torch.empty_like(lp)
    t = targets.long()
    tgt_local = local_targets(targets, ignore_index, rank, v_local)
    owner = torch.where(t == ignore_index, 0, t // v_local).clamp_(0, world - 1).unsqueeze(0)
    for r0 in range(0, n_rows, rows):
        n = min(rows, n_rows - r0)
        sl = slice(r0, r0 + n)
        ztgt = local[:n]
        partials = local[n : n + 3 * n * tiles_local].view(3, n, tiles_local)
        launch_stats(hidden[sl], weight, bias, tgt_local[sl], n, inv_temp, IGNORED, partials, ztgt, False, want_entropy)
        send = local[: n * (1 + planes * tiles_local)]
        recv = gathered[: world * send.numel()]
        _all_gather(recv, send, group)
        recv = recv.view(world, -1)
        zt = recv[:, :n].gather(0, owner[:, sl]).squeeze(0)
        glob = merged[: 3 * n * n_tiles].view(3, n, n_tiles)
        glob[:planes].view(planes, n, world, tiles_local).copy_(
            recv[:, n:].view(world, planes, n, tiles_local).permute(1, 2, 0, 3)
        )
        launch_merge(glob, zt, targets[sl], n, n_tiles, ignore_index, lp[sl], None if ent is None else ent[sl], lse[sl])
    return lp, ent, lse


class ShardGradSink:
    """Like :class:`rl_kernel_core.linear.chunks.GradSink` for one vocab shard: local ``dW``/``db``, ``dh`` summed over the group.

    Each chunk's ``dh`` partial ``dl @ W_local`` is formed in fp32 on the fixed ``[rows, D]``
    shape, all-reduced (sum) over ``group`` and rounded once into ``dh`` (``hidden``'s dtype).
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, need_h: bool, need_w: bool, need_b: bool, group
    ) -> None:
        self.local = LC.GradSink(hidden, weight, False, need_w, need_b)
        self.group = group
        self.dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        self._part: Optional[torch.Tensor] = None

    def _partial(self, dl: torch.Tensor) -> torch.Tensor:
        weight = self.local.weight
        if self._part is None:
            self._part = torch.empty(dl.shape[0], weight.shape[1], dtype=torch.float32, device=dl.device)
        if LC.fp32_logits_supported(dl.device, dl.dtype):
            LC.mm_fp32_into(dl, weight, self._part)
        else:  # this torch cannot write fp32 from 16-bit operands: round the partial once more
            self._part.copy_(torch.mm(dl, weight))
        return self._part

    def add(self, dl: torch.Tensor, r0: int, n: int) -> None:
        """Consume ``dl [rows, V_local]`` (rows past ``n`` zero) belonging to hidden rows ``[r0, r0+n)``."""
        if self.dh is not None:
            part = self._partial(dl)[:n]
            dist.all_reduce(part, group=self.group)
            self.dh[r0 : r0 + n].copy_(part)
        self.local.add(dl, r0, n)

    def grads(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(dh, dW shard, db shard)`` in the inputs' dtypes (None where not needed)."""
        _, dw, db = self.local.grads()
        return self.dh, dw, db
