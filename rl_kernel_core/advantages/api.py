"""Group-relative advantages for GRPO-style training: :func:`group_advantages`.

The public op checks its arguments (errors name the argument, expected and found), then runs
the implementation :func:`rl_kernel_core.dispatch.select` picks.

Backend implementation signature (``dispatch.register("group_advantages", backend)``):
``fn(rewards, group_size, group_index, *, estimator, norm_by_std, eps) -> advantages``.
``rewards [N]`` float, N >= 1 (empty rewards never reach a backend); exactly one of ``group_size`` (int > 0 dividing N: groups are contiguous
runs) and ``group_index`` (``[N]`` int64/int32 ids, any order, same device) is not None;
``estimator`` in :data:`ESTIMATORS`; ``norm_by_std`` bool; ``eps`` float >= 0. Returns ``[N]``
fp32 (fp64 for fp64 rewards), not differentiable, computed in fp64 with deterministic
reductions (no float atomics: bitwise equal run to run).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.advantages import reference as _reference  # registers the torch backend

ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")


def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: Optional[int] = None,
    group_index: Optional[torch.Tensor] = None,
    estimator: str = "grpo",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-response advantages from scalar rewards, normalised within each prompt's group.

    Args:
        rewards: ``[N]`` float, one outcome reward per response.
        group_size: responses per prompt when the N responses are laid out prompt by prompt
            (N must be divisible by it). Exactly one of ``group_size`` and ``group_index``.
        group_index: ``[N]`` int64/int32 prompt ids, any order (verl's ``uid`` as integers).
        estimator: with ``r`` a reward and ``mean``/``std`` over its group (``std`` unbiased, as
            ``torch.std``):

            * ``"grpo"``: ``(r - mean) / (std + eps)``; ``r - mean`` when ``norm_by_std`` is
              False (verl's ``norm_adv_by_std_in_grpo``).
            * ``"dr_grpo"``: ``r - mean`` (Dr.GRPO: no std normalisation).
            * ``"rloo"``: ``r - mean of the other rewards in the group``
              (= ``n/(n-1)·(r - mean)``).

            A group of one response gets mean 0 and std 1 (``grpo``: ``r / (1 + eps)``;
            ``dr_grpo`` and ``rloo``: ``r``), as verl does.
        norm_by_std: only read by ``"grpo"``.
        eps: >= 0, added to the std. Where ``std + eps`` is 0 (equal rewards with ``eps = 0``:
            ``r - mean`` is then exactly 0) the advantage is 0.
        backend: ``"auto"`` or a name from ``dispatch.BACKENDS``.

    Returns:
        ``[N]`` advantages, fp32 (fp64 for fp64 rewards), detached from ``rewards``'s graph.
        Group statistics are computed in fp64 (a small std amplifies fp32 rounding of
        ``r - mean``), then rounded. Deterministic: bitwise equal run to run on one device and
        backend.
    """
    _checks.tensor("rewards", rewards, dtypes=_checks.FLOAT_DTYPES, ndim=1)
    n = rewards.shape[0]
    if (group_size is None) == (group_index is None):
        raise ValueError(
            "exactly one of group_size and group_index must be given, got "
            f"group_size={group_size!r} and group_index={'None' if group_index is None else 'a tensor'}"
        )
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size <= 0 or n % group_size != 0:
            raise ValueError(f"group_size must be a positive divisor of N = rewards.shape[0] = {n}, got {group_size}")
    else:
        group_index = _checks.tensor("group_index", group_index, dtypes=_checks.INDEX_DTYPES, ndim=1)
        _checks.shape("group_index", group_index, (n,), f"[N] = ({n},) like rewards")
        _checks.same_device("rewards", rewards, group_index=group_index)
        _checks.needs_data("group_index", group_index, "its ids define the groups")
    _checks.choice("estimator", estimator, ESTIMATORS)
    if not isinstance(norm_by_std, bool):
        raise TypeError(f"norm_by_std must be a bool, got {type(norm_by_std).__name__}")
    eps = _checks.non_negative("eps", eps)
    kwargs = {"estimator": estimator, "norm_by_std": norm_by_std, "eps": eps}
    if n == 0:
        return _reference.group_advantages(rewards, group_size, group_index, **kwargs)
    fn = dispatch.select("group_advantages", backend, rewards.device, rewards, group_size, group_index, **kwargs)
    return fn(rewards, group_size, group_index, **kwargs)
