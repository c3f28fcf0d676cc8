"""CONTRACT STAND-IN, NOT VIME.

vime (a fork of slime: vLLM rollout, Megatron training) is not on any package registry, so
rl-kernel's vime hooks are tested against this package instead. It reproduces the module paths,
signatures, return conventions and formulas of the functions the hooks replace, written from the
documented interface (the rl-kernel adapter issue) and slime's public sources
(``slime/backends/megatron_utils/loss.py``, ``slime/utils/ppo_utils.py``,
``slime/backends/megatron_utils/cp_utils.py``, ``slime/backends/megatron_utils/model.py``):

* ``vime.utils.ppo_utils``: ``compute_approx_kl``, ``compute_policy_loss``,
  ``calculate_log_probs_and_entropy`` (and the helpers they use).
* ``vime.backends.megatron_utils.loss``: ``get_log_probs_and_entropy``,
  ``policy_loss_function``, ``loss_function``.
* ``vime.backends.megatron_utils.linear_logp_provider``: the provider boundary for selected
  log-probs (``--linear-logp-provider``, ``--linear-logp-provider-mode``), as at RL-Align/vime
  commit 33254c738f1d43250916ae6887f7981e77dbe411.
* ``vime.backends.megatron_utils.selected_logprob_provider``: the other provider boundary
  (``--selected-logprob-provider``, ``--selected-logprob-provider-mode``; a flat request with
  optional hidden states and LM head), as at RL-Align/vime commit
  e0d231806e06a3000b9ba4f5be4bd7ba235dfcdc. What the two boundaries share is written once in
  ``vime.backends.megatron_utils._provider_boundary`` (the stand-in's own module; vime repeats it).
* ``vime.backends.megatron_utils.cp_utils``: ``get_sum_of_sample_mean``.
* ``vime.backends.megatron_utils.model``: ``train_one_step`` (simplified: one process, no
  pipeline, the same return convention).
* ``vime.utils.misc``: ``load_function`` (the hook-flag loader).

What it does not reproduce (it raises ``NotImplementedError`` naming the feature): tensor or
context parallelism (it has no Megatron process groups), and policy-loss features outside the
PPO/GRPO path (GSPO, CISPO, OPSM, TIS, score centering, top-p replay). Passing these tests shows
agreement with this stand-in, not with a vime release.
"""

__version__ = "0.0.0+contract-standin"
