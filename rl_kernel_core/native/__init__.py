"""The native backend: CUDA kernels from ``native/csrc``, one extension per op family.

One module per op family registers that family's ops with :mod:`rl_kernel_core.dispatch`:
the family's ``native.py`` (:mod:`rl_kernel_core.logprob.native`, :mod:`rl_kernel_core.loss.native`,
:mod:`rl_kernel_core.advantages.native`, :mod:`rl_kernel_core.linear.native`). Dispatch imports a module on the first call of an op it serves
(:attr:`rl_kernel_core.ops.OpSpec.backends`); importing it builds (or loads the cached build
of) that family's extension only (:func:`extension`). When it cannot be built or used here (a
CPU-only PyTorch, no CUDA device, no nvcc or ninja, no sources in this installation, a compiler
error) the import raises ``ImportError`` whose message is the reason; dispatch records it,
``rl-kernel info`` prints it, and an explicit ``backend="native"`` raises it. This package
itself builds nothing: it holds :func:`extension` and the command line
(``python -m rl_kernel_core.native build|check|where``, :mod:`rl_kernel_core.native_build`).

The kernels compute in fp32 (``group_advantages`` in fp64, as the reference) and reduce in a
fixed order without float atomics: results are bitwise equal run to run.
"""

from __future__ import annotations

from types import ModuleType

from rl_kernel_core import native_build


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
