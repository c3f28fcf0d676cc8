"""Backend choice and provenance for every public op.

Four backends exist: ``native`` (the CUDA extension built from ``native/``), ``triton``,
``torch`` (the plain-PyTorch reference, always available) and ``flashinfer`` (FlashInfer's
samplers behind ``sample``, where the ``flashinfer`` package installs). Each backend module
registers its implementations with :func:`register`; a public op asks :func:`select` for the
implementation that serves its (already validated) inputs.

Rules:

* ``backend="auto"`` (the default) takes the first backend in the op's preference order that
  declares the op (:data:`SERVES`, from the manifest :data:`rl_kernel_core.ops.OPS`), can run on
  the inputs' device and whose ``supports`` predicate accepts them; backends that do not declare
  the op are never imported for it. ``flashinfer`` is
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
* What ran under the chosen backend is the decision's :attr:`~Decision.route` (a key of
  :data:`rl_kernel_core.ops.ROUTES`): the launches that choose between Triton's own launch, the
  Hopper CUDA passes and the C++ launcher record their choice with :func:`ran`.

What an op is (its backends' modules, its ``auto`` order) is declared in :mod:`rl_kernel_core.ops`;
what this process has registered, chosen and logged is :data:`REGISTRY` (a :class:`Registry`).
Tests replace an implementation within a block with :func:`override` or :meth:`Registry.scoped`,
never by editing the registry's tables.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional, Union, overload

import torch

from rl_kernel_core import ops
from rl_kernel_core.ops import BACKENDS
from rl_kernel_core.switches import show_value

logger = logging.getLogger("rl_kernel")

SERVES: dict[str, frozenset[str]] = {backend: frozenset(ops.modules(backend)) for backend in BACKENDS}
"""The ops each backend serves, from the manifest (:attr:`rl_kernel_core.ops.OpSpec.backends`).
:func:`register` refuses an implementation its backend does not declare."""

Supports = Callable[..., Optional[str]]


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the op on these inputs; the message says why."""


@dataclass
class _Impl:
    fn: Callable
    supports: Optional[Supports]
    any_device: bool = False  # a stand-in of override(any_device=True): runs on every device, nothing imported for it
    kernels: Optional[str] = None


@dataclass
class Decision:
    """What :func:`select` chose for one call, and why the others were skipped.

    ``kernels``: the name under which the chosen implementation's launches record their route
    (:func:`ran`), None where it always runs its backend's own.
    """

    op: str
    requested: str
    backend: str
    device: str
    skipped: dict[str, str] = field(default_factory=dict)
    kernels: Optional[str] = None

    @property
    def route(self) -> str:
        """What ran (a key of :data:`rl_kernel_core.ops.ROUTES`): the route the last launch of
        :attr:`kernels` took in this process (ops sharing kernels share it), else the backend's own."""
        if self.kernels is None:
            return self.backend
        return REGISTRY.routes.get(self.kernels, self.backend)


