"""The manifest of ops: one :class:`OpSpec` per op that dispatch serves, the one place an op's facts live.

Read by :mod:`rl_kernel_core` (its lazy exports: :func:`exports`), :mod:`rl_kernel_core.dispatch`
(which module of which backend serves an op, and ``auto``'s order), :mod:`rl_kernel_core.native_build`
(the native extensions to build: one per ``native_group``) and the tests that hold the docs' op x
backend table and the custom-op names to it. Adding an op is one :class:`OpSpec` in :data:`OPS`
(CONTRIBUTING.md, "Adding an op"). This module is standard library only: the package's
``__init__`` reads it without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Optional

BACKENDS: tuple[str, ...] = ("native", "triton", "torch", "flashinfer")
"""Every backend dispatch knows, in the order ``rl-kernel info`` lists them."""
DEFAULT_AUTO_ORDER: tuple[str, ...] = ("native", "triton", "torch")
"""``auto``'s order for an op whose :class:`OpSpec` gives none. ``flashinfer`` is in no default
order: its draws depend on a row's place in the batch, so ``auto`` takes it only when asked to
(:mod:`rl_kernel_core.dispatch`)."""
ROUTES: Mapping[str, str] = MappingProxyType(
    {
        "native": "the CUDA kernels of native/csrc",
        "triton": "Triton kernels, launched by Triton",
        "triton+sm90": "Triton kernels, with the gemm route's statistics and gradient passes run by the Hopper CUDA "
        "kernels of native/csrc/linear_sm90.cu (the Triton passes' bits)",
        "triton+cpp_launch": "the Triton kernels' compiled cubins, launched from C++ by native/csrc/bind_triton_launch.cpp "
        "(Triton's launch's bits)",
        "torch": "the plain-PyTorch reference",
        "flashinfer": "FlashInfer's kernels",
    }
)
"""``{route: what runs}``. A backend runs the route of its own name; the Triton backend's launches
of ``linear_logprob``'s passes and of the batch-invariant and attention kernels may take a route of
their own, which each launch records (:attr:`rl_kernel_core.dispatch.Decision.route`)."""
GLUE_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "differentiable_custom_op": "rl_kernel::<backend>_<op> and rl_kernel::<backend>_<op>_backward custom ops with fakes, "
        "autograd registered, from opdef.define_differentiable_op",
        "custom_op": "one rl_kernel::<backend>_<op> custom op with a fake, not differentiable",
        "autograd_function": "a torch.autograd.Function in the backend's module",
        "function": "a plain function, not differentiable",
    }
)
"""``{glue kind: how a fast backend wraps its kernels for PyTorch}`` (:attr:`OpSpec.glue`)."""


@dataclass(frozen=True)
class OpSpec:
    """One op, as dispatch, the exports, the native build and the docs' tests see it.

    Attributes:
        name: the op's name in dispatch (``register``, ``select``, ``explain``); for a public op
            also the name of its public function.
        public_module: the module that defines the public function ``name``, which ``rl_kernel_core``
            re-exports; None for an op only the batch-invariant mode calls (``bi_*``).
        backends: ``{backend: the module that registers the op's implementation}``; importing that
            module is all dispatch does to load a backend for the op, and no other backend is
            imported for it. ``torch`` (the reference) serves every op.
        native_group: the extension (:data:`rl_kernel_core.native_build.GROUPS`) that holds the
            op's CUDA kernels; set exactly when ``native`` serves the op.
        auto_order: ``auto``'s order of backends where :attr:`measured_order` has no entry for
            the GPU (and on CPU).
        measured_order: ``{compute capability "major.minor": auto order}``, the faster of native
            and triton first, as ``benchmarks/bench_native.py`` measured on that architecture.
        glue: how the fast backends wrap their kernels for PyTorch, a key of :data:`GLUE_KINDS`.
    """

    name: str
    public_module: Optional[str]
    backends: Mapping[str, str]
    glue: str
    native_group: Optional[str] = None
    auto_order: tuple[str, ...] = DEFAULT_AUTO_ORDER
    measured_order: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "torch" not in self.backends:
            raise ValueError(f"backends of {self.name} must include torch (the reference serves every op)")
        unknown = sorted(
            {*self.backends, *self.auto_order, *(b for o in self.measured_order.values() for b in o)} - set(BACKENDS)
        )
        if unknown:
            raise ValueError(
                f"backends, auto_order and measured_order of {self.name} must name backends from {BACKENDS}, got {unknown}"
            )
        if (self.native_group is None) == ("native" in self.backends):
            raise ValueError(
                f"native_group of {self.name} must be set exactly when native serves it, got {self.native_group!r}"
            )
        if self.glue not in GLUE_KINDS:
            raise ValueError(f"glue of {self.name} must be one of {list(GLUE_KINDS)}, got {self.glue!r}")


_REFERENCE_BATCH_INVARIANT = "rl_kernel_core.batch_invariant_mode.reference"
_TRITON_BATCH_INVARIANT = "rl_kernel_core.batch_invariant_mode.triton"
_TRITON_FIRST = ("triton", "native", "torch")
_LAYER_FILES = {"torch": "reference", "triton": "triton", "native": "native", "flashinfer": "flashinfer"}


def _family(family: str, backends: tuple[str, ...] = ("torch", "triton", "native")) -> dict[str, str]:
    """The modules serving a family's op on ``backends``: ``rl_kernel_core.<family>.<layer file>``."""
    return {b: f"rl_kernel_core.{family}.{_LAYER_FILES[b]}" for b in backends}


def _batch_invariant(name: str, public_module: Optional[str] = None) -> OpSpec:
    """An op of the batch-invariant mode: reference and Triton kernels in one module each."""
    return OpSpec(
        name,
        public_module,
        {"torch": _REFERENCE_BATCH_INVARIANT, "triton": _TRITON_BATCH_INVARIANT},
        glue="autograd_function",
    )


OPS: Mapping[str, OpSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            # the "9.0" orders: the faster of native and triton first, as benchmarks/bench_native.py measured
            # them on an H100 (benchmarks/results/bench_native_h100.json)
            OpSpec(
                "logprob_from_logits",
                "rl_kernel_core.logprob.api",
                _family("logprob"),
                glue="differentiable_custom_op",
                native_group="logprob_from_logits",
                measured_order={"9.0": ("native", "triton", "torch")},
            ),
            *(
                OpSpec(
                    name,
                    "rl_kernel_core.loss.api",
                    _family("loss"),
                    glue="differentiable_custom_op",
                    native_group="loss",
                    measured_order={"9.0": _TRITON_FIRST},
                )
                for name in ("ratio_kl", "policy_loss")
            ),
            OpSpec(
                "fused_linear_policy_loss",
                "rl_kernel_core.loss.api",
                {
                    "torch": "rl_kernel_core.linear.reference_fused_loss",
                    "triton": "rl_kernel_core.linear.triton_fused_loss",
                },
                glue="differentiable_custom_op",
            ),
            OpSpec(
                "group_advantages",
                "rl_kernel_core.advantages.api",
                _family("advantages"),
                glue="custom_op",
                native_group="advantages",
                measured_order={"9.0": ("native", "triton", "torch")},
            ),
            OpSpec(
                "linear_logprob",
                "rl_kernel_core.linear.api",
                _family("linear"),
                glue="differentiable_custom_op",
                native_group="linear_logprob",
                auto_order=_TRITON_FIRST,
                measured_order={"9.0": _TRITON_FIRST},
            ),
            OpSpec(
                "sample",
                "rl_kernel_core.sampling.api",
                _family("sampling", ("torch", "triton", "flashinfer")),
                glue="function",
            ),
            OpSpec(
                "varlen_attention",
                "rl_kernel_core.batch_invariant_mode.api_attention",
                {
                    "torch": "rl_kernel_core.batch_invariant_mode.reference_attention",
                    "triton": "rl_kernel_core.batch_invariant_mode.triton_attention",
                },
                glue="autograd_function",
            ),
            _batch_invariant("rms_norm", "rl_kernel_core.batch_invariant_mode.api"),
            _batch_invariant("bi_matmul"),
            _batch_invariant("bi_linear"),
            OpSpec(
                "bi_grouped_linear",
                None,
                {"torch": _REFERENCE_BATCH_INVARIANT, "triton": "rl_kernel_core.batch_invariant_mode.triton_moe"},
                glue="autograd_function",
            ),
            _batch_invariant("bi_log_softmax"),
            _batch_invariant("bi_logsumexp"),
            _batch_invariant("bi_mean"),
        )
    }
)
"""``{op name: its declaration}``, every op dispatch serves."""

