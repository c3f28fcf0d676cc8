"""Deprecated: moved to :mod:`rl_kernel_core.tools.consistency.parity`; this path goes in the next release."""

import warnings

from rl_kernel_core.tools.consistency.parity import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.consistency.parity moved to rl_kernel_core.tools.consistency.parity",
    DeprecationWarning,
    stacklevel=2,
)
