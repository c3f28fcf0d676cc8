from rl_kernel_core.triton import fused_linear_policy_loss, linear_logprob  # noqa: F401
from rl_kernel_core.triton import ops, sampling  # noqa: F401  (logprob_from_logits, ratio_kl, policy_loss, group_advantages; sample)
