from rl_kernel_core.triton import fused_linear_policy_loss, linear_logprob  # noqa: F401
from rl_kernel_core.triton import ops  # noqa: F401  (logprob_from_logits, ratio_kl, policy_loss, group_advantages)
from rl_kernel_core.triton import sampling  # noqa: F401  (sample)
from rl_kernel_core.triton import batch_invariant  # noqa: F401  (bi_matmul, bi_linear, bi_log_softmax, bi_mean, rms_norm)
from rl_kernel_core.triton import attention  # noqa: F401  (varlen_attention)
