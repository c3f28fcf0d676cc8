"""Hook (a): the log-probs vLLM returns for sampled (and top-k) tokens, computed by rl-kernel.

The values are accumulated in fp32 by :func:`rl_kernel_core.logprob_from_logits` (the same op and
reduction order a trainer uses through ``linear_logprob``/``logprob_from_logits``) from the
model's logits as they enter the sampler, over the full vocabulary, at a temperature that
depends on vLLM's ``logprobs_mode``:

* ``raw_logprobs`` (vLLM's default): ``log_softmax(logits)[token]``, before temperature, which is
  vLLM's own definition of that mode.
* ``processed_logprobs``: ``log softmax(logits / T)[token]`` with ``T`` the request's temperature
  (1 for greedy requests, as vLLM itself uses for them): the value a trainer recomputes. This
  overrides vLLM's definition of the mode, which also applies penalties and the
  top-k/top-p/min-p masks; the plugin announces it once per process (see :data:`OVERRIDES`).

The token ids, their order and the ranks stay vLLM's: softmax is monotonic, so dividing by
``T > 0`` changes no ranking.

Prompt log-probs (``SamplingParams(prompt_logprobs=k)``, ``k >= 0``): vLLM defines them before any
sampling processor, at temperature 1, in both log-prob modes; the hook keeps that definition and
computes the values with :func:`rl_kernel_core.logprob_from_logits` (``log_softmax(logits)[token]``,
fp32, the trainer's op at ``temperature=1``), so under the batch-invariant forward they equal a
trainer's recomputation bit for bit.

Covered: both log-prob modes and any ``logprobs=k >= 0``. Left to vLLM, with a one-time log line:
``logprobs=-1`` and ``prompt_logprobs=-1`` (the whole vocabulary), ``logprob_token_ids`` requests
and the ``*_logits`` modes (they ask for logits, not log-probs).

Targets: the V1 model runner's ``vllm.v1.sample.sampler:Sampler.forward`` (the CPU runner and
vLLM's V1 GPU runner) and, inside the runner's ``_get_prompt_logprobs_dict``, the
``compute_logprobs``/``gather_logprobs`` pair its prompt log-probs go through; Model Runner V2's ``vllm.v1.worker.gpu.sample.sampler:Sampler.__call__`` with the
``compute_topk_scores`` it imports by name, and the one ``prompt_logprob`` imports by name
(each patched where its module looks it up).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

import rl_kernel_core
from rl_kernel_core import profiling
from rl_kernel_core.adapters import ORIGINAL_ATTR
from rl_kernel_vllm._device_copy import to_device_async
from rl_kernel_vllm._log import log_once
from rl_kernel_vllm._v1_sampler_call import sampler_call_arguments

LOGPROB_MODES: tuple[str, ...] = ("raw_logprobs", "processed_logprobs")
RAW_MODE = "raw_logprobs"

OVERRIDES: tuple[str, ...] = (
    "logprobs_mode=processed_logprobs returns log softmax(logits / T) over the full vocabulary in fp32 "
    "(vLLM's penalties and top-k/top-p/min-p masks are not applied to the returned values); "
    "raw_logprobs keeps vLLM's definition (before temperature), computed in fp32 by rl-kernel",
)
"""The vLLM settings this hook changes, announced once per process when it is live."""
# vLLM's sampler treats a temperature below this as greedy and divides those rows by 1.
GREEDY_EPS = 1e-5
_IGNORE = -100

V1_TARGETS: tuple[str, ...] = (
    "vllm.v1.sample.sampler:Sampler.forward",
    "vllm.v1.sample.sampler:Sampler.compute_logprobs",
    "vllm.v1.sample.sampler:Sampler.gather_logprobs",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_prompt_logprobs_dict",
)
V2_TARGETS: tuple[str, ...] = (
    "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
    "vllm.v1.worker.gpu.sample.sampler:compute_topk_scores",
    "vllm.v1.worker.gpu.sample.prompt_logprob:compute_topk_scores",
)


def effective_temperatures(temperatures: Sequence[float]) -> list[float]:
    """Per-row temperatures as the trainer's definition uses them: greedy rows (``T < 1e-5``) get 1."""
    return [1.0 if t < GREEDY_EPS else float(t) for t in temperatures]


def mode_temperatures(mode: str, temperatures: Sequence[float]) -> list[float]:
    """The temperatures the returned values use in log-prob ``mode``: 1 for every row in
    ``raw_logprobs`` (vLLM's pre-temperature definition), else :func:`effective_temperatures`."""
    if mode == RAW_MODE:
        return [1.0] * len(temperatures)
    return effective_temperatures(temperatures)


