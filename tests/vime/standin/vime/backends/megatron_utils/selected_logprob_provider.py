"""Contract stand-in for ``vime.backends.megatron_utils.selected_logprob_provider`` (not vime).

vime's other provider boundary for the actor's selected log-probs (``--selected-logprob-provider
MODULE.ATTR``, ``--selected-logprob-provider-mode auto|strict``), reproduced from the module as it
stands at RL-Align/vime commit e0d231806e06a3000b9ba4f5be4bd7ba235dfcdc: the same names, fields,
signatures, request checks and ``auto``/``strict`` decisions, written anew. What it keeps:

* the request is flat: local ``logits [T, V_local]`` (already divided by the rollout
  temperature), global ``target_ids [T]``, the TP group, the CP row ownership
  (``context_parallel``), the entropy flags, the top-p replay mask, ``metadata``, and the optional
  structural fields ``hidden [T, H]``, ``lm_head_weight [V_local, H]``, ``lm_head_bias [V_local]``,
  ``vocab_start_index`` (this rank's first global id), ``global_vocab_size`` (the padded
  vocabulary, all TP shards), ``real_vocab_size`` (the tokenizer's) and ``temperature`` (vime's
  loss sets it to the rollout temperature, whether or not it passes hidden states);
* vime resolves the provider on every call (:func:`selected_logprob_provider_path`,
  :func:`selected_logprob_provider_mode`, read from ``args``);
* ``auto`` runs vime's native function when the provider cannot be imported, or raises
  :class:`SelectedLogprobProviderUnavailable` or an exception whose
  ``selected_logprob_provider_unavailable`` attribute is true; ``strict`` turns both into
  ``RuntimeError("selected-logprob provider '<path>' is unavailable: <reason>")``;
* any other provider exception, and a result of the wrong shape, device or dtype, fails the call
  in both modes; ``strict`` also wants non-empty ``backend_id``/``contract_id`` and a result
  attached to autograd when the logits (or, with ``with_entropy_grad``, the entropy) need it;
* a provider may return :class:`SelectedLogprobResult`, a mapping or any object with its fields
  (``selected_logprobs [T, 1]``, ``entropy``, ``backend_id``, ``contract_id``, ``provenance``).

Left out: vime's one-time log line naming the provider backend.
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


class SelectedLogprobProviderUnavailable(RuntimeError):
    """Raised by a provider to ask for vime's native path (``auto``); ``strict`` refuses it."""


@dataclass(frozen=True)
class ContextParallelLayout:
    """Which context-parallel rank owns the local logit rows, and how rows are split."""

    world_size: int
    rank: int
    layout: Literal["single", "zigzag", "allgather"]

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid context-parallel topology: world_size={self.world_size}, rank={self.rank}")
        if (self.world_size == 1) != (self.layout == "single"):
            raise ValueError(
                f"layout {self.layout!r} does not fit world_size={self.world_size} ('single' iff one rank)"
            )


