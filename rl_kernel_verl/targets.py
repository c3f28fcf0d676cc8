"""The verl attributes the adapter reads or hooks, named by import path, and what happens when one is missing.

Each is ``"module.path:Attr.sub"``, resolved with :func:`rl_kernel_core.adapters.resolve`; a
target that does not exist (another verl version moved it) raises
:class:`rl_kernel_core.adapters.TargetMissing` naming the path and the step that failed.
:func:`missing` reports it: an error in strict mode, otherwise one logged warning per target and a
no-op for the hook that needed it.
"""

from __future__ import annotations

import logging
from rl_kernel_core import adapters

logger = logging.getLogger("rl_kernel.verl")

ENGINE_REGISTRY_NEW = "verl.workers.engine.base:EngineRegistry.new"
"""The one function wrapped in every process that loads the plugin (reads the switch)."""

ENGINE_CLASS = "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead"
"""The engine whose instances are hooked when the switch is on."""

ENGINE_METHODS: tuple[str, ...] = (
    "_build_module",
    "prepare_model_inputs",
    "forward_step",
    "train_batch",
    "infer_batch",
)
"""Methods of :data:`ENGINE_CLASS` shadowed on a switched-on engine instance (never on the class)."""

VERL_PPO_LOSS = "verl.workers.utils.losses:ppo_loss"
"""verl's actor loss; a switched-on engine runs :func:`rl_kernel_verl.loss.ppo_loss` in its place."""

PPO_OUTPUT = "verl.models.transformers.dense_common:CausalLMOutputForPPO"
"""The output type verl's fused-kernel branch reads ``log_probs``/``entropy`` from."""

PADDING = "verl.workers.utils.padding:no_padding_2_padding"
METRIC = "verl.utils.metric:Metric"
AGGREGATION = "verl.utils.metric:AggregationType"

ROLLOUT_INIT = "verl.workers.rollout.base:BaseRollout.__init__"
"""Wrapped, only in a process whose actor engine asks for the weight check, to hook the rollout built beside it."""

VLLM_ROLLOUT = "verl.workers.rollout.vllm_rollout.vllm_rollout:ServerAdapter"
"""verl's vLLM rollout (server mode); the weight check shadows ``update_weights`` on its instance and
reaches the vLLM workers through ``_execute_method`` (``collective_rpc`` on verl's rollout server)."""

VLLM_ROLLOUT_METHODS: tuple[str, ...] = ("update_weights", "_execute_method")

STRICT_ENV = "RL_KERNEL_VERL_STRICT"
"""The process-wide strict switch, read with :func:`rl_kernel_core.adapters.strict_switch` when the backend is on."""


def missing(error: adapters.TargetMissing, *, strict: bool, consequence: str) -> None:
    """Report a missing target: raise it in strict mode, else log once and carry on without the hook."""
    if strict:
        raise error
    adapters.refuse_or_warn(
        f"rl_kernel_verl: target {error}; {consequence}",
        strict=False,
        error=adapters.TargetMissing,
        logger=logger,
        hint=f"set {STRICT_ENV}=1 to make this an error",
    )
