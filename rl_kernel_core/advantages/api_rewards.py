"""Rewards to token-level advantages: :func:`token_advantages`.

A response can be rewarded at three levels: the whole sequence (an outcome reward: the answer
is right), a region (a reward attached to a span of tokens: a grounded box, a tool call, an
answer field) and steps (process rewards at the end of each reasoning step). A cost signal
(a safety or length cost, for constrained RL) is kept apart: it is normalised and scattered the
same way but returned as its own tensor, never added to the reward.

Per level, values are normalised within each prompt's group of ``group_size`` consecutive
responses with the GRPO-family estimators of :func:`rl_kernel_core.group_advantages`, then
placed on tokens:

* sequence ``r_b``: ``group_advantages`` over the B rewards; every response token of b gets it.
* steps ``(end_bk, r_bk)``: normalised over all steps of the group's responses (DeepSeekMath's
  process supervision); token t of b gets the sum over b's steps that end at or after t
  (``end_bk >= t``), so a token is credited with the steps it leads to.
* regions ``(start_br, length_br, r_br)``: normalised over all regions of the group's
  responses; token t of b gets the sum over b's regions that contain it.

The levels' token advantages add up; the result is zero outside ``mask``. Steps and regions
come padded per sequence (``[B, K]``), so every shape is fixed by the inputs: no host sync, no
data-dependent shapes, and every sum runs over a fixed dim in fp64 (deterministic, bitwise
equal run to run). Step and region statistics use the formulas of ``group_advantages`` over
their valid entries only (that op takes no mask, and compacting the valid entries would need a
data-dependent shape): mean and unbiased std over the group's entries, a group of one entry
gets mean 0 and std 1, ``std + eps == 0`` gives 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from rl_kernel_core import _checks
from rl_kernel_core.advantages.api import ESTIMATORS, group_advantages


@dataclass(frozen=True)
class Steps:
    """Per-step rewards, padded per sequence: ``ends [B, K]`` int64/int32, the position (on the
    token axis T) of each step's last token, negative for padding; ``values [B, K]`` float."""

    ends: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class Regions:
    """Span-attached rewards, padded per sequence: ``starts [B, R]`` and ``lengths [B, R]``
    int64/int32 on the token axis (length 0 for padding), ``values [B, R]`` float."""

    starts: torch.Tensor
    lengths: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class Signal:
    """One signal (the reward, or the cost) at any of the three levels; None where absent.
    ``sequence``: ``[B]`` float."""

    sequence: Optional[torch.Tensor] = None
    steps: Optional[Steps] = None
    regions: Optional[Regions] = None


class TokenAdvantages(NamedTuple):
    """``rewards``: ``[B, T]`` fp32 token advantages of the reward; ``costs``: the same of the
    cost, or None without a cost signal."""

    rewards: torch.Tensor
    costs: Optional[torch.Tensor]


