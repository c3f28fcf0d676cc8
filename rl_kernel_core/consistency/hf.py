"""Deprecated: moved to :mod:`rl_kernel_core.batch_invariant_mode.api_hf` (the consistency report's forwards to
:mod:`rl_kernel_core.tools.consistency.hf`); this path goes in the next release."""

import warnings

from rl_kernel_core.batch_invariant_mode.api_hf import *  # noqa: F401,F403
from rl_kernel_core.tools.consistency.hf import rollout_logprobs, training_logprobs  # noqa: F401

warnings.warn(
    "rl_kernel_core.consistency.hf moved to rl_kernel_core.batch_invariant_mode.api_hf",
    DeprecationWarning,
    stacklevel=2,
)
