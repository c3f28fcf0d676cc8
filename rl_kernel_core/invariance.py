"""Moved to :mod:`rl_kernel_core.batch_invariant_mode.api`; kept for imports from adapters."""

from rl_kernel_core.batch_invariant_mode.api import *  # noqa: F401,F403
