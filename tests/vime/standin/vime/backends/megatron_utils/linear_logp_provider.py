"""Contract stand-in for ``vime.backends.megatron_utils.linear_logp_provider`` (not vime).

vime's provider boundary for the actor's selected log-probs (``--linear-logp-provider
MODULE.ATTR``, ``--linear-logp-provider-mode auto|strict``), reproduced from the module as it
stands at RL-Align/vime commit 33254c738f1d43250916ae6887f7981e77dbe411 (the upstream of vime
pull requests 423/424): the same names, fields, signatures, request checks and the same
``auto``/``strict`` decisions, written anew. What it keeps:

* vime resolves the provider on every call through :func:`linear_logp_provider_path` and
  :func:`linear_logp_provider_mode` (module globals, read from ``args``);
* ``auto`` runs vime's native function when the provider cannot be imported or raises an
  exception whose ``linear_logp_provider_unavailable`` attribute is true; ``strict`` turns both
  into ``RuntimeError("linear_logp provider '<path>' is unavailable: <reason>")``;
* any other provider exception, and a result of the wrong shape, device or dtype, fails the
  call in both modes; ``strict`` also wants non-empty ``backend_id``/``contract_id`` and a result
  attached to autograd when the logits (or, with ``with_entropy_grad``, the entropy) need it;
* a provider may return :class:`LinearLogpResult`, a mapping or any object with its fields.

Left out: vime's one-time log lines naming the native or provider backend. The machinery this
module shares with ``selected_logprob_provider`` (vime repeats it there) is written once in
:mod:`vime.backends.megatron_utils._provider_boundary`, a stand-in module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from vime.backends.megatron_utils import _provider_boundary as shared
from vime.backends.megatron_utils._provider_boundary import ProviderMode

logger = logging.getLogger(__name__)

TokenLayoutKind = Literal["single", "zigzag", "allgather"]


class LinearLogpProviderUnavailable(RuntimeError):
    """Raised by a provider to ask for vime's native path (``auto``); ``strict`` refuses it."""

    linear_logp_provider_unavailable = True


@dataclass(frozen=True)
class TokenLayout:
    """Which context-parallel rank owns the local token rows, and how rows are split."""

    world_size: int
    rank: int
    layout: TokenLayoutKind

    def __post_init__(self) -> None:
        shared.check_topology("token", self.world_size, self.rank, self.layout)


@dataclass(frozen=True)
class LinearProjection:
    """The local LM-head shard: ``weight [V_local, H]``, ``bias [V_local]`` or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weight, torch.Tensor) or self.weight.ndim != 2:
            raise ValueError("linear_logp projection.weight must be a rank-2 tensor")
        if self.bias is not None:
            if not isinstance(self.bias, torch.Tensor) or self.bias.shape != (self.weight.size(0),):
                raise ValueError("linear_logp projection.bias must match local vocabulary width")
            if self.bias.device != self.weight.device:
                raise ValueError("linear_logp projection tensors must share a device")


@dataclass(frozen=True)
class VocabPartition:
    """This rank's contiguous slice ``[local_start, local_start + local_size)`` of the padded vocabulary."""

    local_start: int
    local_size: int
    real_size: int
    padded_size: int

    def __post_init__(self) -> None:
        if self.local_start < 0 or self.local_size <= 0:
            raise ValueError("linear_logp vocabulary partition must have a non-empty non-negative local range")
        if not 0 < self.real_size <= self.padded_size:
            raise ValueError("linear_logp vocabulary sizes are invalid")
        if self.local_start + self.local_size > self.padded_size:
            raise ValueError("linear_logp local vocabulary range exceeds padded vocabulary")


@dataclass(frozen=True)
class LinearLogpContext:
    """Hidden states ``[T, H]`` and the projection that produced the logits, for fused providers."""

    hidden: torch.Tensor
    projection: LinearProjection
    vocab_partition: VocabPartition

    def __post_init__(self) -> None:
        if not isinstance(self.hidden, torch.Tensor) or self.hidden.ndim != 2:
            raise ValueError("linear_logp context.hidden must be [T, hidden]")
        if self.hidden.size(1) != self.projection.weight.size(1):
            raise ValueError("linear_logp hidden width must match projection width")
        if self.projection.weight.size(0) != self.vocab_partition.local_size:
            raise ValueError("linear_logp projection width must match vocabulary partition")
        if self.hidden.device != self.projection.weight.device:
            raise ValueError("linear_logp context tensors must share a device")


@dataclass(frozen=True)
class LinearLogpRequest:
    """What vime hands a provider: local ``logits [T, V_local]`` (already divided by the rollout
    temperature on vime's native route), global ``target_ids [T]``, the TP group, the CP row
    ownership, entropy flags, the top-p replay ``log_prob_keep_mask [T, V_local]`` (bool) or None,
    the optional hidden-state context, the temperature and free-form metadata."""

    logits: torch.Tensor
    target_ids: torch.Tensor
    tensor_parallel_group: Any
    token_layout: TokenLayout
    with_entropy: bool
    with_entropy_grad: bool
    chunk_size: int
    log_prob_keep_mask: torch.Tensor | None = None
    context: LinearLogpContext | None = None
    temperature: float | torch.Tensor | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.logits, torch.Tensor) or self.logits.ndim != 2:
            raise ValueError(f"linear_logp logits must be [T, V_local], got {getattr(self.logits, 'shape', None)}")
        rows = self.logits.size(0)
        shared.check_targets("linear_logp", self.logits, self.target_ids, self.log_prob_keep_mask)
        if self.context is not None:
            if self.context.hidden.size(0) != rows:
                raise ValueError("linear_logp context rows must match local logits rows")
            if self.context.projection.weight.size(0) != self.logits.size(1):
                raise ValueError("linear_logp projection rows must match local logits width")
            if self.context.hidden.device != self.logits.device:
                raise ValueError("linear_logp context must share the logits device")
        shared.check_temperature(self.temperature, rows)


@dataclass(frozen=True)
class LinearLogpResult:
    """A provider's answer: ``logp [T, 1]``, ``entropy [T]`` or None, and who computed them."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class LinearLogpProvider(Protocol):
    def __call__(self, request: LinearLogpRequest) -> LinearLogpResult: ...


_BOUNDARY = shared.Boundary(
    flag="linear_logp_provider", label="linear_logp", logp_field="logp", result_class=LinearLogpResult, logger=logger
)


def linear_logp_provider_path(args: Any) -> str | None:
    """``args.linear_logp_provider`` stripped, or None when unset or blank."""
    return shared.provider_path(_BOUNDARY, args)


def linear_logp_provider_mode(args: Any) -> ProviderMode:
    """``args.linear_logp_provider_mode`` (default ``auto``), lower-cased; anything else is an error."""
    return shared.provider_mode(_BOUNDARY, args)


def compute_linear_logp(
    *,
    args: Any,
    request: LinearLogpRequest,
    native: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp [T, 1], entropy [T] or None)`` from the configured provider, or from ``native``."""
    return shared.compute(_BOUNDARY, args, request, native, linear_logp_provider_path, linear_logp_provider_mode)
