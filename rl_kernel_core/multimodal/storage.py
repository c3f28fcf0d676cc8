"""Deprecated: moved to :mod:`rl_kernel_core.tools.multimodal.storage`; this path goes in the next release."""

import warnings

from rl_kernel_core.tools.multimodal.storage import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.multimodal.storage moved to rl_kernel_core.tools.multimodal.storage",
    DeprecationWarning,
    stacklevel=2,
)
