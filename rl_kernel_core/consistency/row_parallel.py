"""Deprecated: moved to :mod:`rl_kernel_core.batch_invariant_mode.api_row_parallel`; this path goes in the next release."""

import warnings

from rl_kernel_core.batch_invariant_mode.api_row_parallel import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.consistency.row_parallel moved to rl_kernel_core.batch_invariant_mode.api_row_parallel",
    DeprecationWarning,
    stacklevel=2,
)
