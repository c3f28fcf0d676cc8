"""Patch targets named by import path, and what happens when one is missing.

Every verl attribute the adapter reads or hooks is named here as ``"module.path:Attr.sub"``.
:func:`resolve` imports the module and walks the attribute chain; a target that does not exist
(another verl version moved it) raises :class:`TargetMissing` naming the path and the step that
failed. :func:`missing` reports a missing target: an error in strict mode, otherwise one logged
warning per target and a no-op for the hook that needed it.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

logger = logging.getLogger("rl_kernel.verl")

ENGINE_REGISTRY_NEW = "verl.workers.engine.base:EngineRegistry.new"
"""The one function wrapped in every process that loads the plugin (reads the switch)."""

ENGINE_CLASS = "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead"
"""The engine whose instances are hooked when the switch is on."""

ENGINE_METHODS: tuple[str, ...] = ("_build_module", "prepare_model_inputs", "forward_step", "train_batch", "infer_batch")
"""Methods of :data:`ENGINE_CLASS` shadowed on a switched-on engine instance (never on the class)."""

VERL_PPO_LOSS = "verl.workers.utils.losses:ppo_loss"
"""verl's actor loss; a switched-on engine runs :func:`rl_kernel_verl.loss.ppo_loss` in its place."""

PPO_OUTPUT = "verl.models.transformers.dense_common:CausalLMOutputForPPO"
"""The output type verl's fused-kernel branch reads ``log_probs``/``entropy`` from."""

PADDING = "verl.workers.utils.padding:no_padding_2_padding"
METRIC = "verl.utils.metric:Metric"
AGGREGATION = "verl.utils.metric:AggregationType"

STRICT_ENV = "RL_KERNEL_VERL_STRICT"


class TargetMissing(RuntimeError):
    """A verl attribute the adapter needs does not exist in the installed verl."""


def env_strict() -> bool:
    """Whether ``RL_KERNEL_VERL_STRICT=1`` is set (the process-wide strict switch)."""
    return os.environ.get(STRICT_ENV, "0").strip().lower() in ("1", "true", "yes")


def resolve(path: str) -> Any:
    """The object at ``"module.path:Attr.sub"``; raises :class:`TargetMissing` when absent."""
    module_name, _, attrs = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetMissing(f"rl_kernel_verl: target {path}: cannot import {module_name} ({exc})") from exc
    walked = module_name
    for attr in attrs.split(".") if attrs else ():
        if not hasattr(obj, attr):
            raise TargetMissing(f"rl_kernel_verl: target {path}: {walked} has no attribute {attr!r} (is this verl 0.9.x?)")
        obj = getattr(obj, attr)
        walked = f"{walked}.{attr}"
    return obj


_reported: set[str] = set()


def missing(error: TargetMissing, *, strict: bool, consequence: str) -> None:
    """Report a missing target: raise in strict mode, else log once and carry on without the hook."""
    if strict:
        raise error
    key = str(error)
    if key not in _reported:
        _reported.add(key)
        logger.warning("%s; %s (set %s=1 to make this an error)", error, consequence, STRICT_ENV)