class Registry:
    """This process's dispatch state, all of it (one instance: :data:`REGISTRY`).

    Attributes:
        impls: ``{(op, backend): implementation}``, filled by :func:`register` as the backends'
            modules are imported.
        stand_ins: ``{(op, backend): implementation}`` put in place by :func:`override` for the
            length of a block; consulted before ``impls``, and the backend counts as serving the op.
        preference: ``{op: auto order}`` set by :func:`set_preference`, over the manifest's order.
        load_errors: ``{backend module: why importing it failed}``.
        loaded: the backend modules whose import has been tried.
        capabilities: ``{CUDA device: its compute capability "major.minor"}``, as asked so far.
        last: ``{op: the last Decision}`` (:func:`explain`).
        logged: the ``(op, backend, device type)`` choices already logged.
        lock: held while a backend module is imported.
        plans: :func:`select`'s input-independent decisions, emptied whenever the tables above
            that decide them change (:meth:`changed`).
        routes: ``{kernels: the route their last launch took}`` (:func:`ran`).
    """

    def __init__(self) -> None:
        self.impls: dict[tuple[str, str], _Impl] = {}
        self.stand_ins: dict[tuple[str, str], _Impl] = {}
        self.preference: dict[str, tuple[str, ...]] = {}
        self.load_errors: dict[str, str] = {}
        self.loaded: set[str] = set()
        self.capabilities: dict[str, str] = {}
        self.last: dict[str, Decision] = {}
        self.logged: set[tuple[str, str, str]] = set()
        self.lock = threading.Lock()
        self.plans: dict[tuple, "_Plan"] = {}
        self.routes: dict[str, str] = {}

    def changed(self) -> None:
        """Forget :attr:`plans`: an implementation, stand-in, preference or import changed."""
        self.plans.clear()

    def implementation(self, op: str, backend: str) -> Optional[_Impl]:
        """The stand-in or registered implementation of ``op`` on ``backend``, or None."""
        return self.stand_ins.get((op, backend)) or self.impls.get((op, backend))

    @contextmanager
    def scoped(self) -> Iterator["Registry"]:
        """A block after which the stand-ins, preferences, decisions and logged choices are as
        before it. What importing a backend module did (its registrations, ``loaded``,
        ``load_errors``) and the devices' capabilities stay: they are facts of the process, and
        a module is imported once."""
        stand_ins, preference, last, logged = (
            dict(self.stand_ins),
            dict(self.preference),
            dict(self.last),
            set(self.logged),
        )
        try:
            yield self
        finally:
            self.stand_ins.clear()
            self.stand_ins.update(stand_ins)
            self.preference.clear()
            self.preference.update(preference)
            self.changed()
            self.last.clear()
            self.last.update(last)
            self.logged.clear()
            self.logged.update(logged)


REGISTRY = Registry()
"""The dispatch state of this process."""


def register(
    op: str, backend: str, *, supports: Optional[Supports] = None, kernels: Optional[str] = None
) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as ``backend``'s implementation of ``op``.

    ``supports(*args, **kwargs)`` receives the same arguments as the implementation and returns
    ``None`` when it can serve them, else a short reason (e.g. ``"D=8192 exceeds the tile limit"``).
    ``kernels``: the name under which ``fn``'s launches record the route they take (:func:`ran`);
    None where ``fn`` always runs ``backend``'s own route.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not serves(backend, op):
        raise ValueError(
            f"{backend} does not serve {op} in the manifest rl_kernel_core.ops.OPS; declare it there to register it"
        )

    def deco(fn: Callable) -> Callable:
        REGISTRY.impls[(op, backend)] = _Impl(fn, supports, kernels=kernels)
        REGISTRY.changed()
        return fn

    return deco


def ran(kernels: str, route: str) -> None:
    """Record that a launch of ``kernels`` (the name its ops :func:`register` with) took ``route``,
    a key of :data:`rl_kernel_core.ops.ROUTES`; :attr:`Decision.route` reads it. Called by the
    launch that decides the route, so the record is what ran, never a guess made before it."""
    REGISTRY.routes[kernels] = route


