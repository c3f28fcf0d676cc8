"""Backend choice and provenance for every public op.

Four backends exist: ``native`` (the CUDA extension built from ``native/``), ``triton``,
``torch`` (the plain-PyTorch reference, always available) and ``flashinfer`` (FlashInfer's
samplers behind ``sample``, where the ``flashinfer`` package installs). Each backend module
registers its implementations with :func:`register`; a public op asks :func:`select` for the
implementation that serves its (already validated) inputs.

Rules:

* ``backend="auto"`` (the default) takes the first backend in the op's preference order that
  declares the op (:data:`SERVES`), can run on the inputs' device and whose ``supports`` predicate
  accepts them; backends that do not declare the op are never imported for it. ``flashinfer`` is
  in no default order: its draws depend on a row's place in the batch (it serves only calls
  without per-row seeds) and are not the tokens the other backends draw from the same generator
  state, so ``auto`` takes it only where the user asks for it (``RL_KERNEL_BACKEND=flashinfer``
  or :func:`set_preference`), and ``backend="flashinfer"`` names it.
  ``RL_KERNEL_BACKEND=<name>`` makes ``auto`` mean that backend for every op it declares (e.g.
  ``RL_KERNEL_BACKEND=torch`` forces the reference everywhere); an op it does not declare takes the
  ``auto`` order, and the decision records why. The choice is logged once per
  (op, backend, device type) and is readable afterwards through :func:`explain`.
* An explicitly named backend that cannot run raises :class:`BackendUnavailableError` naming
  why (no GPU, Triton import error, compiler output, op not implemented there). There is no
  silent fallback anywhere: a skipped candidate under ``auto`` is recorded with its reason.
* Triton kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` is set and
  the backend is named explicitly (``auto`` never picks the interpreter: it is a test tool).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

logger = logging.getLogger("rl_kernel")

BACKENDS: tuple[str, ...] = ("native", "triton", "torch", "flashinfer")
_DEFAULT_PREFERENCE: tuple[str, ...] = ("native", "triton", "torch")
_BACKEND_MODULES = {"triton": "rl_kernel_core.triton", "native": "rl_kernel_core.native",
                    "flashinfer": "rl_kernel_core.flashinfer.sampling"}
SERVES: dict[str, frozenset[str]] = {
    "triton": frozenset({"linear_logprob", "logprob_from_logits", "ratio_kl", "policy_loss",
                         "fused_linear_policy_loss", "group_advantages", "sample",
                         "bi_matmul", "bi_linear", "bi_log_softmax", "bi_mean", "rms_norm", "varlen_attention"}),
    "native": frozenset({"linear_logprob", "logprob_from_logits", "ratio_kl", "policy_loss", "group_advantages"}),
    "flashinfer": frozenset({"sample"}),
}
"""The ops each fast backend serves, declared so that choosing a backend never imports (or, for
``native``, compiles) one that has no implementation of the op; ``torch`` serves every op.
:func:`register` refuses an implementation its backend does not declare."""

Supports = Callable[..., Optional[str]]


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the op on these inputs; the message says why."""


@dataclass
class _Impl:
    fn: Callable
    supports: Optional[Supports]


@dataclass
class Decision:
    """What :func:`select` chose for one call, and why the others were skipped."""

    op: str
    requested: str
    backend: str
    device: str
    skipped: dict[str, str] = field(default_factory=dict)


_impls: dict[tuple[str, str], _Impl] = {}
_preference: dict[str, tuple[str, ...]] = {}
_load_errors: dict[str, str] = {}
_loaded: set[str] = set()
_last: dict[str, Decision] = {}
_logged: set[tuple[str, str, str]] = set()
_lock = threading.Lock()