@dataclass(frozen=True)
class SelectedLogprobRequest:
    """What vime hands a provider (see the module docstring for the fields)."""

    logits: torch.Tensor
    target_ids: torch.Tensor
    tensor_parallel_group: Any
    context_parallel: ContextParallelLayout
    with_entropy: bool
    with_entropy_grad: bool
    chunk_size: int
    log_prob_keep_mask: torch.Tensor | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    lm_head_weight: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None
    vocab_start_index: int = 0
    global_vocab_size: int | None = None
    real_vocab_size: int | None = None
    temperature: float | torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.logits.ndim != 2:
            raise ValueError(f"selected-logprob logits must be [T, V_local], got {tuple(self.logits.shape)}")
        rows = self.logits.size(0)
        if self.target_ids.shape != (rows,):
            raise ValueError(
                f"selected-logprob target_ids must be [T] aligned with logits; got {tuple(self.target_ids.shape)} for T={rows}"
            )
        if self.target_ids.device != self.logits.device:
            raise ValueError("selected-logprob target_ids must share the logits device")
        if self.target_ids.is_floating_point() or self.target_ids.is_complex():
            raise TypeError("selected-logprob target_ids must use an integer dtype")
        if self.log_prob_keep_mask is not None and self.log_prob_keep_mask.shape != self.logits.shape:
            raise ValueError("selected-logprob log_prob_keep_mask must match logits shape")
        if self.hidden is None and self.lm_head_weight is None:
            if self.lm_head_bias is not None:
                raise ValueError("linear_logp structural request fields must be supplied together")
            return
        if not isinstance(self.hidden, torch.Tensor):
            raise ValueError("linear_logp request.hidden must be a torch.Tensor")
        if not isinstance(self.lm_head_weight, torch.Tensor):
            raise ValueError("linear_logp request.lm_head_weight must be a torch.Tensor")
        if self.hidden.ndim != 2:
            raise ValueError("linear_logp request.hidden must be [T, hidden]")
        if self.lm_head_weight.ndim != 2:
            raise ValueError("linear_logp request.lm_head_weight must be [V_local, hidden]")
        if self.hidden.size(0) != rows:
            raise ValueError("linear_logp hidden rows must match local logits rows")
        if self.hidden.size(1) != self.lm_head_weight.size(1):
            raise ValueError("linear_logp hidden width must match LM-head width")
        if self.hidden.device != self.logits.device or self.lm_head_weight.device != self.logits.device:
            raise ValueError("linear_logp tensors must share the logits device")
        if self.lm_head_bias is not None:
            if not isinstance(self.lm_head_bias, torch.Tensor):
                raise ValueError("linear_logp request.lm_head_bias must be a torch.Tensor")
            if self.lm_head_bias.ndim != 1 or self.lm_head_bias.size(0) != self.lm_head_weight.size(0):
                raise ValueError("linear_logp LM-head bias must match local vocab width")
            if self.lm_head_bias.device != self.logits.device:
                raise ValueError("linear_logp LM-head bias must share the logits device")
        for name, value in (("global_vocab_size", self.global_vocab_size), ("real_vocab_size", self.real_vocab_size)):
            if value is not None and (isinstance(value, bool) or int(value) <= 0):
                raise ValueError(f"linear_logp {name} must be positive")
        if self.temperature is not None:
            if isinstance(self.temperature, torch.Tensor):
                if self.temperature.numel() not in (1, rows):
                    raise ValueError("linear_logp temperature must be scalar or [T]")
                if bool((self.temperature <= 0).any().item()):
                    raise ValueError("linear_logp temperature must be positive")
            elif float(self.temperature) <= 0:
                raise ValueError("linear_logp temperature must be positive")


@dataclass(frozen=True)
class SelectedLogprobResult:
    """A provider's answer: ``selected_logprobs [T, 1]``, ``entropy [T]`` or None, and who computed them."""

    selected_logprobs: torch.Tensor
    entropy: torch.Tensor | None
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class SelectedLogprobProvider(Protocol):
    def __call__(self, request: SelectedLogprobRequest) -> SelectedLogprobResult: ...


def selected_logprob_provider_path(args: Any) -> str | None:
    """``args.selected_logprob_provider`` stripped, or None when unset or blank."""
    path = getattr(args, "selected_logprob_provider", None)
    if path is None:
        return None
    return str(path).strip() or None


def selected_logprob_provider_mode(args: Any) -> ProviderMode:
    """``args.selected_logprob_provider_mode`` (default ``auto``), lower-cased; anything else is an error."""
    raw = getattr(args, "selected_logprob_provider_mode", "auto")
    mode = str(raw).strip().lower()
    if mode not in ("auto", "strict"):
        raise ValueError(f"selected_logprob_provider_mode must be 'auto' or 'strict', got {raw!r}.")
    return mode  # type: ignore[return-value]


