"""What the hooks replace, by import path. Standard library only.

Each :class:`Target` names a module-level function of vime, the op switch that selects it, the
function of :mod:`rl_kernel_vime.hooks` that replaces it, and the parameter names the original
must have (the version check: a vime whose function lost or renamed one is not patched).
Modules that import a target by name (``from vime.utils.ppo_utils import compute_approx_kl``)
get their binding replaced too: every loaded ``vime.*`` module is scanned for the original object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PACKAGE = "vime"
PPO_UTILS = "vime.utils.ppo_utils"
LOSS = "vime.backends.megatron_utils.loss"
MODEL = "vime.backends.megatron_utils.model"
PROVIDER_BOUNDARY = "vime.backends.megatron_utils.linear_logp_provider"
"""vime's provider boundary for selected log-probs (``--linear-logp-provider``)."""
PROVIDER_PATH = "rl_kernel_vime.provider.provider"
"""What a vime user passes as ``--linear-logp-provider`` (and what ``VIME_RL_KERNEL=1`` makes the default)."""


@dataclass(frozen=True)
class Target:
    """One replaced function."""

    module: str
    attr: str
    op: Optional[str]
    """The ``VIME_RL_KERNEL_OPS`` name selecting it; None: the step-timing hook, live whenever the hooks are on."""
    params: tuple[str, ...]
    """Parameter names the original's signature must contain."""

    @property
    def key(self) -> str:
        """``"module:attr"``."""
        return f"{self.module}:{self.attr}"


TARGETS: tuple[Target, ...] = (
    Target(
        PPO_UTILS,
        "calculate_log_probs_and_entropy",
        "logprob",
        ("logits", "tokens", "tp_group", "with_entropy", "chunk_size"),
    ),
    Target(
        PPO_UTILS, "compute_approx_kl", "ratio_kl", ("log_probs", "log_probs_base", "kl_loss_type", "importance_ratio")
    ),
    Target(
        LOSS,
        "get_log_probs_and_entropy",
        "logprob",
        ("logits", "args", "unconcat_tokens", "total_lengths", "response_lengths", "with_entropy"),
    ),
    Target(LOSS, "policy_loss_function", "grpo_loss", ("args", "batch", "logits", "sum_of_sample_mean")),
    Target(MODEL, "train_one_step", None, ("args", "rollout_id", "step_id")),
    Target(PROVIDER_BOUNDARY, "linear_logp_provider_path", "logprob", ("args",)),
)

MODULES: frozenset[str] = frozenset(t.module for t in TARGETS)

NOT_REPLACED: dict[str, str] = {
    f"{PPO_UTILS}:compute_policy_loss": (
        "per-token clipped surrogate; rl_kernel_core.loss returns aggregated losses only, so "
        "the grpo_loss op replaces policy_loss_function as a whole instead"
    ),
}
"""Functions of the documented interface left alone, and why."""
