"""Deprecated: moved to :mod:`rl_kernel_core.batch_invariant_mode.api_vlm` (the consistency chain's layouts to
:mod:`rl_kernel_core.tools.consistency.vlm`); this path goes in the next release."""

import warnings

from rl_kernel_core.batch_invariant_mode.api_vlm import *  # noqa: F401,F403
from rl_kernel_core.tools.consistency.vlm import *  # noqa: F401,F403

warnings.warn(
    "rl_kernel_core.consistency.vlm moved to rl_kernel_core.batch_invariant_mode.api_vlm",
    DeprecationWarning,
    stacklevel=2,
)
