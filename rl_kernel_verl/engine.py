"""Hooks on one switched-on verl engine instance (``FSDPEngineWithLMHead``).

:func:`install` shadows five methods *on the instance* (verl's classes are never modified, so an
engine whose model config has the switch off, in the same process, runs verl's code as is):

* ``_build_module``: after verl builds the model, binds :func:`rl_kernel_verl.forward.causal_lm_forward`
  to it (before FSDP wraps it).
* ``forward_step``: per micro-batch, routes it to the rl-kernel path (verl's fused-kernel branch,
  fed by our forward) when the adapter can serve it, and runs :func:`rl_kernel_verl.loss.ppo_loss`
  in place of verl's ``ppo_loss``. A micro-batch it cannot serve (per-sample temperatures, Σπ²,
  top-k distillation) runs verl's own code, log-probs and loss; that is logged once per reason
  and counted in the metrics, and is an error in strict mode.
* ``prepare_model_inputs``: passes the request (entropy or not) to the forward and, without
  ``use_remove_padding``, the next-token labels verl's logits path uses.
* ``train_batch`` / ``infer_batch``: close a profiling step and add the timings and the backends
  used to the metrics verl returns (``update_actor``, ``compute_log_prob``, ``compute_ref_log_prob``).

With the batch-invariant option (``rl_kernel_batch_invariant``) the model also gets
:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention` when built, each ``train_batch`` /
``infer_batch`` (forward, backward and optimizer step) runs inside
:func:`rl_kernel_core.batch_invariant`, the forward computes the rollout's log-prob definition
(:mod:`rl_kernel_verl.forward`) over the tokenizer's ids, and every fallback is an error: a
micro-batch on verl's own path would break the identity the option exists for.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from rl_kernel_core import adapters, dispatch, profiling
from rl_kernel_core.batch_invariant_mode.api import batch_invariant
from rl_kernel_verl import forward, loss, targets

logger = logging.getLogger("rl_kernel.verl")

METRIC_PREFIX = "rl_kernel/"
_OPS_BY_REGION = {"logprob": "linear_logprob", "loss": "policy_loss"}
_OPS_BY_REGION_BATCH_INVARIANT = {**_OPS_BY_REGION, "logprob": "logprob_from_logits"}
_RELIED_ON = ("prepare_model_outputs",)
"""Methods not hooked but relied on (their fused-kernel branch); an engine overriding them is unsupported."""


@dataclass
class EngineState:
    """What the adapter did to one engine: its hooks, loss and micro-batch routing.

    ``vocab_size``: under ``batch_invariant``, the number of ids the log-probs normalise over (the
    tokenizer's length, as verl's vLLM server masks the rest); None: the model's whole vocabulary.
    ``row_split``: the model's row-parallel linears as that many ranks' sum (the rollout's tensor
    parallel size, under ``batch_invariant``).
    """

    role: str
    strict: bool
    batch_invariant: bool = False
    row_split: int = 1
    vocab_size: Optional[int] = None
    hooks: dict[str, str] = field(default_factory=dict)
    forward: str = "model not built yet"
    loss: str = "no loss seen yet"
    served: int = 0
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    call_fallbacks: int = 0
    loss_cache: dict[int, tuple[Callable, Callable]] = field(default_factory=dict)


_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("rl_kernel_verl: %s", message)


def _fallback(state: EngineState, reason: str) -> None:
    if state.batch_invariant:
        raise RuntimeError(
            f"rl_kernel_verl: rl_kernel_batch_invariant is set but {reason}, which would run verl's own "
            f"path and break rollout = training"
        )
    if state.strict:
        raise RuntimeError(f"rl_kernel_verl (strict): {reason}; this would run verl's own path")
    _log_once(f"{reason}: running verl's own path for it")


def unsupported_reason(engine: Any, engine_cls: type[Any]) -> Optional[str]:
    """Why this engine cannot be hooked, or None."""
    kind = type(engine)
    if not isinstance(engine, engine_cls):
        return f"engine {kind.__name__} is not an {engine_cls.__name__} (rl-kernel hooks verl's FSDP engine)"
    for name in targets.ENGINE_METHODS + _RELIED_ON:
        if getattr(kind, name) is not getattr(engine_cls, name):
            return f"engine {kind.__name__} overrides {name}"
    model_type = getattr(engine.model_config, "model_type", "language_model")
    if model_type != "language_model":
        return f"model_type={model_type!r} (rl-kernel serves language models)"
    return None


def install(engine: Any, *, strict: bool, batch_invariant: bool = False, row_split: int = 1) -> bool:
    """Hook ``engine`` (idempotent). Returns whether its hooks are live.

    A missing verl target or an unsupported engine leaves the engine on verl's path with a
    warning, or raises in strict mode and with ``batch_invariant``.
    """
    if isinstance(engine.__dict__.get("_rl_kernel"), EngineState):
        return True
    try:
        engine_cls = adapters.resolve(targets.ENGINE_CLASS)
        for path in (targets.VERL_PPO_LOSS, targets.PPO_OUTPUT, targets.PADDING, targets.METRIC, targets.AGGREGATION):
            adapters.resolve(path)
        for name in targets.ENGINE_METHODS + _RELIED_ON:
            adapters.resolve(f"{targets.ENGINE_CLASS}.{name}")
    except adapters.TargetMissing as exc:
        targets.missing(exc, strict=strict or batch_invariant, consequence="this engine runs verl's own path")
        return False
    reason = unsupported_reason(engine, engine_cls)
    if reason is None and batch_invariant:
        reason = _batch_invariant_reason(engine)
    if reason is not None:
        if batch_invariant:
            raise RuntimeError(f"rl_kernel_verl: rl_kernel_batch_invariant is set but {reason}")
        if strict:
            raise RuntimeError(f"rl_kernel_verl (strict): use_rl_kernel_backend is set but {reason}")
        _log_once(f"use_rl_kernel_backend is set but {reason}; the rl-kernel backend is OFF for this engine")
        return False
    role = "ref" if getattr(engine.engine_config, "forward_only", False) else "actor"
    tokenizer = getattr(engine.model_config, "tokenizer", None)
    state = EngineState(
        role=role,
        strict=strict,
        batch_invariant=batch_invariant,
        row_split=row_split,
        vocab_size=len(tokenizer) if batch_invariant and tokenizer is not None else None,
    )
    engine._rl_kernel = state
    for name, make in (
        ("_build_module", _hook_build_module),
        ("prepare_model_inputs", _hook_prepare_model_inputs),
        ("forward_step", _hook_forward_step),
        ("train_batch", _hook_train_batch),
        ("infer_batch", _hook_infer_batch),
    ):
        setattr(engine, name, make(state, getattr(engine, name)))
        state.hooks[name] = "live"
    _engines.add(engine)
    # memory=False: verl reads CUDA's peak counter itself (perf/max_memory_allocated_gb)
    if not profiling.is_enabled() and not profiling.enable_from_env(memory=False):
        profiling.enable(None, memory=False)
    if batch_invariant:
        logger.info(
            "rl_kernel_verl: %s engine: batch-invariant mode, log-probs from the logits via logprob_from_logits "
            "over %s ids, loss via policy_loss",
            role,
            state.vocab_size or "all",
        )
    else:
        logger.info(
            "rl_kernel_verl: %s engine: log-probs from hidden states via linear_logprob, loss via policy_loss", role
        )
    return True


def _batch_invariant_reason(engine: Any) -> Optional[str]:
    """Why the batch-invariant option cannot serve this engine, or None."""
    sp = getattr(engine, "ulysses_sequence_parallel_size", 1)
    if sp != 1:
        return f"ulysses_sequence_parallel_size={sp} (the option covers sequences whole on one rank)"
    return None


def _hook_build_module(state: EngineState, original: Callable) -> Callable:
    @functools.wraps(original)
    def _build_module():
        module = original()
        reason = forward.unsupported_reason(module)
        if reason is None:
            forward.install(module)
            if state.batch_invariant:
                from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention, use_row_parallel_split

                use_mode_attention(module)
                use_row_parallel_split(module, state.row_split)
            state.forward = "live"
        else:
            state.forward = reason
            _fallback(state, f"use_rl_kernel_backend is set but {reason}")
        return module

    return _build_module


def _route_reason(micro_batch: Any) -> Optional[str]:
    """Why this micro-batch must take verl's own path, or None when rl-kernel serves it."""
    get = adapters.resolve("verl.utils.tensordict_utils:get_non_tensor_data")
    if isinstance(micro_batch["temperature"], torch.Tensor):
        return "per-sample temperature tensors"
    for flag in ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"):
        if get(data=micro_batch, key=flag, default=False):
            return f"{flag}=True"
    return None


