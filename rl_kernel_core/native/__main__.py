"""``python -m rl_kernel_core.native build|check|where``: see :mod:`rl_kernel_core.native_build`."""

import sys

from rl_kernel_core import native_build

sys.exit(native_build.main(sys.argv[1:]))
