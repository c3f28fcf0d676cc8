from rl_kernel_core.triton import fused_linear_policy_loss, linear_logprob  # noqa: F401