def _loss_for(state: EngineState, loss_function: Optional[Callable]) -> Optional[Callable]:
    """rl-kernel's ``ppo_loss`` in place of verl's, when the actor config is one it implements."""
    if loss_function is None:
        return None
    cached = state.loss_cache.get(id(loss_function))
    if cached is not None and cached[0] is loss_function:
        return cached[1]
    verl_ppo_loss = adapters.resolve(targets.VERL_PPO_LOSS)
    replacement = loss_function
    if isinstance(loss_function, functools.partial) and loss_function.func is verl_ppo_loss:
        reason = loss.unsupported_reason(loss_function.keywords["config"])
        if reason is None:
            replacement = functools.partial(loss.ppo_loss, *loss_function.args, **loss_function.keywords)
            state.loss = "rl_kernel ppo_loss"
        else:
            state.loss = f"verl ppo_loss: {reason}"
            _fallback(state, f"actor loss with {reason}")
    else:
        name = getattr(getattr(loss_function, "func", loss_function), "__qualname__", repr(loss_function))
        state.loss = f"verl {name} (not ppo_loss)"
    state.loss_cache[id(loss_function)] = (loss_function, replacement)
    return replacement


def _hook_forward_step(state: EngineState, original: Callable) -> Callable:
    assign = adapters.resolve("verl.utils.tensordict_utils:assign_non_tensor")

    @functools.wraps(original)
    def forward_step(micro_batch, loss_function, forward_only):
        reason = _route_reason(micro_batch)
        if reason is None and state.forward != "live":
            reason = f"model forward not hooked ({state.forward})"
        if reason is not None:  # the whole micro-batch (log-probs and loss) runs verl's code
            _fallback(state, reason)
            state.fallbacks[reason] += 1
            state.call_fallbacks += 1
            return original(micro_batch, loss_function=loss_function, forward_only=forward_only)
        micro_batch = micro_batch.copy()
        assign(micro_batch, use_fused_kernels=True, rl_kernel_route=True)
        state.served += 1
        return original(micro_batch, loss_function=_loss_for(state, loss_function), forward_only=forward_only)

    return forward_step


