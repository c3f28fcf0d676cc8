"""The weight-sync check: ``rl_kernel_weight_check_every=N`` on verl's colocated vLLM rollout.

verl 0.9.1 pushes the actor's weights into its vLLM rollout after every update
(``ActorRolloutRefWorker.update_weights``, checkpoint-engine backend ``naive``): the FSDP engine's
``get_per_tensor_param`` yields each parameter as a full tensor, and the rollout's
``ServerAdapter.update_weights`` streams them to the vLLM worker, which loads them into its model.
On every N-th sync (the first, before step 1, included: syncs 0, N, 2N, ...) this module:

* digests each tensor as it streams past (:func:`rl_kernel_vllm.weights.trainer_digest`, rounded
  to the dtype the engine holds the parameter in), so no extra gather and no copy is kept;
* after the sync, has the vLLM worker digest its own parameters
  (:func:`rl_kernel_vllm.weights.save_engine_view` through verl's ``collective_rpc`` route; verl's
  server drops RPC return values, so the worker writes them to a file on this node, where verl's
  colocated sync already runs);
* compares (:func:`rl_kernel_vllm.weights.compare`), logs one warning per differing parameter,
  and adds ``rl_kernel/weight_bits_differ`` (parameters whose bits differ, missing ones
  included), ``rl_kernel/weight_checks`` (checks run so far) and ``rl_kernel/weight_check_ms`` to
  the metrics of the next ``update_actor`` (the step whose rollout ran on those weights).

Hooks, only in a process whose actor engine asks for the check (:func:`arm`, from the probe):
``BaseRollout.__init__`` is wrapped to shadow ``update_weights`` on the vLLM rollout instance
built beside the engine, and ``train_batch`` is shadowed on the engine instance. With the option
absent nothing is installed. Refused with an error naming the setting: a rollout other than
verl's vLLM ``ServerAdapter``, a replica of more than one vLLM worker (tensor, data or pipeline
parallel), a checkpoint-engine backend other than ``naive``, LoRA adapter syncs and delta syncs,
and no rollout in the actor's process by its first update.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from rl_kernel_core import adapters
from rl_kernel_core.switches import show_value
from rl_kernel_verl import switch, targets
from rl_kernel_verl.engine import METRIC_PREFIX

logger = logging.getLogger("rl_kernel.verl")

METRIC_DIFFER, METRIC_CHECKS, METRIC_MS = (
    METRIC_PREFIX + m for m in ("weight_bits_differ", "weight_checks", "weight_check_ms")
)
INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
"""vLLM's server passes a function to its workers through ``collective_rpc`` only with this set."""

_OPTION = f"fused_kernel_options.{switch.WEIGHT_CHECK_KEY}"


@dataclass
class CheckState:
    """This process's check: ``every`` N-th sync; ``rollout``: the hooked rollout (None: none yet);
    ``syncs``/``checks``: counts so far; ``engine_dtypes``: the engine's parameter dtypes (read
    once); ``last``: the latest check's metrics, reported until the next sync."""

    every: int
    rollout: Optional[str] = None
    syncs: int = 0
    checks: int = 0
    engine_dtypes: Optional[dict[str, torch.dtype]] = None
    last: Optional[dict[str, float]] = None


_lock = threading.Lock()
_patches = adapters.Patches()
_state: Optional[CheckState] = None


def arm(engine: Any, every: int) -> None:
    """Check every ``every``-th weight sync of the vLLM rollout this actor ``engine``'s process builds.

    Raises:
        ValueError: armed before in this process with another ``every``.
        rl_kernel_core.adapters.TargetMissing: verl lacks ``BaseRollout.__init__`` (the vLLM
            rollout's methods are resolved when it is built, and missing ones raise then).
    """
    global _state
    with _lock:
        if _state is not None and _state.every != every:
            raise ValueError(f"{_OPTION}={every}, but an engine of this process asked for {_state.every}")
        if _state is None:
            _patches.install(targets.ROLLOUT_INIT, _wrap_rollout_init)
            _state = CheckState(every=every)
        state = _state
    engine.train_batch = _hook_train_batch(state, engine.train_batch)
    logger.info("rl_kernel_verl: weight check armed: every %d-th weight sync into the vLLM rollout", every)


def disarm() -> None:
    """Undo :func:`arm`'s patch of ``BaseRollout.__init__`` (hooked instances keep their hooks)."""
    global _state
    with _lock:
        _patches.restore()
        _state = None


def status() -> Optional[dict[str, Any]]:
    """The check's state in this process, or None when not armed."""
    state = _state
    if state is None:
        return None
    return {
        "every": state.every,
        "rollout": state.rollout or "no vLLM rollout hooked yet",
        "syncs": state.syncs,
        "checks": state.checks,
        "last": state.last,
    }


def _wrap_rollout_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        original(self, config, model_config, device_mesh, *args, **kwargs)
        if _state is not None and switch.read(self.model_config).weight_check_every:
            _hook_rollout(_state, self)

    return __init__


