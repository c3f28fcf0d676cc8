"""The native backend: CUDA kernels from ``native/csrc``, one extension per op family.

One module per op family registers that family's ops with :mod:`rl_kernel_core.dispatch`:
:mod:`.logprob_from_logits`, :mod:`.loss` (``ratio_kl``, ``policy_loss``), :mod:`.advantages`,
:mod:`.linear_logprob`. Dispatch imports a module on the first call of an op it serves
(:data:`rl_kernel_core.dispatch.BACKEND_MODULES`); importing it builds (or loads the cached build
of) that family's extension only (:func:`extension`). When it cannot be built or used here (a
CPU-only PyTorch, no CUDA device, no nvcc or ninja, no sources in this installation, a compiler
error) the import raises ``ImportError`` whose message is the reason; dispatch records it,
``rl-kernel info`` prints it, and an explicit ``backend="native"`` raises it. This package
itself builds nothing: it holds the measured ``auto`` order (:func:`auto_order`) and the
command line (``python -m rl_kernel_core.native build|check|where``,
:mod:`rl_kernel_core.native_build`).

The kernels compute in fp32 (``group_advantages`` in fp64, as the reference) and reduce in a
fixed order without float atomics: results are bitwise equal run to run.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from rl_kernel_core import native_build

MEASURED_PREFERENCE: dict[str, dict[str, tuple[str, ...]]] = {
    # H100 (sm_90), benchmarks/results/bench_native_h100.json: logprob_from_logits fwd+bwd (N=8192,
    # V=151936, bf16) native 2.79 ms / triton 3.11 ms; policy_loss fwd+bwd (1M tokens, CUDA graph)
    # native 32.8 us / triton 23.3 us; ratio_kl fwd+bwd (1M, CUDA graph) native 51.9 us / triton
    # 47.5 us; group_advantages (64k rewards by index) native 0.28 ms / triton 0.49 ms;
    # linear_logprob (N=16384, D=4096, V=128256: 2 no-grad forwards + 1 fwd+bwd with entropy)
    # native 192.5 ms / triton 178.5 ms
    "9.0": {
        "logprob_from_logits": ("native", "triton", "torch"),
        "policy_loss": ("triton", "native", "torch"),
        "ratio_kl": ("triton", "native", "torch"),
        "group_advantages": ("native", "triton", "torch"),
        "linear_logprob": ("triton", "native", "torch"),
    },
}
"""``{compute capability: {op: auto order}}``: the faster of native and triton first, as measured by ``benchmarks/bench_native.py``."""

UNMEASURED_PREFERENCE: dict[str, tuple[str, ...]] = {"linear_logprob": ("triton", "native", "torch")}
"""``{op: auto order}`` on an architecture :data:`MEASURED_PREFERENCE` has no measurement of the op
for; other ops take dispatch's default order (native first)."""


def auto_order(op: str, device: torch.device) -> Optional[tuple[str, ...]]:
    """The measured ``auto`` order of ``op`` on ``device`` (its compute capability), or None for dispatch's default."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        measured = MEASURED_PREFERENCE.get(f"{major}.{minor}", {})
        if op in measured:
            return measured[op]
    return UNMEASURED_PREFERENCE.get(op)


def extension(group: str) -> ModuleType:
    """The built extension of ``group`` (a key of :data:`rl_kernel_core.native_build.GROUPS`).

    Raises:
        ImportError: it cannot be built or used here; the message is the reason.
    """
    reason = native_build.unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    try:
        return native_build.build(group)
    except RuntimeError as exc:
        raise ImportError(str(exc)) from None
