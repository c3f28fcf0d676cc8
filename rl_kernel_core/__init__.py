"""rl-kernel core operators: the public API, re-exported from the modules that hold it."""

from rl_kernel_core.advantages import group_advantages
from rl_kernel_core.attention import varlen_attention
from rl_kernel_core.invariance import batch_invariant, is_batch_invariant, rms_norm, set_batch_invariant_mode
from rl_kernel_core.dispatch import BackendUnavailableError
from rl_kernel_core.logprob import linear_logprob, logprob_from_logits
from rl_kernel_core.policy_loss import fused_linear_policy_loss, policy_loss, ratio_kl
from rl_kernel_core.sampling import sample

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "batch_invariant",
    "fused_linear_policy_loss",
    "group_advantages",
    "is_batch_invariant",
    "linear_logprob",
    "logprob_from_logits",
    "policy_loss",
    "ratio_kl",
    "rms_norm",
    "sample",
    "set_batch_invariant_mode",
    "varlen_attention",
]