@contextmanager
def override(
    op: str, backend: str, impl: Callable, *, supports: Optional[Supports] = None, any_device: bool = False
) -> Iterator[None]:
    """A block in which ``impl`` is ``backend``'s implementation of ``op`` (for tests: a toy op, a
    stand-in for a backend this machine lacks), whether or not the manifest declares it.

    ``supports`` is as for :func:`register`. Nothing is imported for the stand-in; it runs on
    the devices ``backend`` runs on, or on every device with ``any_device=True``. On exit the
    registry is as on entry (:meth:`Registry.scoped`): the stand-in, preferences set and
    decisions taken in the block are gone.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    with REGISTRY.scoped():
        REGISTRY.stand_ins[(op, backend)] = _Impl(impl, supports, any_device)
        REGISTRY.changed()
        yield


def serves(backend: str, op: str) -> bool:
    """Whether ``backend`` declares an implementation of ``op`` (nothing is imported to answer)."""
    return op in SERVES.get(backend, frozenset()) or (op, backend) in REGISTRY.stand_ins


def set_preference(op: str, order: tuple[str, ...]) -> None:
    """Set the ``auto`` order for ``op`` (e.g. from measurements on the running GPU)."""
    bad = [b for b in order if b not in BACKENDS]
    if bad:
        raise ValueError(f"order must hold backends from {BACKENDS}, got {bad}")
    REGISTRY.preference[op] = tuple(order)
    REGISTRY.changed()


def default_backend() -> str:
    """The backend an op uses when none is given: ``RL_KERNEL_BACKEND`` or ``auto``."""
    value = os.environ.get("RL_KERNEL_BACKEND", "auto").strip().lower() or "auto"
    if value != "auto" and value not in BACKENDS:
        raise ValueError(f"RL_KERNEL_BACKEND must be 'auto' or one of {BACKENDS}, got {show_value(value)}")
    return value


@torch.compiler.assume_constant_result  # traced code (torch.compile) runs the import eagerly, once
def _ensure_loaded(backend: str, op: str) -> Optional[str]:
    """Import the module of ``backend`` that registers ``op`` once; return its import failure as a reason, or None."""
    spec = ops.OPS.get(op)
    module = None if spec is None else spec.backends.get(backend)
    if module is None:
        return None
    if module not in REGISTRY.loaded:
        with REGISTRY.lock:
            if module not in REGISTRY.loaded:
                try:
                    importlib.import_module(module)
                except Exception as exc:  # the reason is reported, never swallowed
                    REGISTRY.load_errors[module] = f"{backend} backend failed to import: {type(exc).__name__}: {exc}"
                REGISTRY.loaded.add(module)
                REGISTRY.changed()
    return REGISTRY.load_errors.get(module)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _meta_reason(backend: str) -> str:
    return (
        f"{backend} runs kernels that read data and the inputs are meta tensors (shapes without data); "
        "backend='torch' runs on them"
    )


def _device_reason(backend: str, device: torch.device, explicit: bool) -> Optional[str]:
    if backend == "torch":
        return None
    if device.type == "meta":  # the interpreter would take them too, and fail copying their (absent) data
        return _meta_reason(backend)
    if device.type == "cuda":
        return None
    if backend == "triton" and explicit and _interpreting():
        return None
    if backend == "triton":
        return f"triton needs CUDA tensors (got {device.type}; set TRITON_INTERPRET=1 and name backend='triton' to interpret on CPU)"
    return f"{backend} needs CUDA tensors (got {device.type})"


def _static_reason(
    op: str, backend: str, device: torch.device, explicit: bool
) -> tuple[Optional[str], Optional[_Impl]]:
    """Why ``backend`` cannot run ``op`` on ``device`` whatever the inputs (None when it can), and
    its implementation: what :func:`unavailable_reason` says before asking ``supports``."""
    if not serves(backend, op):
        return f"{op} has no {backend} implementation", None
    stand_in = REGISTRY.stand_ins.get((op, backend))
    # a named backend reports why it cannot load before the device; auto imports nothing for a device it cannot serve
    if stand_in is not None:
        reason = None if stand_in.any_device else _device_reason(backend, device, explicit)
    elif explicit:
        reason = _ensure_loaded(backend, op) or _device_reason(backend, device, explicit)
    else:
        reason = _device_reason(backend, device, explicit) or _ensure_loaded(backend, op)
    if reason:
        return reason, None
    impl = REGISTRY.implementation(op, backend)
    if impl is None:
        return f"{op} has no {backend} implementation", None
    return None, impl


def unavailable_reason(
    op: str, backend: str, device: torch.device, *args, explicit: bool = True, **kwargs
) -> Optional[str]:
    """Why ``backend`` cannot run ``op`` on these inputs, or None when it can."""
    reason, impl = _static_reason(op, backend, device, explicit)
    if reason or impl is None or impl.supports is None:
        return reason
    return impl.supports(*args, **kwargs)


@dataclass
class _Plan:
    """What :func:`select` decides for one ``(op, backend, device)`` before seeing the inputs:
    the candidates in order, each with its reason to be skipped whatever the inputs (or None) and
    its implementation; the ``auto`` candidates skipped before them; and the decision recorded
    when a candidate is taken with no candidate before it refused by ``supports``, and the skips
    when every candidate is skipped whatever the inputs."""

    explicit: bool
    candidates: tuple[tuple[str, Optional[str], Optional[_Impl]], ...]
    skipped: dict[str, str]
    decisions: tuple[Decision, ...]
    all_skipped: dict[str, str]


def _plan(op: str, requested: str, device: torch.device) -> _Plan:
    skipped: dict[str, str] = {}
    if requested == "auto":
        preferred = default_backend()
        if serves(preferred, op) or preferred == "auto":
            requested = preferred
        else:  # RL_KERNEL_BACKEND is a preference: an op its backend lacks goes to auto, logged
            skipped[preferred] = f"RL_KERNEL_BACKEND={preferred}, which has no {op} implementation"
    explicit = requested != "auto"
    order = (requested,) if explicit else tuple(c for c in _auto_order(op, device) if c not in skipped)
    candidates = tuple((c, *_static_reason(op, c, device, explicit)) for c in order)
    decisions, before = [], dict(skipped)
    for backend, reason, impl in candidates:
        kernels = None if impl is None else impl.kernels
        decisions.append(Decision(op, requested if explicit else "auto", backend, device.type, dict(before), kernels))
        if reason:
            before[backend] = reason
    return _Plan(explicit, candidates, skipped, tuple(decisions), before)


def select(op: str, backend: Optional[str], device: torch.device, *args, **kwargs) -> Callable:
    """Return the implementation of ``op`` to run on ``device``.

    ``backend`` is ``None``/``"auto"`` or a name from :data:`BACKENDS`; ``args``/``kwargs`` are
    what the implementation will be called with (passed to ``supports``). What does not depend on
    the inputs is decided once per ``(op, backend, device, RL_KERNEL_BACKEND, TRITON_INTERPRET)``
    and kept until the registry changes (a registration, an import, :func:`override`,
    :func:`set_preference`); ``supports`` is asked on every call.
    """
    requested = "auto" if backend is None else str(backend).lower()
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if torch.compiler.is_compiling():  # traced once: no cache for the tracer to guard on
        plan = _plan(op, requested, device)
    else:
        key = (op, requested, device, os.environ.get("RL_KERNEL_BACKEND"), os.environ.get("TRITON_INTERPRET"))
        kept = REGISTRY.plans.get(key)
        if kept is None:
            kept = REGISTRY.plans[key] = _plan(op, requested, device)
        plan = kept
    refused: Optional[dict[str, str]] = None  # the skips so far, once a supports predicate refused
    for i, (candidate, static, impl) in enumerate(plan.candidates):
        reason = static if static or impl is None or impl.supports is None else impl.supports(*args, **kwargs)
        if not reason and impl is not None:
            decision = plan.decisions[i]
            if refused is not None:
                decision = Decision(op, decision.requested, candidate, device.type, refused, decision.kernels)
            _record(decision)
            return impl.fn
        if plan.explicit:
            if device.type == "meta" and reason == _meta_reason(candidate):
                reason = _meta_argument_reason(op, candidate, args, kwargs)
            raise BackendUnavailableError(f"{op}: backend={candidate!r} cannot run: {reason}")
        if refused is None and not static:
            refused = dict(plan.decisions[i].skipped)
        if refused is not None:
            refused[candidate] = str(reason)
    raise BackendUnavailableError(f"{op}: no backend can run these inputs: {refused or plan.all_skipped}")


def _meta_argument_reason(op: str, backend: str, args: tuple, kwargs: dict) -> str:
    """Why ``backend`` cannot run ``op`` on these meta tensors, naming the first one by the name the
    op's reference implementation gives it (a field of a tuple of inputs by the field's name)."""
    named: list[tuple[str, object]] = []
    if _ensure_loaded("torch", op) is None and (reference := REGISTRY.implementation(op, "torch")) is not None:
        try:
            named = list(inspect.signature(reference.fn).bind_partial(*args, **kwargs).arguments.items())
        except (TypeError, ValueError):
            named = []
    if not named:
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        fields = value._asdict().items() if hasattr(value, "_asdict") else [(name, value)]
        for field_name, t in fields:
            if isinstance(t, torch.Tensor) and t.is_meta:
                return (
                    f"{field_name} is a meta tensor (shape {tuple(t.shape)}, no data) and {backend}'s kernels read "
                    "data; backend='torch' runs on meta tensors"
                )
    return _meta_reason(backend)


def _auto_order(op: str, device: torch.device) -> tuple[str, ...]:
    """``auto``'s order for ``op``: :func:`set_preference`'s, else the manifest's measured order
    for this GPU's architecture, else its :attr:`~rl_kernel_core.ops.OpSpec.auto_order`."""
    if op in REGISTRY.preference:
        return REGISTRY.preference[op]
    spec = ops.OPS.get(op)
    if spec is None:
        return ops.DEFAULT_AUTO_ORDER
    if device.type == "cuda" and spec.measured_order:
        return spec.measured_order.get(_capability(device), spec.auto_order)
    return spec.auto_order


