"""Deprecated: moved to :mod:`rl_kernel_core.batch_invariant_mode.api_attention`; this path goes in the next release."""

import warnings

from rl_kernel_core.batch_invariant_mode.api_attention import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.attention moved to rl_kernel_core.batch_invariant_mode.api_attention",
    DeprecationWarning,
    stacklevel=2,
)
