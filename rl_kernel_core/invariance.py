"""Deprecated: moved to :mod:`rl_kernel_core.batch_invariant_mode.api`; this path goes in the next release."""

import warnings

from rl_kernel_core.batch_invariant_mode.api import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.invariance moved to rl_kernel_core.batch_invariant_mode.api", DeprecationWarning, stacklevel=2
)
