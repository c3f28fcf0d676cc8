"""Deprecated: moved to :mod:`rl_kernel_core.batch_invariant_mode.api_rope`; this path goes in the next release."""

import warnings

from rl_kernel_core.batch_invariant_mode.api_rope import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.consistency.rope moved to rl_kernel_core.batch_invariant_mode.api_rope",
    DeprecationWarning,
    stacklevel=2,
)
