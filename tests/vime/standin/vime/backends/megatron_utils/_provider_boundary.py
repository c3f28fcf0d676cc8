"""What the stand-in's two provider boundaries share (a stand-in module, not one of vime's).

vime's ``linear_logp_provider`` and ``selected_logprob_provider`` modules each carry their own
copy of the same machinery: resolving the provider from ``args``, the ``auto``/``strict``
decisions, the request checks on targets, keep mask, temperature and context-parallel topology,
and the result checks. The stand-in writes it once here; the two modules keep vime's public
names and signatures and call in with their :class:`Boundary`, which holds what differs: the
flag, the log-prob field, the result class, how an "unavailable" exception is recognised, and
the words vime's messages use for each boundary.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

ProviderMode = Literal["auto", "strict"]
Native = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Boundary:
    """One boundary's names. A provider asks for vime's native path by raising an exception whose
    ``<flag>_unavailable`` attribute is true (so a provider package need not import vime), or,
    where the boundary has one, an instance of its own exception class."""

    flag: str
    """The ``args`` attribute naming the provider; its mode is ``<flag>_mode``."""
    label: str
    """The messages' name for the boundary (``linear_logp``, ``selected-logprob``)."""
    logp_field: str
    """The result's log-prob field (``logp``, ``selected_logprobs``)."""
    result_class: type
    """The boundary's result class, built from its five fields."""
    logger: logging.Logger
    """The boundary module's logger, where the ``auto`` fallback's warning goes."""
    unavailable_class: type[Exception] | None = None
    """The boundary's own "unavailable" exception class, where it has one vime checks for."""
    strict_label: str | None = None
    """The name in the ``strict`` result checks' messages, where vime words it otherwise than ``label``."""
    warning_label: str | None = None
    """The name in the ``auto`` fallback's warning, where vime words it otherwise than ``label``."""

    def is_unavailable(self, exc: Exception) -> bool:
        """Whether a provider's exception asks for vime's native path."""
        if self.unavailable_class is not None and isinstance(exc, self.unavailable_class):
            return True
        return bool(getattr(exc, f"{self.flag}_unavailable", False))


def provider_path(boundary: Boundary, args: Any) -> str | None:
    """``args.<flag>`` stripped, or None when unset or blank."""
    path = getattr(args, boundary.flag, None)
    if path is None:
        return None
    return str(path).strip() or None


def provider_mode(boundary: Boundary, args: Any) -> ProviderMode:
    """``args.<flag>_mode`` (default ``auto``), lower-cased; anything else is an error."""
    raw = getattr(args, f"{boundary.flag}_mode", "auto")
    mode = str(raw).strip().lower()
    if mode not in ("auto", "strict"):
        raise ValueError(f"{boundary.flag}_mode must be 'auto' or 'strict', got {raw!r}.")
    return mode  # type: ignore[return-value]


def check_topology(what: str, world_size: int, rank: int, layout: str) -> None:
    """A context-parallel layout's checks: ``rank`` in ``[0, world_size)``, ``single`` iff one rank."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid {what} topology: world_size={world_size}, rank={rank}")
    if (world_size == 1) != (layout == "single"):
        raise ValueError(f"layout {layout!r} does not fit world_size={world_size} ('single' iff one rank)")


def check_targets(label: str, logits: torch.Tensor, target_ids: torch.Tensor, keep: torch.Tensor | None) -> None:
    """``target_ids`` integer ``[T]`` on the logits' device, ``keep`` (if any) of the logits' shape."""
    rows = logits.size(0)
    if target_ids.shape != (rows,):
        raise ValueError(
            f"{label} target_ids must be [T] aligned with logits; got {tuple(target_ids.shape)} for T={rows}"
        )
    if target_ids.device != logits.device:
        raise ValueError(f"{label} target_ids must share the logits device")
    if target_ids.is_floating_point() or target_ids.is_complex():
        raise TypeError(f"{label} target_ids must use an integer dtype")
    if keep is not None and keep.shape != logits.shape:
        raise ValueError(f"{label} log_prob_keep_mask must match logits shape")


def check_temperature(temperature: float | torch.Tensor | None, rows: int) -> None:
    """A scalar or ``[T]`` temperature, refused when ``<= 0`` (as vime: so NaN passes); both
    boundaries word these messages as ``linear_logp``."""
    if temperature is None:
        return
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() not in (1, rows):
            raise ValueError("linear_logp temperature must be scalar or [T]")
        if bool((temperature <= 0).any().item()):
            raise ValueError("linear_logp temperature must be positive")
    elif float(temperature) <= 0:
        raise ValueError("linear_logp temperature must be positive")


def compute(
    boundary: Boundary,
    args: Any,
    request: Any,
    native: Native,
    path_of: Callable[[Any], str | None],
    mode_of: Callable[[Any], ProviderMode],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log-probs [T, 1], entropy [T] or None)`` from the provider ``path_of(args)`` names, or
    from ``native``; the boundary module passes its own resolvers, as vime looks them up per call."""
    path = path_of(args)
    if path is None:
        return _native(request, native)
    mode = mode_of(args)
    try:
        provider = _load_provider(boundary, path)
    except (ImportError, AttributeError) as exc:
        return _unavailable(boundary, path, mode, exc, request, native)
    try:
        result = provider(request)
    except Exception as exc:
        if not boundary.is_unavailable(exc):
            raise
        return _unavailable(boundary, path, mode, exc, request, native)
    normalized = _normalize_result(boundary, result)
    _validate_result(boundary, normalized, request, strict=mode == "strict")
    return getattr(normalized, boundary.logp_field), normalized.entropy