def _capability(device: torch.device) -> str:
    """``"major.minor"``, the compute capability of the CUDA ``device``."""
    key = str(device)
    if key not in REGISTRY.capabilities:
        major, minor = torch.cuda.get_device_capability(device)
        REGISTRY.capabilities[key] = f"{major}.{minor}"
    return REGISTRY.capabilities[key]


def _record(decision: Decision) -> None:
    REGISTRY.last[decision.op] = decision
    key = (decision.op, decision.backend, decision.device)
    if key not in REGISTRY.logged and not torch.compiler.is_compiling():  # logging would break the graph
        REGISTRY.logged.add(key)
        detail = "; ".join(f"{b}: {r}" for b, r in decision.skipped.items())
        logger.info(
            "rl_kernel: %s on %s uses backend=%s (requested %s)%s",
            decision.op,
            decision.device,
            decision.backend,
            decision.requested,
            f"; skipped {detail}" if detail else "",
        )


@overload
def explain(op: None = None) -> dict[str, Decision]: ...
@overload
def explain(op: str) -> Decision: ...
def explain(op: Optional[str] = None) -> Union[dict[str, Decision], Decision]:
    """The last decision for ``op``, or ``{op: decision}`` for every op decided so far when ``op`` is None.
    Its :attr:`~Decision.route` says what ran.

    Raises:
        LookupError: no call of ``op`` has chosen a backend in this process yet.
    """
    if op is None:
        return dict(REGISTRY.last)
    if op not in REGISTRY.last:
        raise LookupError(f"no call of {op} has chosen a backend in this process yet")
    return REGISTRY.last[op]


def backend_status() -> dict[str, Optional[str]]:
    """Each backend's import status: None when every module it declares loaded, else the first
    reason one did not. Loads every module (building every native extension if need be);
    :func:`backend_report` does not."""
    status: dict[str, Optional[str]] = {}
    for backend in BACKENDS:
        reasons = [_ensure_loaded(backend, op) for op in ops.modules(backend)]
        status[backend] = next((r for r in reasons if r), None)
    return status


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

    errors = REGISTRY.load_errors
    failed = sorted({errors[m] for m in ops.modules("native").values() if m in errors})
    report["native"] = native_build.status() + "".join(f"; {reason}" for reason in failed)
    flashinfer_error = errors.get(ops.modules("flashinfer")["sample"])
    if flashinfer_error:
        report["flashinfer"] = f"unavailable: {flashinfer_error}"
    elif importlib.util.find_spec("flashinfer") is None:
        report["flashinfer"] = (
            "unavailable: flashinfer is not installed (pip install 'rl-kernel[flashinfer]'); serves sample only"
        )
    else:
        report["flashinfer"] = "installed (serves sample only, when named or preferred)"
    return {b: report[b] for b in BACKENDS}