def _refusal(rollout: Any) -> Optional[str]:
    """Why the check cannot cover this rollout, or None."""
    kind = f"{type(rollout).__module__}:{type(rollout).__qualname__}"
    if kind != targets.VLLM_ROLLOUT:
        return f"the rollout is {kind} (rollout.name={getattr(rollout.config, 'name', '?')!r}); the check covers {targets.VLLM_ROLLOUT}"
    config = rollout.config
    sizes = {
        key: getattr(config, key, 1)
        for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")
    }
    wide = {key: size for key, size in sizes.items() if size != 1}
    if wide:
        return "the check covers a rollout replica of one vLLM worker, got " + ", ".join(
            f"rollout.{key}={size}" for key, size in wide.items()
        )
    disaggregation = getattr(config, "disaggregation", None)
    if getattr(disaggregation, "enabled", False):
        return "rollout.disaggregation.enabled=True (prefill/decode replicas)"
    backend = config.checkpoint_engine.backend
    if backend != "naive":
        return f"rollout.checkpoint_engine.backend={backend!r} (the check hooks verl's colocated 'naive' sync)"
    value = os.environ.get(INSECURE_ENV, "0")
    if not value.strip().isdigit() or int(value) == 0:
        return (
            f"vLLM's server runs a function in its workers only with {INSECURE_ENV}=1 in the rollout's "
            f"environment, got {show_value(value)}"
        )
    return None


def _hook_rollout(state: CheckState, rollout: Any) -> None:
    reason = _refusal(rollout)
    if reason is not None:
        raise ValueError(f"{_OPTION}={state.every}: {reason}")
    for method in targets.VLLM_ROLLOUT_METHODS:
        adapters.resolve(f"{targets.VLLM_ROLLOUT}.{method}")
    rollout.update_weights = _hook_update_weights(state, rollout, rollout.update_weights)
    state.rollout = f"{type(rollout).__name__}@{id(rollout):#x}"


async def _engine_view(rollout: Any, digests: bool) -> dict[str, Any]:
    """The vLLM worker's :func:`rl_kernel_vllm.weights.save_engine_view`, read back from its file."""
    from rl_kernel_vllm import weights

    with tempfile.TemporaryDirectory(prefix="rl_kernel_weight_check_") as tmp:
        path = os.path.join(tmp, "engine.pt")
        await rollout._execute_method(weights.save_engine_view, kwargs={"path": path, "digests": digests})
        if not os.path.exists(path):
            raise RuntimeError(
                f"rl_kernel_verl: {_OPTION}: the vLLM worker wrote no digests to {path} "
                "(does this trainer rank own a rollout server?)"
            )
        return torch.load(path, weights_only=True)


def _hook_update_weights(state: CheckState, rollout: Any, original: Callable) -> Callable:
    from rl_kernel_vllm import weights as vllm_weights

    @functools.wraps(original)
    async def update_weights(weights, global_steps=None, wire_format="named_tensors", **kwargs):
        sync, state.syncs, state.last = state.syncs, state.syncs + 1, None
        if sync % state.every:
            return await original(weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        if wire_format != "named_tensors" or kwargs.get("peft_config") is not None:
            what = "a LoRA adapter" if kwargs.get("peft_config") is not None else f"wire_format={wire_format!r}"
            raise ValueError(f"{_OPTION}={state.every}: this weight sync sends {what}; the check compares full weights")
        if state.engine_dtypes is None:
            state.engine_dtypes = (await _engine_view(rollout, digests=False))["dtypes"]
        dtypes = state.engine_dtypes
        trainer: dict[str, torch.Tensor] = {}
        spent = 0.0

        def digested(name: str, tensor: torch.Tensor) -> None:
            nonlocal spent
            start = time.perf_counter()
            trainer[name] = vllm_weights.trainer_digest(name, tensor, dtypes)
            spent += time.perf_counter() - start

        if hasattr(weights, "__aiter__"):

            async def streamed_async(source):
                async for name, tensor in source:
                    digested(name, tensor)
                    yield name, tensor

            stream: Any = streamed_async(weights)
        else:

            def streamed(source):
                for name, tensor in source:
                    digested(name, tensor)
                    yield name, tensor

            stream = streamed(weights)
        result = await original(stream, global_steps=global_steps, wire_format=wire_format, **kwargs)
        start = time.perf_counter()
        reference = {name: digest.cpu() for name, digest in trainer.items()}
        lines = vllm_weights.compare(reference, (await _engine_view(rollout, digests=True))["digests"])
        spent += time.perf_counter() - start
        state.checks += 1
        for line in lines:
            logger.warning("rl_kernel_verl: weight check of sync %d (global step %s): %s", sync, global_steps, line)
        logger.log(
            logging.WARNING if lines else logging.INFO,
            "rl_kernel_verl: weight check of sync %d (global step %s): %d of %d parameters differ (%.1f ms)",
            sync,
            global_steps,
            len(lines),
            len(reference),
            spent * 1e3,
        )
        state.last = {METRIC_DIFFER: float(len(lines)), METRIC_CHECKS: float(state.checks), METRIC_MS: spent * 1e3}
        return result

    return update_weights


def _hook_train_batch(state: CheckState, original: Callable) -> Callable:
    @functools.wraps(original)
    def train_batch(data, loss_function):
        if state.rollout is None:
            raise RuntimeError(
                f"rl_kernel_verl: {_OPTION}={state.every} is set but no vLLM rollout was built in "
                "this actor's process before its first update (the check covers verl's colocated "
                "actor+rollout worker, hybrid engine)"
            )
        outputs = original(data, loss_function)
        if state.last is not None and isinstance(outputs, dict) and isinstance(outputs.get("metrics"), dict):
            outputs["metrics"].update({key: [value] for key, value in state.last.items()})
        return outputs

    return train_batch