def _unavailable(
    boundary: Boundary, path: str, mode: ProviderMode, exc: Exception, request: Any, native: Native
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if mode == "strict":
        raise RuntimeError(f"{boundary.label} provider {path!r} is unavailable: {exc}") from exc
    label = boundary.warning_label or boundary.label
    boundary.logger.warning("%s provider %s is unavailable; using native path: %s", label, path, exc)
    return _native(request, native)


def _load_provider(boundary: Boundary, path: str) -> Callable[[Any], Any]:
    module_path, dot, attribute = path.rpartition(".")
    if not dot or not module_path or not attribute:
        raise ImportError("provider must use the import path 'package.module.callable'")
    provider = getattr(importlib.import_module(module_path), attribute)
    if not callable(provider):
        raise TypeError(f"{boundary.label} provider {path!r} is not callable")
    return provider


def _native(request: Any, native: Native) -> tuple[torch.Tensor, torch.Tensor | None]:
    return native(
        request.logits,
        request.target_ids,
        request.tensor_parallel_group,
        with_entropy=request.with_entropy,
        with_entropy_grad=request.with_entropy_grad,
        chunk_size=request.chunk_size,
        log_prob_keep_mask=request.log_prob_keep_mask,
    )


def _normalize_result(boundary: Boundary, result: Any) -> Any:
    if isinstance(result, boundary.result_class):
        return result
    names = (boundary.logp_field, "entropy", "backend_id", "contract_id", "provenance")
    try:
        if isinstance(result, Mapping):
            values = {name: result[name] for name in names}
        else:
            values = {name: getattr(result, name) for name in names}
    except (AttributeError, KeyError) as exc:
        raise TypeError(
            f"{boundary.label} providers must return {boundary.logp_field}, entropy, backend_id, contract_id, and provenance"
        ) from exc
    if not isinstance(values["provenance"], Mapping):
        raise TypeError(f"{boundary.label} provider provenance must be a mapping")
    return boundary.result_class(**values)


def _validate_result(boundary: Boundary, result: Any, request: Any, *, strict: bool) -> None:
    label, field = boundary.label, boundary.logp_field
    logp = getattr(result, field)
    rows = request.logits.size(0)
    if logp.shape != (rows, 1):
        raise ValueError(f"{label} provider returned invalid {field} shape {tuple(logp.shape)}; expected {(rows, 1)}.")
    if logp.device != request.logits.device:
        raise ValueError(f"{label} provider returned {field} on a different device")
    if not logp.is_floating_point():
        raise TypeError(f"{label} provider must return floating-point {field}")
    if request.with_entropy:
        if result.entropy is None or result.entropy.shape != (rows,):
            raise ValueError(f"{label} provider must return [T] entropy when with_entropy=True")
        if result.entropy.device != request.logits.device:
            raise ValueError(f"{label} provider returned entropy on a different device")
        if not result.entropy.is_floating_point():
            raise TypeError(f"{label} provider must return floating-point entropy")
    elif result.entropy is not None:
        raise ValueError(f"{label} provider returned entropy when with_entropy=False")
    if strict:
        strict_label = boundary.strict_label or label
        if not result.backend_id or not result.contract_id:
            raise ValueError(f"strict {strict_label} runs require non-empty backend_id and contract_id")
        if request.logits.requires_grad and not logp.requires_grad:
            raise ValueError(f"strict {strict_label} result is detached from autograd")
        if request.with_entropy_grad and result.entropy is not None and not result.entropy.requires_grad:
            raise ValueError(f"strict {strict_label} entropy is detached from autograd")
