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

Left out: vime's one-time log lines naming the native or provider backend.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)

ProviderMode = Literal["auto", "strict"]
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
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid token topology: world_size={self.world_size}, rank={self.rank}")
        if (self.world_size == 1) != (self.layout == "single"):
            raise ValueError(
                f"layout {self.layout!r} does not fit world_size={self.world_size} ('single' iff one rank)"
            )


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
        if self.target_ids.shape != (rows,):
            raise ValueError(
                f"linear_logp target_ids must be [T] aligned with logits; got {tuple(self.target_ids.shape)} for T={rows}"
            )
        if self.target_ids.device != self.logits.device:
            raise ValueError("linear_logp target_ids must share the logits device")
        if self.target_ids.is_floating_point() or self.target_ids.is_complex():
            raise TypeError("linear_logp target_ids must use an integer dtype")
        if self.log_prob_keep_mask is not None and self.log_prob_keep_mask.shape != self.logits.shape:
            raise ValueError("linear_logp log_prob_keep_mask must match logits shape")
        if self.context is not None:
            if self.context.hidden.size(0) != rows:
                raise ValueError("linear_logp context rows must match local logits rows")
            if self.context.projection.weight.size(0) != self.logits.size(1):
                raise ValueError("linear_logp projection rows must match local logits width")
            if self.context.hidden.device != self.logits.device:
                raise ValueError("linear_logp context must share the logits device")
        if self.temperature is not None:  # as vime: "<= 0" is refused, so NaN passes
            if isinstance(self.temperature, torch.Tensor):
                if self.temperature.numel() not in (1, rows):
                    raise ValueError("linear_logp temperature must be scalar or [T]")
                if bool((self.temperature <= 0).any().item()):
                    raise ValueError("linear_logp temperature must be positive")
            elif float(self.temperature) <= 0:
                raise ValueError("linear_logp temperature must be positive")


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


def linear_logp_provider_path(args: Any) -> str | None:
    """``args.linear_logp_provider`` stripped, or None when unset or blank."""
    path = getattr(args, "linear_logp_provider", None)
    if path is None:
        return None
    return str(path).strip() or None


def linear_logp_provider_mode(args: Any) -> ProviderMode:
    """``args.linear_logp_provider_mode`` (default ``auto``), lower-cased; anything else is an error."""
    raw = getattr(args, "linear_logp_provider_mode", "auto")
    mode = str(raw).strip().lower()
    if mode not in ("auto", "strict"):
        raise ValueError(f"linear_logp_provider_mode must be 'auto' or 'strict', got {raw!r}.")
    return mode  # type: ignore[return-value]


def compute_linear_logp(
    *,
    args: Any,
    request: LinearLogpRequest,
    native: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp [T, 1], entropy [T] or None)`` from the configured provider, or from ``native``."""
    path = linear_logp_provider_path(args)
    if path is None:
        return _native(request, native)
    mode = linear_logp_provider_mode(args)
    try:
        provider = _load_provider(path)
    except (ImportError, AttributeError) as exc:
        return _unavailable(path, mode, exc, request, native)
    try:
        result = provider(request)
    except Exception as exc:
        if not bool(getattr(exc, "linear_logp_provider_unavailable", False)):
            raise
        return _unavailable(path, mode, exc, request, native)
    normalized = _normalize_result(result)
    _validate_result(normalized, request, strict=mode == "strict")
    return normalized.logp, normalized.entropy


def _unavailable(
    path: str, mode: ProviderMode, exc: Exception, request: LinearLogpRequest, native: Callable
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if mode == "strict":
        raise RuntimeError(f"linear_logp provider {path!r} is unavailable: {exc}") from exc
    logger.warning("linear_logp provider %s is unavailable; using native path: %s", path, exc)
    return _native(request, native)


def _load_provider(path: str) -> LinearLogpProvider:
    module_path, dot, attribute = path.rpartition(".")
    if not dot or not module_path or not attribute:
        raise ImportError("provider must use the import path 'package.module.callable'")
    provider = getattr(importlib.import_module(module_path), attribute)
    if not callable(provider):
        raise TypeError(f"linear_logp provider {path!r} is not callable")
    return provider


def _native(request: LinearLogpRequest, native: Callable) -> tuple[torch.Tensor, torch.Tensor | None]:
    return native(
        request.logits,
        request.target_ids,
        request.tensor_parallel_group,
        with_entropy=request.with_entropy,
        with_entropy_grad=request.with_entropy_grad,
        chunk_size=request.chunk_size,
        log_prob_keep_mask=request.log_prob_keep_mask,
    )


def _normalize_result(result: Any) -> LinearLogpResult:
    if isinstance(result, LinearLogpResult):
        return result
    names = ("logp", "entropy", "backend_id", "contract_id", "provenance")
    try:
        if isinstance(result, Mapping):
            values = {name: result[name] for name in names}
        else:
            values = {name: getattr(result, name) for name in names}
    except (AttributeError, KeyError) as exc:
        raise TypeError(
            "linear_logp providers must return logp, entropy, backend_id, contract_id, and provenance"
        ) from exc
    if not isinstance(values["provenance"], Mapping):
        raise TypeError("linear_logp provider provenance must be a mapping")
    return LinearLogpResult(**values)


def _validate_result(result: LinearLogpResult, request: LinearLogpRequest, *, strict: bool) -> None:
    rows = request.logits.size(0)
    if result.logp.shape != (rows, 1):
        raise ValueError(
            f"linear_logp provider returned invalid logp shape {tuple(result.logp.shape)}; expected {(rows, 1)}."
        )
    if result.logp.device != request.logits.device:
        raise ValueError("linear_logp provider returned logp on a different device")
    if not result.logp.is_floating_point():
        raise TypeError("linear_logp provider must return floating-point logp")
    if request.with_entropy:
        if result.entropy is None or result.entropy.shape != (rows,):
            raise ValueError("linear_logp provider must return [T] entropy when with_entropy=True")
        if result.entropy.device != request.logits.device:
            raise ValueError("linear_logp provider returned entropy on a different device")
        if not result.entropy.is_floating_point():
            raise TypeError("linear_logp provider must return floating-point entropy")
    elif result.entropy is not None:
        raise ValueError("linear_logp provider returned entropy when with_entropy=False")
    if strict:
        if not result.backend_id or not result.contract_id:
            raise ValueError("strict linear_logp runs require non-empty backend_id and contract_id")
        if request.logits.requires_grad and not result.logp.requires_grad:
            raise ValueError("strict linear_logp result is detached from autograd")
        if request.with_entropy_grad and result.entropy is not None and not result.entropy.requires_grad:
            raise ValueError("strict linear_logp entropy is detached from autograd")