def trainer_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """``log softmax(logits[i] / temperatures[i])[token_ids[i, j]]`` for every row ``i``, column ``j``.

    Args:
        logits: ``[N, V]`` float32/bfloat16/float16, the logits as they entered the sampler.
        token_ids: ``[N, K]`` int32/int64 ids in ``[0, V)`` (vLLM's sampled id, then its top-k).
        temperatures: ``N`` floats > 0 (see :func:`effective_temperatures`).

    Returns:
        ``[N, K]`` float32, computed by :func:`rl_kernel_core.logprob_from_logits` with fp32
        accumulation: one call per (distinct temperature, column); rows of other temperatures
        are passed as ``ignore_index`` so each call reads ``logits`` in place (no row copies).
        The ids are vLLM's own, so they are checked on the device (``id_check="device"``): a
        host sync per step would stall vLLM's asynchronous scheduling.
    """
    if token_ids.dim() != 2 or token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"token_ids must be [N={logits.shape[0]}, K], got shape {tuple(token_ids.shape)}")
    if len(temperatures) != logits.shape[0]:
        raise ValueError(f"temperatures must hold N={logits.shape[0]} values, got {len(temperatures)}")
    ids = token_ids.to(torch.int64)
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    distinct = sorted(set(temperatures))
    for t in distinct:
        rows = None
        if len(distinct) > 1:
            rows = to_device_async(torch.tensor([x == t for x in temperatures]), logits.device)
        for j in range(ids.shape[1]):
            targets = ids[:, j] if rows is None else torch.where(rows, ids[:, j], _IGNORE)
            values = rl_kernel_core.logprob_from_logits(
                logits, targets, temperature=t, ignore_index=_IGNORE, id_check="device"
            )
            if rows is None:
                out[:, j] = values
            else:
                out[:, j] = torch.where(rows, values, out[:, j])
    return out


def _replace_values(tensors: Any, logits: torch.Tensor, temperatures: Sequence[float]) -> Any:
    """``tensors`` (a vLLM ``LogprobsTensors``) with its ``logprobs`` recomputed by :func:`trainer_logprobs`."""
    with profiling.region("logprob", logits.device):
        values = trainer_logprobs(logits, tensors.logprob_token_ids, temperatures)
    return tensors._replace(logprobs=values)


def _end_step(rows: int) -> None:
    # One record per engine step in which the hook ran (RL_KERNEL_PROFILE in the worker's env).
    profiling.step_end(tokens=rows, source="vllm.sampler", pid=os.getpid())


_warmed: set[tuple] = set()


def _warm_key(logits: torch.Tensor) -> tuple:
    return (logits.device, logits.dtype, logits.shape[-1])


def is_warm(logits: torch.Tensor) -> bool:
    """Whether :func:`warm_up` has run (or has nothing to run) for logits of this kind."""
    return logits.shape[0] == 0 or _warm_key(logits) in _warmed


def warm_up(logits: torch.Tensor, *extra: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
    """Compile, once per process, device and logits dtype, the kernels the hook will launch on
    ``logits`` (``[N, V]``, as the sampler receives them), by running them on it with token id 0:
    :func:`trainer_logprobs`, then each of ``extra(logits, ids)`` (vLLM's own log-prob kernels,
    which vLLM does not compile in its warm-up because its dummy sampler run asks for no
    log-probs). Called from the sampler's first call, which is vLLM's memory-profiling dummy run,
    so no kernel of the hook compiles after vLLM's warm-up (vLLM's JIT monitor would report it)."""
    if is_warm(logits):
        return
    _warmed.add(_warm_key(logits))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.int64, device=logits.device)
    trainer_logprobs(logits, ids, [1.0] * logits.shape[0])
    for fn in extra:
        fn(logits, ids[:, 0])


# --- V1 model runner: vllm/v1/sample/sampler.py -----------------------------------------------