def register(op: str, backend: str, *, supports: Optional[Supports] = None) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as ``backend``'s implementation of ``op``.

    ``supports(*args, **kwargs)`` receives the same arguments as the implementation and returns
    ``None`` when it can serve them, else a short reason (e.g. ``"D=8192 exceeds the tile limit"``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not serves(backend, op):
        raise ValueError(f"{backend} does not declare {op} in dispatch.SERVES; add it there to register it")

    def deco(fn: Callable) -> Callable:
        _impls[(op, backend)] = _Impl(fn, supports)
        return fn

    return deco


def serves(backend: str, op: str) -> bool:
    """Whether ``backend`` declares an implementation of ``op`` (nothing is imported to answer)."""
    return backend == "torch" or op in SERVES.get(backend, frozenset())


def set_preference(op: str, order: tuple[str, ...]) -> None:
    """Set the ``auto`` order for ``op`` (e.g. from measurements on the running GPU)."""
    bad = [b for b in order if b not in BACKENDS]
    if bad:
        raise ValueError(f"order must hold backends from {BACKENDS}, got {bad}")
    _preference[op] = tuple(order)


def default_backend() -> str:
    """The backend an op uses when none is given: ``RL_KERNEL_BACKEND`` or ``auto``."""
    value = os.environ.get("RL_KERNEL_BACKEND", "auto").strip().lower() or "auto"
    if value != "auto" and value not in BACKENDS:
        raise ValueError(f"RL_KERNEL_BACKEND must be 'auto' or one of {BACKENDS}, got {value!r}")
    return value


@torch.compiler.assume_constant_result  # traced code (torch.compile) runs the import eagerly, once
def _ensure_loaded(backend: str) -> Optional[str]:
    """Import the backend's module once; return the import failure as a reason, or None."""
    if backend == "torch" or backend in _loaded:
        return _load_errors.get(backend)
    with _lock:
        if backend not in _loaded:
            try:
                importlib.import_module(_BACKEND_MODULES[backend])
            except Exception as exc:  # the reason is reported, never swallowed
                _load_errors[backend] = f"{backend} backend failed to import: {type(exc).__name__}: {exc}"
            _loaded.add(backend)
    return _load_errors.get(backend)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _device_reason(backend: str, device: torch.device, explicit: bool) -> Optional[str]:
    if backend == "torch":
        return None
    if device.type == "cuda":
        return None
    if backend == "triton" and explicit and _interpreting():
        return None
    if backend == "triton":
        return f"triton needs CUDA tensors (got {device.type}; set TRITON_INTERPRET=1 and name backend='triton' to interpret on CPU)"
    return f"{backend} needs CUDA tensors (got {device.type})"


def unavailable_reason(op: str, backend: str, device: torch.device, *args, explicit: bool = True, **kwargs) -> Optional[str]:
    """Why ``backend`` cannot run ``op`` on these inputs, or None when it can."""
    if not serves(backend, op):
        return f"{op} has no {backend} implementation"
    reason = _ensure_loaded(backend)
    if reason:
        return reason
    reason = _device_reason(backend, device, explicit)
    if reason:
        return reason
    impl = _impls.get((op, backend))
    if impl is None:
        return f"{op} has no {backend} implementation"
    if impl.supports is not None:
        return impl.supports(*args, **kwargs)
    return None


def select(op: str, backend: Optional[str], device: torch.device, *args, **kwargs) -> Callable:
    """Return the implementation of ``op`` to run on ``device``.

    ``backend`` is ``None``/``"auto"`` or a name from :data:`BACKENDS`; ``args``/``kwargs`` are
    what the implementation will be called with (passed to ``supports``).
    """
    requested = "auto" if backend is None else str(backend).lower()
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    skipped: dict[str, str] = {}
    if requested == "auto":
        preferred = default_backend()
        if serves(preferred, op) or preferred == "auto":
            requested = preferred
        else:  # RL_KERNEL_BACKEND is a preference: an op its backend lacks goes to auto, logged
            skipped[preferred] = f"RL_KERNEL_BACKEND={preferred}, which has no {op} implementation"
    if requested != "auto":
        reason = unavailable_reason(op, requested, device, *args, explicit=True, **kwargs)
        if reason:
            raise BackendUnavailableError(f"{op}: backend={requested!r} cannot run: {reason}")
        _record(Decision(op, requested, requested, device.type))
        return _impls[(op, requested)].fn
    for candidate in _preference.get(op, _DEFAULT_PREFERENCE):
        if serves(candidate, op):
            _ensure_loaded(candidate)  # a backend's import may set the order (measured per GPU), read below
    for candidate in _preference.get(op, _DEFAULT_PREFERENCE):
        if candidate in skipped:
            continue
        reason = unavailable_reason(op, candidate, device, *args, explicit=False, **kwargs)
        if reason is None:
            _record(Decision(op, "auto", candidate, device.type, skipped))
            return _impls[(op, candidate)].fn
        skipped[candidate] = reason
    raise BackendUnavailableError(f"{op}: no backend can run these inputs: {skipped}")


def _record(decision: Decision) -> None:
    _last[decision.op] = decision
    key = (decision.op, decision.backend, decision.device)
    if key not in _logged and not torch.compiler.is_compiling():  # logging would break the graph
        _logged.add(key)
        detail = "; ".join(f"{b}: {r}" for b, r in decision.skipped.items())
        logger.info(
            "rl_kernel: %s on %s uses backend=%s (requested %s)%s",
            decision.op, decision.device, decision.backend, decision.requested,
            f"; skipped {detail}" if detail else "",
        )


def explain(op: Optional[str] = None) -> dict[str, Decision] | Optional[Decision]:
    """The last decision for ``op`` (or all ops when ``op`` is None)."""
    if op is None:
        return dict(_last)
    return _last.get(op)


def backend_status() -> dict[str, Optional[str]]:
    """Each backend's import status: None when it loaded, else the reason it did not. Loads every
    backend (building the native extension if need be); :func:`backend_report` does not."""
    return {b: _ensure_loaded(b) for b in BACKENDS}


def backend_report() -> dict[str, str]:
    """One line per backend for ``rl-kernel info``, building nothing: a loaded backend's status,
    Triton's import status, and for a native backend not loaded yet
    :func:`rl_kernel_core.native_build.status`."""
    report = {}
    for backend in BACKENDS:
        if backend == "native" and backend not in _loaded:
            from rl_kernel_core import native_build

            report[backend] = native_build.status()
            continue
        reason = _ensure_loaded(backend)
        report[backend] = "available" if reason is None else f"unavailable: {reason}"
    return report