def _hook_prepare_model_inputs(state: EngineState, original: Callable) -> Callable:
    get = adapters.resolve("verl.utils.tensordict_utils:get_non_tensor_data")

    @functools.wraps(original)
    def prepare_model_inputs(micro_batch):
        model_inputs, output_args = original(micro_batch)
        if get(data=micro_batch, key="rl_kernel_route", default=False):
            model_inputs["rl_kernel"] = forward.Request(
                return_entropy=bool(get(data=micro_batch, key="calculate_entropy", default=False)),
                batch_invariant=state.batch_invariant,
                vocab_size=state.vocab_size,
            )
            if not get(data=micro_batch, key="use_remove_padding", default=True):
                # verl's logits path labels token t with the next token of the *packed* batch;
                # give the padded forward the same labels (only the last token of each sequence
                # differs from rolling the padded rows, and it is never used by the loss).
                rolled = torch.nested.nested_tensor_from_jagged(
                    output_args["input_ids_rmpad_rolled"], micro_batch["input_ids"].offsets()
                )
                model_inputs["shift_labels"] = torch.nested.to_padded_tensor(
                    rolled, padding=0, output_size=tuple(model_inputs["input_ids"].shape)
                )
        return model_inputs, output_args

    return prepare_model_inputs


def _add_metrics(state: EngineState, outputs: Any, pass_name: str) -> None:
    """Close the profiling step; add ``rl_kernel/*`` timings, backends and fallbacks to the metrics.

    Values follow verl's conventions for each path: a training step's metrics are per-micro-batch
    lists (verl's worker flattens them over data-parallel ranks), an inference pass's are scalars.
    """
    record = profiling.step_end(rl_kernel_pass=pass_name, role=state.role)
    fallbacks, state.call_fallbacks = state.call_fallbacks, 0
    if not isinstance(outputs, dict) or not isinstance(outputs.get("metrics"), dict) or record is None:
        return
    values: dict[str, float] = {}
    ops = _OPS_BY_REGION_BATCH_INVARIANT if state.batch_invariant else _OPS_BY_REGION
    decisions = dispatch.explain()
    for region, ms in record["regions"].items():
        values[f"{METRIC_PREFIX}{region}_ms"] = float(ms)
        op = ops.get(region)
        if op in decisions:
            values[f"{METRIC_PREFIX}backend/{op}/{decisions[op].backend}"] = 1.0
    values[f"{METRIC_PREFIX}fallback_micro_batches"] = float(fallbacks)
    values[f"{METRIC_PREFIX}batch_invariant"] = float(state.batch_invariant)
    as_list = pass_name == "train"
    outputs["metrics"].update({k: [v] if as_list else v for k, v in values.items()})


def _mode(state: EngineState):
    """Batch-invariant mode for a switched-on engine's call under the option; else nothing."""
    return batch_invariant() if state.batch_invariant else contextlib.nullcontext()


def _hook_train_batch(state: EngineState, original: Callable) -> Callable:
    @functools.wraps(original)
    def train_batch(data, loss_function):
        with _mode(state):
            outputs = original(data, loss_function)
        _add_metrics(state, outputs, "train")
        return outputs

    return train_batch


def _hook_infer_batch(state: EngineState, original: Callable) -> Callable:
    pass_name = "ref_logprob" if state.role == "ref" else "old_logprob"

    @functools.wraps(original)
    def infer_batch(data, loss_function=None):
        with profiling.region(pass_name), _mode(state):
            outputs = original(data, loss_function)
        _add_metrics(state, outputs, pass_name)
        return outputs

    return infer_batch


def engines_status() -> list[dict[str, Any]]:
    """One entry per live switched-on engine: role, hooks, forward, loss, micro-batch routing."""
    out = []
    for engine in list(_engines):
        state: EngineState = engine.__dict__["_rl_kernel"]
        out.append(
            {
                "engine": f"{type(engine).__name__}@{id(engine):#x}",
                "role": state.role,
                "strict": state.strict,
                "batch_invariant": state.batch_invariant,
                "row_split": state.row_split,
                "vocab_size": state.vocab_size,
                "hooks": dict(state.hooks),
                "forward": state.forward,
                "loss": state.loss,
                "micro_batches_served": state.served,
                "micro_batches_on_verl_path": dict(state.fallbacks),
            }
        )
    return out