def wrap_v1_forward(original: Callable) -> Callable:
    """Wrap V1 ``Sampler.forward(self, logits, sampling_metadata, ...)``.

    When the batch asks for ``logprobs=k >= 0`` in a log-prob mode, the logits are copied before
    vLLM's sampler runs (it divides fp32 logits by the temperature and applies penalties in
    place), vLLM samples and picks the ids as usual, and the values of its ``LogprobsTensors``
    are replaced by :func:`trainer_logprobs` of the copy.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args: Any, **kwargs: Any):
        logits, meta, mode = sampler_call_arguments(signature, self, args, kwargs)
        if not is_warm(logits):
            warm_up(logits)
        num_logprobs = meta.max_num_logprobs
        if num_logprobs is None:
            return original(self, *args, **kwargs)
        if mode not in LOGPROB_MODES:
            log_once(f"mode:{mode}", "rl_kernel_vllm: logprobs_mode=%s returns logits; left to vLLM", mode)
            return original(self, *args, **kwargs)
        if num_logprobs < 0 or meta.logprob_token_ids:
            log_once("v1:unsupported", "rl_kernel_vllm: logprobs=-1 / logprob_token_ids requests are left to vLLM")
            return original(self, *args, **kwargs)
        raw = logits.clone()
        out = original(self, *args, **kwargs)
        if out.logprobs_tensors is None:
            return out
        temps = [1.0] * raw.shape[0] if meta.temperature is None else meta.temperature.tolist()
        out.logprobs_tensors = _replace_values(out.logprobs_tensors, raw, mode_temperatures(mode, temps))
        _end_step(raw.shape[0])
        return out

    return forward


_v1_context = threading.local()


def _prompt_values(out: Any, logits: torch.Tensor, num_logprobs: int) -> Any:
    """``out`` (a ``LogprobsTensors`` of prompt positions) with its values recomputed at T = 1,
    unless it asks for the whole vocabulary (left to vLLM)."""
    if num_logprobs < 0 or num_logprobs >= logits.shape[-1]:
        log_once("prompt:all", "rl_kernel_vllm: prompt_logprobs=-1 (the whole vocabulary) is left to vLLM")
        return out
    return _replace_values(out, logits, [1.0] * logits.shape[0])


def wrap_v1_prompt_logprobs_dict(original: Callable) -> Callable:
    """Wrap V1 ``GPUModelRunner._get_prompt_logprobs_dict`` (the CPU runner inherits it): marks, for
    the duration of the call, that ``Sampler.compute_logprobs``/``gather_logprobs`` serve prompt
    log-probs (vLLM's rejection sampler calls the same pair for speculative decoding, which the
    hook leaves alone)."""

    @functools.wraps(original)
    def prompt_logprobs_dict(*args: Any, **kwargs: Any):
        _v1_context.in_prompt = True
        try:
            return original(*args, **kwargs)
        finally:
            _v1_context.in_prompt = False
            _v1_context.prompt = None

    return prompt_logprobs_dict


def wrap_v1_compute_logprobs(original: Any) -> staticmethod:
    """Wrap V1 ``Sampler.compute_logprobs(logits)`` (a static method): inside the runner's prompt
    log-prob call, remember which logits its result came from, for :func:`wrap_v1_gather_logprobs`
    (weak references: nothing is kept alive)."""
    fn = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(fn)
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        out = fn(logits)
        if getattr(_v1_context, "in_prompt", False):
            _v1_context.prompt = (weakref.ref(out), weakref.ref(logits))
        return out

    return staticmethod(compute_logprobs)


def wrap_v1_gather_logprobs(original: Any) -> staticmethod:
    """Wrap V1 ``Sampler.gather_logprobs(logprobs, num_logprobs, token_ids)`` (a static method):
    inside the runner's prompt log-prob call, when ``logprobs`` is the result
    :func:`wrap_v1_compute_logprobs` just recorded, the values of vLLM's ids are recomputed from
    those logits by :func:`trainer_logprobs` at T = 1; ids and ranks stay vLLM's."""
    fn = original.__func__ if isinstance(original, staticmethod) else original
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def gather_logprobs(*args: Any, **kwargs: Any):
        out = fn(*args, **kwargs)
        recorded = getattr(_v1_context, "prompt", None)
        _v1_context.prompt = None
        if recorded is None or not getattr(_v1_context, "in_prompt", False):
            return out
        scores, logits = recorded[0](), recorded[1]()
        bound = signature.bind(*args, **kwargs)
        if logits is None or scores is not bound.arguments["logprobs"]:
            return out
        return _prompt_values(out, logits, bound.arguments["num_logprobs"])

    return staticmethod(gather_logprobs)


# --- Model Runner V2: vllm/v1/worker/gpu/sample/{sampler,logprob,prompt_logprob}.py -----------

_v2_context = threading.local()


def _v2_row_temperatures(sampler: Any, input_batch: Any, num_rows: int) -> list[float]:
    # Host copies only: temperature.np is the source of truth of vLLM's UvaBackedTensor.
    per_request = sampler.sampling_states.temperature.np[input_batch.idx_mapping_np]
    if num_rows != len(per_request):  # speculative decoding: several logits rows per request
        per_request = np.repeat(per_request, np.diff(input_batch.cu_num_logits_np))
    return per_request.tolist()


