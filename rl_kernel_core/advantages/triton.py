"""Triton kernel for ``group_advantages``: GRPO / Dr.GRPO / RLOO advantages, deterministic.

Semantics and arithmetic are :mod:`rl_kernel_core.advantages.reference`'s (verl 0.9.1): fp64
whatever the rewards' dtype, rounded to fp32 at the store. Per group of ``n`` rewards, ``mean``
(the first reward plus the mean of the differences from it: exact for equal rewards) and the
unbiased ``std`` (two passes: the sum, then the sum of squared deviations from the mean);
``grpo``: ``(r - mean) / (std + eps)``, 0 where ``std + eps`` is 0 (or ``r - mean`` without std
normalisation); ``dr_grpo``: ``r - mean``; ``rloo``: ``(r - mean) · n / (n - 1)``; a group of
one gets mean 0 and std 1 (``rloo``: ``r``).

One program owns one group and reads it in blocks of ``BLOCK`` in a fixed order (a tree sum
inside a block, blocks in sequence), so every member sees the same statistics and results are
bitwise equal run to run. Groups given by size are contiguous runs (grid = number of groups);
groups given by index are laid out by a stable sort of the ids, each position learns its group's
``[start, end)`` from ``searchsorted`` on the sorted ids (no host sync), and the program at a
group's first position does the work (grid = N; the others return at once).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.loss_codes import ESTIMATOR_CODES
from rl_kernel_core.advantages import opdef
from rl_kernel_core.opdef import fp64_reason
from rl_kernel_core.triton._jit import launch_time_jit
from rl_kernel_core.triton.tuning import ADVANTAGES_MAX_BLOCK


@launch_time_jit
def _group_advantages_kernel(
    rewards_ptr,
    order_ptr,
    starts_ptr,
    ends_ptr,
    out_ptr,
    group_size,
    eps_ptr,
    BY_INDEX: tl.constexpr,
    ESTIMATOR: tl.constexpr,
    NORM_BY_STD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if BY_INDEX:
        start = tl.load(starts_ptr + pid)
        end = tl.load(ends_ptr + pid)
        is_head = start == pid
    else:
        start = pid * group_size
        end = start + group_size
        is_head = pid >= 0
    if is_head:
        lanes = tl.arange(0, BLOCK)
        first = tl.load(rewards_ptr + (tl.load(order_ptr + start) if BY_INDEX else start)).to(tl.float64)
        total = tl.zeros((), tl.float64)
        for q0 in range(start, end, BLOCK):
            q = q0 + lanes
            ok = q < end
            src = tl.load(order_ptr + q, mask=ok, other=0) if BY_INDEX else q
            r = tl.load(rewards_ptr + src, mask=ok, other=0.0).to(tl.float64)
            total += tl.sum(tl.where(ok, r - first, 0.0), axis=0)
        n = (end - start).to(tl.float64)
        mean = first + total / n
        sq = tl.zeros((), tl.float64)
        for q0 in range(start, end, BLOCK):
            q = q0 + lanes
            ok = q < end
            src = tl.load(order_ptr + q, mask=ok, other=0) if BY_INDEX else q
            c = tl.load(rewards_ptr + src, mask=ok, other=0.0).to(tl.float64) - mean
            sq += tl.sum(tl.where(ok, c * c, 0.0), axis=0)
        single = n == 1.0
        std = tl.sqrt(sq / tl.where(single, 1.0, n - 1.0))
        den = tl.where(single, 1.0, std) + tl.load(eps_ptr)
        den = tl.where(den == 0.0, 1.0, den)  # std = eps = 0: every r - mean is exactly 0
        for q0 in range(start, end, BLOCK):
            q = q0 + lanes
            ok = q < end
            src = tl.load(order_ptr + q, mask=ok, other=0) if BY_INDEX else q
            r = tl.load(rewards_ptr + src, mask=ok, other=0.0).to(tl.float64)
            if ESTIMATOR == 2:
                adv = tl.where(single, r, (r - mean) * n / tl.where(single, 1.0, n - 1.0))
            else:
                adv = r - tl.where(single, 0.0, mean)
                if ESTIMATOR == 0 and NORM_BY_STD:
                    adv = adv / den
            tl.store(out_ptr + src, adv.to(tl.float32), mask=ok)


def group_advantages_fwd(
    rewards: torch.Tensor,
    group_size: Optional[int],
    group_index: Optional[torch.Tensor],
    estimator: str,
    norm_by_std: bool,
    eps: float,
) -> torch.Tensor:
    """Advantages ``[N]`` fp32 (group statistics in fp64) from rewards ``[N]`` (fp32/bf16/fp16);
    one of ``group_size``/``group_index`` is set."""
    values = rewards.detach().contiguous()
    n = values.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=values.device)
    if n == 0:
        return out
    if group_index is None:
        assert group_size is not None, "exactly one of group_size and group_index is set"
        grid = n // group_size
        block = min(ADVANTAGES_MAX_BLOCK, triton.next_power_of_2(group_size))
        order = starts = ends = values  # unused by the contiguous variant
    else:
        order = torch.argsort(group_index, stable=True)
        ids = group_index[order].contiguous()
        starts = torch.searchsorted(ids, ids, right=False)
        ends = torch.searchsorted(ids, ids, right=True)
        grid = n
        block = ADVANTAGES_MAX_BLOCK if n > ADVANTAGES_MAX_BLOCK else triton.next_power_of_2(max(n, 16))
        group_size = 0
    eps64 = torch.full((1,), eps, dtype=torch.float64, device=values.device)  # a float argument would be fp32
    _group_advantages_kernel[(grid,)](
        values,
        order,
        starts,
        ends,
        out,
        group_size,
        eps64,
        BY_INDEX=group_index is not None,
        ESTIMATOR=ESTIMATOR_CODES[estimator],
        NORM_BY_STD=norm_by_std,
        BLOCK=block,
        num_warps=4,
    )
    return out


group_advantages_op = opdef.define_op("triton_group_advantages", group_advantages_fwd)


def _supports(rewards, group_size, group_index, **kwargs) -> Optional[str]:
    return fp64_reason("triton", rewards=rewards)


group_advantages = dispatch.register("group_advantages", "triton", supports=_supports)(
    opdef.implementation(group_advantages_op)
)
