"""Plain-PyTorch reference for group-relative advantages (GRPO, Dr.GRPO, RLOO).

Inputs arrive validated by :mod:`rl_kernel_core.advantages.api`. Group statistics come from
``torch.segment_reduce`` over rewards laid out group by group (a stable sort by group id when
groups are given by index): every reduction has a fixed order and no float atomics, so results
are bitwise reproducible. Arithmetic is fp64 whatever the rewards' dtype: ``r - mean`` of two
close rewards, divided by their small std, loses digits in fp32 (N scalars cost nothing to
upcast); the result is rounded to fp32 (kept fp64 for fp64 rewards). The mean is formed relative
to the group's first reward, so a group of equal rewards has ``r - mean`` and ``std`` exactly 0;
a zero ``std + eps`` (``eps = 0``) then gives advantage 0, not 0/0.

The formulas follow verl 0.9.1 ``compute_grpo_outcome_advantage`` and
``compute_rloo_outcome_advantage``; ``docs/advantages.md`` states them.
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch


def _group_stats(
    values: torch.Tensor, counts: torch.Tensor, group_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element group mean and unbiased std (two-pass) for ``values`` laid out group by group.

    The mean is the group's first value plus the mean of the differences from it: exact for a
    group of equal values."""
    n = counts.to(values.dtype)
    first = values[torch.cumsum(counts, 0) - counts]
    mean = first + torch.segment_reduce(values - first[group_of], "sum", lengths=counts) / n
    centered = values - mean[group_of]
    sq = torch.segment_reduce(centered * centered, "sum", lengths=counts)
    std = (sq / torch.where(n > 1, n - 1, torch.ones_like(n))).sqrt()
    return mean[group_of], std[group_of]


def _estimate(
    values: torch.Tensor, counts: torch.Tensor, group_of: torch.Tensor, estimator: str, norm_by_std: bool, eps: float
) -> torch.Tensor:
    mean, std = _group_stats(values, counts, group_of)
    size = counts[group_of].to(values.dtype)
    single = size == 1
    if estimator == "rloo":
        return torch.where(
            single, values, (values - mean) * size / torch.where(single, torch.ones_like(size), size - 1)
        )
    centered = values - torch.where(single, torch.zeros_like(mean), mean)
    if estimator == "grpo" and norm_by_std:
        den = torch.where(single, torch.ones_like(std), std) + eps
        return centered / torch.where(den == 0, torch.ones_like(den), den)  # std = eps = 0: r - mean is 0
    return centered


@dispatch.register("group_advantages", "torch")
def group_advantages(
    rewards: torch.Tensor,
    group_size: Optional[int],
    group_index: Optional[torch.Tensor],
    *,
    estimator: str,
    norm_by_std: bool,
    eps: float,
) -> torch.Tensor:
    """Advantages ``[N]`` from rewards ``[N]``; exactly one of ``group_size``/``group_index`` is set."""
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    values = rewards.detach().to(torch.float64)
    if values.numel() == 0:
        return values.new_empty(0, dtype=out_dtype)
    device = values.device
    if group_index is None:
        assert group_size is not None, "exactly one of group_size and group_index is set"
        num_groups = values.numel() // group_size
        counts = torch.full((num_groups,), group_size, dtype=torch.int64, device=device)
        group_of = torch.arange(num_groups, device=device).repeat_interleave(group_size)
        return _estimate(values, counts, group_of, estimator, norm_by_std, eps).to(out_dtype)
    order = torch.argsort(group_index, stable=True)
    _, counts = torch.unique_consecutive(group_index[order], return_counts=True)
    group_of = torch.arange(counts.numel(), device=device).repeat_interleave(counts)
    sorted_adv = _estimate(values[order], counts, group_of, estimator, norm_by_std, eps)
    out = torch.empty_like(sorted_adv)
    out[order] = sorted_adv
    return out.to(out_dtype)