OTHER_EXPORTS: Mapping[str, str] = MappingProxyType(
    {
        "BackendUnavailableError": "rl_kernel_core.dispatch",
        "batch_invariant": "rl_kernel_core.batch_invariant_mode.api",
        "is_batch_invariant": "rl_kernel_core.batch_invariant_mode.api",
        "LossSpans": "rl_kernel_core.spans",
        "MultimodalBatch": "rl_kernel_core.tools.multimodal.schema",
        "set_batch_invariant_mode": "rl_kernel_core.batch_invariant_mode.api",
        "token_advantages": "rl_kernel_core.advantages.api_rewards",
    }
)
"""``{public name: the module that defines it}`` for what ``rl_kernel_core`` exports that is not an op."""


def exports() -> dict[str, str]:
    """``{public name: the module that defines it}``: every name ``rl_kernel_core`` exports, the
    public ops of :data:`OPS` and :data:`OTHER_EXPORTS`."""
    public = {spec.name: spec.public_module for spec in OPS.values() if spec.public_module is not None}
    return {**public, **OTHER_EXPORTS}


def modules(backend: str) -> dict[str, str]:
    """``{op: the module of ``backend`` that registers it}`` for every op ``backend`` serves."""
    return {spec.name: spec.backends[backend] for spec in OPS.values() if backend in spec.backends}


def native_groups() -> tuple[str, ...]:
    """The native groups (one extension each; :attr:`OpSpec.native_group`), in :data:`OPS`' order, each once."""
    return tuple(dict.fromkeys(spec.native_group for spec in OPS.values() if spec.native_group is not None))