def compute_selected_logprobs(
    *,
    args: Any,
    request: SelectedLogprobRequest,
    native: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(selected log-probs [T, 1], entropy [T] or None)`` from the configured provider, or from ``native``."""
    path = selected_logprob_provider_path(args)
    if path is None:
        return _native(request, native)
    mode = selected_logprob_provider_mode(args)
    try:
        provider = _load_provider(path)
    except (ImportError, AttributeError) as exc:
        return _unavailable(path, mode, exc, request, native)
    try:
        result = provider(request)
    except Exception as exc:
        if not _is_provider_unavailable(exc):
            raise
        return _unavailable(path, mode, exc, request, native)
    normalized = _normalize_result(result)
    _validate_result(normalized, request, strict=mode == "strict")
    return normalized.selected_logprobs, normalized.entropy


def _unavailable(
    path: str, mode: ProviderMode, exc: Exception, request: SelectedLogprobRequest, native: Callable
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if mode == "strict":
        raise RuntimeError(f"selected-logprob provider {path!r} is unavailable: {exc}") from exc
    logger.warning("Selected-logprob provider %s is unavailable; using native path: %s", path, exc)
    return _native(request, native)


def _load_provider(path: str) -> SelectedLogprobProvider:
    module_path, dot, attribute = path.rpartition(".")
    if not dot or not module_path or not attribute:
        raise ImportError("provider must use the import path 'package.module.callable'")
    provider = getattr(importlib.import_module(module_path), attribute)
    if not callable(provider):
        raise TypeError(f"selected-logprob provider {path!r} is not callable")
    return provider


def _native(request: SelectedLogprobRequest, native: Callable) -> tuple[torch.Tensor, torch.Tensor | None]:
    return native(
        request.logits,
        request.target_ids,
        request.tensor_parallel_group,
        with_entropy=request.with_entropy,
        with_entropy_grad=request.with_entropy_grad,
        chunk_size=request.chunk_size,
        log_prob_keep_mask=request.log_prob_keep_mask,
    )


def _is_provider_unavailable(exc: Exception) -> bool:
    """vime's class or the marker attribute, so a provider package need not import vime."""
    return isinstance(exc, SelectedLogprobProviderUnavailable) or bool(
        getattr(exc, "selected_logprob_provider_unavailable", False)
    )


def _normalize_result(result: Any) -> SelectedLogprobResult:
    if isinstance(result, SelectedLogprobResult):
        return result
    names = ("provenance", "selected_logprobs", "entropy", "backend_id", "contract_id")
    try:
        if isinstance(result, Mapping):
            values = {name: result[name] for name in names}
        else:
            values = {name: getattr(result, name) for name in names}
    except (AttributeError, KeyError) as exc:
        raise TypeError(
            "selected-logprob providers must return selected_logprobs, entropy, backend_id, contract_id, and provenance"
        ) from exc
    if not isinstance(values["provenance"], Mapping):
        raise TypeError("selected-logprob provider provenance must be a mapping")
    return SelectedLogprobResult(**values)


def _validate_result(result: SelectedLogprobResult, request: SelectedLogprobRequest, *, strict: bool) -> None:
    rows = request.logits.size(0)
    if result.selected_logprobs.shape != (rows, 1):
        raise ValueError(
            f"selected-logprob provider returned invalid selected_logprobs shape {tuple(result.selected_logprobs.shape)}; expected {(rows, 1)}."
        )
    if result.selected_logprobs.device != request.logits.device:
        raise ValueError("selected-logprob provider returned selected_logprobs on a different device")
    if not result.selected_logprobs.is_floating_point():
        raise TypeError("selected-logprob provider must return floating-point selected_logprobs")
    if request.with_entropy:
        if result.entropy is None or result.entropy.shape != (rows,):
            raise ValueError("selected-logprob provider must return [T] entropy when with_entropy=True")
        if result.entropy.device != request.logits.device:
            raise ValueError("selected-logprob provider returned entropy on a different device")
        if not result.entropy.is_floating_point():
            raise TypeError("selected-logprob provider must return floating-point entropy")
    elif result.entropy is not None:
        raise ValueError("selected-logprob provider returned entropy when with_entropy=False")
    if strict:
        if not result.backend_id or not result.contract_id:
            raise ValueError("strict selected-logprob provider runs require non-empty backend_id and contract_id")
        if request.logits.requires_grad and not result.selected_logprobs.requires_grad:
            raise ValueError("strict selected-logprob provider result is detached from autograd")
        if request.with_entropy_grad and result.entropy is not None and not result.entropy.requires_grad:
            raise ValueError("strict selected-logprob provider entropy is detached from autograd")
