"""Deprecated: moved to :mod:`rl_kernel_core.batch_invariant_mode.api_moe`; this path goes in the next release."""

import warnings

from rl_kernel_core.batch_invariant_mode.api_moe import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.consistency.moe moved to rl_kernel_core.batch_invariant_mode.api_moe",
    DeprecationWarning,
    stacklevel=2,
)
