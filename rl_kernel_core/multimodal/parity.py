"""Deprecated: moved to :mod:`rl_kernel_core.tools.multimodal.parity`; this path goes in the next release."""

import warnings

from rl_kernel_core.tools.multimodal.parity import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.multimodal.parity moved to rl_kernel_core.tools.multimodal.parity", DeprecationWarning, stacklevel=2
)
