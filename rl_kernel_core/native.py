"""The native backend: importing this module builds (or loads the cached build of) the CUDA
extension compiled from ``native/csrc`` and registers its ops with :mod:`rl_kernel_core.dispatch`.

Dispatch imports it on the first call of an op the native backend serves
(:data:`rl_kernel_core.dispatch.SERVES`), never for another op. When the extension cannot be
built or used here (a CPU-only PyTorch, no CUDA device, no nvcc or ninja, no sources in this
installation, a compiler error) the import raises ``ImportError`` whose message is the reason
(for a compiler error, the tail of the compiler's output); dispatch records it, ``rl-kernel
info`` prints it, and an explicit ``backend="native"`` raises it. The build itself, its cache and
the ahead-of-time commands are :mod:`rl_kernel_core.native_build`'s.
"""

from __future__ import annotations

import sys
from types import ModuleType

from rl_kernel_core import native_build

if __name__ == "__main__":
    sys.exit(native_build.main(sys.argv[1:]))

_reason = native_build.unavailable_reason()
if _reason is not None:
    raise ImportError(_reason)
try:
    EXTENSION: ModuleType = native_build.build()
except RuntimeError as _exc:
    raise ImportError(str(_exc)) from None

from rl_kernel_core import native_ops  # noqa: E402,F401  (registers the native backend)