def _v2_vllm_topk_scores(logits: torch.Tensor, ids: torch.Tensor) -> Any:
    # vLLM's own fast path (its log-softmax and rank kernels, unpatched), on the logits it would get
    module, name = V2_TARGETS[1].split(":")
    compute_topk_scores = getattr(sys.modules[module], name)
    return getattr(compute_topk_scores, ORIGINAL_ATTR, compute_topk_scores)(logits, 0, ids)


def wrap_v2_call(original: Callable) -> Callable:
    """Wrap Model Runner V2 ``Sampler.__call__(self, logits, input_batch)``.

    Records, for the duration of the call, the raw logits and the rows' temperatures, which
    :func:`wrap_v2_compute_topk_scores` reads. In ``processed_logprobs`` mode vLLM 0.26's MRV2
    applies the temperature, penalties and biases to the logits in place (it copies them only for
    ``raw_logprobs``), so when the step returns log-probs the raw logits are copied first; samplers
    that process an fp32 copy themselves (0.32+: they have ``needs_logits_processing``) are not
    copied. The first call (vLLM's dummy sampler run) compiles the kernels (:func:`warm_up`).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(self, *args: Any, **kwargs: Any):
        bound = signature.bind(self, *args, **kwargs)
        logits = bound.arguments["logits"]
        if self.logprobs_mode not in LOGPROB_MODES:
            return original(self, *args, **kwargs)
        if not is_warm(logits):
            warm_up(logits, _v2_vllm_topk_scores)
        input_batch = bound.arguments["input_batch"]
        if self.sampling_states.max_num_logprobs(input_batch.idx_mapping_np) < 0:  # vLLM's NO_LOGPROBS
            return original(self, *args, **kwargs)
        temps = _v2_row_temperatures(self, input_batch, logits.shape[0])
        # MRV2 samplers that track needs_logits_processing (0.32+) process an fp32 copy; older ones
        # (0.26) change the logits in place in the processed modes
        in_place = self.logprobs_mode != RAW_MODE and not hasattr(self, "needs_logits_processing")
        raw = logits.clone() if in_place else logits
        _v2_context.state = (raw, mode_temperatures(self.logprobs_mode, temps))
        try:
            return original(self, *args, **kwargs)
        finally:
            _v2_context.state = None

    return call


def wrap_v2_compute_topk_scores(original: Callable) -> Callable:
    """Wrap MRV2 ``compute_topk_scores(logits, num_logprobs, sampled_token_ids, ..., max_per_req_token_ids, logits_mode)``.

    Inside a wrapped ``Sampler.__call__`` and on the plain path (no ``logprob_token_ids``, not
    a logits mode) the values are replaced by :func:`trainer_logprobs` of the raw logits.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_topk_scores(*args: Any, **kwargs: Any):
        out = original(*args, **kwargs)
        state: Optional[tuple] = getattr(_v2_context, "state", None)
        if state is None:
            return out
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["logits_mode"]:
            return out
        if bound.arguments["max_per_req_token_ids"]:
            log_once("v2:token_ids", "rl_kernel_vllm: logprob_token_ids requests are left to vLLM")
            return out
        raw, temps = state
        out = _replace_values(out, raw, temps)
        _end_step(raw.shape[0])
        return out

    return compute_topk_scores


def wrap_v2_prompt_topk_scores(original: Callable) -> Callable:
    """Wrap the ``compute_topk_scores`` MRV2's ``prompt_logprob`` module imports by name (called
    per chunk of prompt positions with their logits): the values of vLLM's ids are recomputed
    from those logits by :func:`trainer_logprobs` at T = 1; ids and ranks stay vLLM's."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_topk_scores(*args: Any, **kwargs: Any):
        out = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["logits_mode"] or bound.arguments["max_per_req_token_ids"]:
            return out
        return _prompt_values(out, bound.arguments["logits"], bound.arguments["num_logprobs"])

    return compute_topk_scores


# target -> wrapper factory, in install order
WRAPPERS: dict[str, Callable[[Any], Any]] = {
    V1_TARGETS[0]: wrap_v1_forward,
    V1_TARGETS[1]: wrap_v1_compute_logprobs,
    V1_TARGETS[2]: wrap_v1_gather_logprobs,
    V1_TARGETS[3]: wrap_v1_prompt_logprobs_dict,
    V2_TARGETS[0]: wrap_v2_call,
    V2_TARGETS[1]: wrap_v2_compute_topk_scores,
    V2_TARGETS[2]: wrap_v2_prompt_topk_scores,
}
# alternative runner families: the hook is live when at least one family is fully patched
RUNNERS: dict[str, tuple[str, ...]] = {"v1": V1_TARGETS, "v2": V2_TARGETS}
