"""Deprecated: moved to :mod:`rl_kernel_core.tools.multimodal.schema`; this path goes in the next release."""

import warnings

from rl_kernel_core.tools.multimodal.schema import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.multimodal.schema moved to rl_kernel_core.tools.multimodal.schema", DeprecationWarning, stacklevel=2
)
