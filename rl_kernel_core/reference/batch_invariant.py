"""Moved to :mod:`rl_kernel_core.batch_invariant_mode.reference`; kept for imports from adapters."""

from rl_kernel_core.batch_invariant_mode.reference import *  # noqa: F401,F403
