"""Deprecated: moved to :mod:`rl_kernel_core.tools.report`; this path goes in the next release."""

import warnings

from rl_kernel_core.tools.report import *  # noqa: F401,F403

warnings.warn("rl_kernel_core.report moved to rl_kernel_core.tools.report", DeprecationWarning, stacklevel=2)