def _check_items(name: str, mask: torch.Tensor, positions: dict[str, torch.Tensor], values: torch.Tensor) -> None:
    _checks.tensor(f"{name}.values", values, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    if values.shape[0] != mask.shape[0]:
        raise ValueError(f"{name}.values must have B = {mask.shape[0]} rows (mask's), got shape {tuple(values.shape)}")
    for field, t in positions.items():
        _checks.tensor(f"{name}.{field}", t, dtypes=_checks.INDEX_DTYPES, ndim=2)
    _checks.same_shape(f"{name}.values", values, **{f"{name}.{f}": t for f, t in positions.items()})
    _checks.same_device("mask", mask, **{f"{name}.values": values}, **{f"{name}.{f}": t for f, t in positions.items()})


def _check_ranges(
    name: str, seq_len: int, starts: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor, what: str
) -> None:
    """Valid entries ``[start, start + length)`` must lie in ``[0, seq_len)``: ``0 <= start`` and
    ``length <= seq_len - start``, compared without forming ``start + length`` (which wraps around
    in int64 or int32 and would let a region far outside the sequence pass). Read on CPU, and on
    GPUs with ``RL_KERNEL_CHECK_VALUES``."""
    if not _checks.values_checked(starts):
        return
    bad = valid & ((starts < 0) | (starts >= seq_len) | (lengths > seq_len - starts))
    if bool(bad.any()):
        b, k = (int(i) for i in bad.nonzero()[0])
        low = int(starts[b, k])
        raise ValueError(
            f"{name}[{b}][{k}]: {what} must lie in [0, {seq_len}) (mask's T), got [{low}, {low + int(lengths[b, k])})"
        )


def _group_normalised(
    values: torch.Tensor, valid: torch.Tensor, group_size: int, estimator: str, norm_by_std: bool, eps: float
) -> torch.Tensor:
    """``[B, K]`` fp64 advantages of the valid entries, normalised over each group's valid entries
    (``group_advantages``' formulas); 0 at invalid entries."""
    b, k = values.shape
    if k == 0:
        return torch.zeros((b, 0), dtype=torch.float64, device=values.device)
    v = values.detach().to(torch.float64).reshape(b // group_size, group_size * k)
    w = valid.reshape(v.shape)
    n = w.sum(dim=1, keepdim=True).to(torch.float64)
    # relative to the group's first valid entry, so a group of equal values is centred exactly
    ref = v.gather(1, w.to(torch.int8).argmax(dim=1, keepdim=True))
    mean = ref + torch.where(w, v - ref, 0.0).sum(dim=1, keepdim=True) / n.clamp(min=1)
    centered = torch.where(w, v - mean, 0.0)
    std = ((centered * centered).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    single = n == 1
    if estimator == "rloo":
        adv = torch.where(single, v, centered * n / (n - 1).clamp(min=1))
    else:
        adv = torch.where(single, v, centered)
        if estimator == "grpo" and norm_by_std:
            den = torch.where(single, torch.ones_like(std), std) + eps
            adv = adv / torch.where(den == 0, torch.ones_like(den), den)
    return torch.where(w, adv, 0.0).reshape(b, k)


def _signal_tokens(name: str, signal: Signal, mask: torch.Tensor, group_size: int, kwargs: dict) -> torch.Tensor:
    """``[B, T]`` fp64 token advantages of one signal (before masking)."""
    if not isinstance(signal, Signal):
        raise TypeError(f"{name} must be a rl_kernel_core.advantages.api_rewards.Signal, got {type(signal).__name__}")
    num, seq_len = mask.shape
    positions = torch.arange(seq_len, device=mask.device)
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if signal.sequence is not None:
        seq = _checks.tensor(f"{name}.sequence", signal.sequence, dtypes=_checks.FLOAT_DTYPES, ndim=1)
        _checks.shape(f"{name}.sequence", seq, (num,), f"[B] = ({num},) (mask's B)")
        _checks.same_device("mask", mask, **{f"{name}.sequence": seq})
        out = out + group_advantages(seq, group_size=group_size, **kwargs).to(torch.float64)[:, None]
    if signal.steps is not None:
        steps = signal.steps
        _check_items(f"{name}.steps", mask, {"ends": steps.ends}, steps.values)
        valid = steps.ends >= 0
        _check_ranges(
            f"{name}.steps.ends", seq_len, steps.ends, torch.ones_like(steps.ends), valid, "a step's last token"
        )
        adv = _group_normalised(steps.values, valid, group_size, **kwargs)
        reaches = steps.ends[:, :, None] >= positions
        out = out + torch.where(reaches, adv[:, :, None], 0.0).sum(dim=1)
    if signal.regions is not None:
        regions = signal.regions
        _check_items(f"{name}.regions", mask, {"starts": regions.starts, "lengths": regions.lengths}, regions.values)
        valid = regions.lengths > 0
        _check_ranges(f"{name}.regions", seq_len, regions.starts, regions.lengths, valid, "a region")
        adv = _group_normalised(regions.values, valid, group_size, **kwargs)
        offset = positions - regions.starts[:, :, None]  # no start + length: it could wrap around
        inside = (offset >= 0) & (offset < regions.lengths[:, :, None])
        out = out + torch.where(inside, adv[:, :, None], 0.0).sum(dim=1)
    return out


def token_advantages(
    mask: torch.Tensor,
    reward: Signal,
    cost: Optional[Signal] = None,
    *,
    group_size: int,
    estimator: str = "grpo",
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> TokenAdvantages:
    """Token-level advantages of a reward signal and, apart, of a cost signal.

    Args:
        mask: ``[B, T]`` bool or float, the response tokens that receive advantages (non-zero);
            a float mask must be >= 0 and not NaN.
        reward: a :class:`Signal`: sequence ``[B]``, :class:`Steps` and/or :class:`Regions`
            over the T axis of ``mask``.
        cost: a :class:`Signal` of costs, normalised and scattered the same way, or None.
        group_size: responses per prompt, laid out prompt by prompt (B divisible by it).
        estimator, norm_by_std, eps: as :func:`rl_kernel_core.group_advantages` (``grpo``,
            ``dr_grpo``, ``rloo`` leave-one-out).

    Returns:
        :class:`TokenAdvantages` ``(rewards, costs)``: ``[B, T]`` fp32 each (``costs`` None
        without ``cost``), 0 outside ``mask``; not differentiable. No host sync for GPU inputs
        (value range checks read CPU tensors only, or GPU ones with ``RL_KERNEL_CHECK_VALUES``).

    Raises:
        ValueError: besides shapes, devices and arguments, a step's end at or beyond T, a region
            (length > 0) not inside ``[0, T)`` (``start + length`` is never formed, so one that
            would wrap around int64 is refused, not dropped), or a float ``mask`` with a negative
            or NaN entry.
    """
    _checks.tensor("mask", mask, dtypes=(torch.bool,) + _checks.FLOAT_DTYPES, ndim=2)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size <= 0 or mask.shape[0] % group_size != 0:
        raise ValueError(
            f"group_size must be a positive divisor of B = mask.shape[0] = {mask.shape[0]}, got {group_size}"
        )
    _checks.choice("estimator", estimator, ESTIMATORS)
    if not isinstance(norm_by_std, bool):
        raise TypeError(f"norm_by_std must be a bool, got {type(norm_by_std).__name__}")
    kwargs = {"estimator": estimator, "norm_by_std": norm_by_std, "eps": _checks.non_negative("eps", eps)}
    _checks.non_negative_weights("mask", mask)
    keep = mask != 0
    rewards = torch.where(keep, _signal_tokens("reward", reward, mask, group_size, kwargs), 0.0).to(torch.float32)
    if cost is None:
        return TokenAdvantages(rewards, None)
    costs = torch.where(keep, _signal_tokens("cost", cost, mask, group_size, kwargs), 0.0).to(torch.float32)
    return TokenAdvantages(rewards, costs)
