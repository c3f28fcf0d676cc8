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
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Union, overload

import torch

logger = logging.getLogger("rl_kernel")

BACKENDS: tuple[str, ...] = ("native", "triton", "torch", "flashinfer")
_DEFAULT_PREFERENCE: tuple[str, ...] = ("native", "triton", "torch")
_TRITON_BATCH_INVARIANT = "rl_kernel_core.triton.batch_invariant"
BACKEND_MODULES: dict[str, dict[str, str]] = {
    "triton": {
        "linear_logprob": "rl_kernel_core.triton.linear_logprob",
        "logprob_from_logits": "rl_kernel_core.triton.logprob_from_logits",
        "ratio_kl": "rl_kernel_core.triton.loss",
        "policy_loss": "rl_kernel_core.triton.loss",
        "fused_linear_policy_loss": "rl_kernel_core.triton.fused_linear_policy_loss",
        "group_advantages": "rl_kernel_core.triton.advantages",
        "sample": "rl_kernel_core.triton.sampling",
        "bi_matmul": _TRITON_BATCH_INVARIANT,
        "bi_linear": _TRITON_BATCH_INVARIANT,
        "bi_log_softmax": _TRITON_BATCH_INVARIANT,
        "bi_mean": _TRITON_BATCH_INVARIANT,
        "rms_norm": _TRITON_BATCH_INVARIANT,
        "varlen_attention": "rl_kernel_core.triton.attention",
    },
    "native": {
        "linear_logprob": "rl_kernel_core.native.linear_logprob",
        "logprob_from_logits": "rl_kernel_core.native.logprob_from_logits",
        "ratio_kl": "rl_kernel_core.native.loss",
        "policy_loss": "rl_kernel_core.native.loss",
        "group_advantages": "rl_kernel_core.native.advantages",
    },
    "flashinfer": {"sample": "rl_kernel_core.flashinfer.sampling"},
}
"""``{backend: {op: the module that registers it}}`` for the fast backends; ``torch`` serves every
op from the reference modules the public ops import. Choosing a backend for an op imports that
op's module only (for ``native``, building that op family's extension only), never a backend
or module that has no implementation of the op."""
SERVES: dict[str, frozenset[str]] = {backend: frozenset(ops) for backend, ops in BACKEND_MODULES.items()}
"""The ops each fast backend serves (:data:`BACKEND_MODULES`' keys). :func:`register` refuses an
implementation its backend does not declare."""

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
_measured_order: dict[tuple[str, str], Optional[tuple[str, ...]]] = {}
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
def _ensure_loaded(backend: str, op: str) -> Optional[str]:
    """Import the module of ``backend`` that registers ``op`` once; return its import failure as a reason, or None."""
    module = BACKEND_MODULES.get(backend, {}).get(op)
    if module is None:
        return None
    if module not in _loaded:
        with _lock:
            if module not in _loaded:
                try:
                    importlib.import_module(module)
                except Exception as exc:  # the reason is reported, never swallowed
                    _load_errors[module] = f"{backend} backend failed to import: {type(exc).__name__}: {exc}"
                _loaded.add(module)
    return _load_errors.get(module)


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
    # a named backend reports why it cannot load before the device; auto imports nothing for a device it cannot serve
    if explicit:
        reason = _ensure_loaded(backend, op) or _device_reason(backend, device, explicit)
    else:
        reason = _device_reason(backend, device, explicit) or _ensure_loaded(backend, op)
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
    for candidate in _auto_order(op, device):
        if candidate in skipped:
            continue
        reason = unavailable_reason(op, candidate, device, *args, explicit=False, **kwargs)
        if reason is None:
            _record(Decision(op, "auto", candidate, device.type, skipped))
            return _impls[(op, candidate)].fn
        skipped[candidate] = reason
    raise BackendUnavailableError(f"{op}: no backend can run these inputs: {skipped}")


def _auto_order(op: str, device: torch.device) -> tuple[str, ...]:
    """``auto``'s order for ``op``: :func:`set_preference`'s, else the native backend's measured
    order on this GPU (:func:`rl_kernel_core.native.auto_order`, which builds nothing), else the default."""
    if op in _preference:
        return _preference[op]
    if device.type != "cuda" or not serves("native", op):
        return _DEFAULT_PREFERENCE
    key = (op, str(device))
    if key not in _measured_order:
        from rl_kernel_core import native

        _measured_order[key] = native.auto_order(op, device)
    return _measured_order[key] or _DEFAULT_PREFERENCE


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


@overload
def explain(op: None = None) -> dict[str, Decision]: ...
@overload
def explain(op: str) -> Decision: ...
def explain(op: Optional[str] = None) -> Union[dict[str, Decision], Decision]:
    """The last decision for ``op``, or ``{op: decision}`` for every op decided so far when ``op`` is None.

    Raises:
        LookupError: no call of ``op`` has chosen a backend in this process yet.
    """
    if op is None:
        return dict(_last)
    if op not in _last:
        raise LookupError(f"no call of {op} has chosen a backend in this process yet")
    return _last[op]


def backend_status() -> dict[str, Optional[str]]:
    """Each backend's import status: None when every module it declares loaded, else the first
    reason one did not. Loads every module (building every native extension if need be);
    :func:`backend_report` does not."""
    status: dict[str, Optional[str]] = {"torch": None}
    for backend, modules in BACKEND_MODULES.items():
        reasons = [_ensure_loaded(backend, op) for op in modules]
        status[backend] = next((r for r in reasons if r), None)
    return {b: status[b] for b in BACKENDS}


def backend_report() -> dict[str, str]:
    """One line per backend for ``rl-kernel info``, building nothing: whether Triton imports, the
    native extensions' :func:`rl_kernel_core.native_build.status` and any native module that
    failed to load in this process, whether FlashInfer is installed (not imported: it
    JIT-compiles its kernels on first use)."""
    report = {"torch": "available"}
    try:
        import triton  # noqa: F401

        report["triton"] = "available"
    except Exception as exc:  # the reason is reported, never swallowed
        report["triton"] = f"unavailable: triton failed to import: {type(exc).__name__}: {exc}"
    from rl_kernel_core import native_build

    failed = sorted({_load_errors[m] for m in BACKEND_MODULES["native"].values() if m in _load_errors})
    report["native"] = native_build.status() + "".join(f"; {reason}" for reason in failed)
    flashinfer_error = _load_errors.get(BACKEND_MODULES["flashinfer"]["sample"])
    if flashinfer_error:
        report["flashinfer"] = f"unavailable: {flashinfer_error}"
    elif importlib.util.find_spec("flashinfer") is None:
        report["flashinfer"] = "unavailable: flashinfer is not installed (pip install 'rl-kernel[flashinfer]'); serves sample only"
    else:
        report["flashinfer"] = "installed (serves sample only, when named or preferred)"
    return {b: report[b] for b in BACKENDS}
