"""Hook (c): vLLM's sampler draws tokens with :func:`rl_kernel_core.sample` and per-row seeds, on
the V1 model runner and on Model Runner V2.

Both targets receive the logits after vLLM's own non-argmax-invariant processing (allowed-token
mask, bad words, min-tokens, logit bias, penalties; on MRV2 also its custom logits processors and
thinking budget) and before temperature, and pass them, with each row's temperature (greedy rows
as 0), top-k, top-p and min-p, to ``sample``, which applies those itself.

* V1 runner, ``vllm.v1.sample.sampler:Sampler.sample(self, logits, sampling_metadata, ...)``: a
  request with ``SamplingParams.seed`` has its own ``torch.Generator`` in vLLM; each step draws one
  62-bit seed from it (:func:`row_seeds`), so a row's token depends only on its logits,
  parameters, request seed and step, never on the batch it shares or its position there.
  Unseeded rows draw their seed from the global RNG, as vLLM's own unseeded sampling does.
* Model Runner V2, ``vllm.v1.worker.gpu.sample.sampler:Sampler.sample(self, logits,
  expanded_idx_mapping, ...)``: MRV2 keeps one int64 seed per request (the request's
  ``SamplingParams.seed``, else one vLLM draws when the request arrives) and keys each draw on
  ``(seed, position)``; the hook passes the same pair to ``sample`` (``seeds``, ``positions``: the
  position of the row's last input token), so ``rl_kernel_core.sample(logits, ..., seeds=seed,
  positions=position)`` reproduces a seeded request's token offline. vLLM's ``apply_sampling_params``
  runs as usual with its temperature and min-p steps skipped for the call
  (:func:`_temperature_and_min_p_left_to_sample`), since ``sample`` applies them.

Left to vLLM (logged once): batches that must return *processed* log-probs or logits (vLLM builds
those from its own filtered logits); on V1, batches with argmax-invariant logits processors other
than vLLM's min-p (custom processors whose effect ``sample`` cannot reproduce); on MRV2, a sampler
built to return its sampling mask.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, Optional

import torch

import rl_kernel_core
from rl_kernel_vllm._device_copy import to_device_async
from rl_kernel_vllm._log import log_once
from rl_kernel_vllm._v1_sampler_call import sampler_call_arguments

V1_TARGET = "vllm.v1.sample.sampler:Sampler.sample"
V2_TARGET = "vllm.v1.worker.gpu.sample.sampler:Sampler.sample"
RUNNERS: dict[str, tuple[str, ...]] = {"v1": (V1_TARGET,), "v2": (V2_TARGET,)}
"""Model-runner family -> its targets (patched where every one of them resolves)."""
OVERRIDES: tuple[str, ...] = (
    "tokens are drawn by rl_kernel_core.sample with one seed per row and step (in place of vLLM's sampler, "
    "V1 runner and Model Runner V2; processed-log-prob batches and V1's custom logits processors stay vLLM's)",
)
"""The vLLM settings this hook changes, announced once per process when it is live."""
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS
SEED_BOUND = 2**62


def row_seeds(num_rows: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """``[num_rows]`` int64 seeds on ``device`` for one step: one draw from row ``i``'s generator
    when it has one (its request was seeded; drawn on the generator's device, never read back to
    the host), else from the global RNG."""
    seeds = to_device_async(torch.randint(0, SEED_BOUND, (num_rows,), dtype=torch.int64), device)
    if generators:
        rows = list(generators)
        drawn = [
            torch.randint(0, SEED_BOUND, (1,), dtype=torch.int64, generator=generators[i], device=generators[i].device)
            for i in rows
        ]
        seeds[to_device_async(torch.tensor(rows, dtype=torch.int64), device)] = torch.cat([d.to(device) for d in drawn])
    return seeds


def _min_p(logitsprocs: Any) -> tuple[bool, Optional[torch.Tensor]]:
    """``(supported, min_p [N] or None)`` from vLLM's argmax-invariant processors."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    min_p = None
    for proc in logitsprocs.argmax_invariant:
        if not isinstance(proc, MinPLogitsProcessor):
            return False, None
        if proc.min_p_count:
            min_p = proc.min_p.reshape(-1).to(torch.float32)
    return True, min_p


def wrap_v1_sample(original: Callable) -> Callable:
    """Wrap V1 ``Sampler.sample``: returns ``(tokens, None)`` from ``rl_kernel_core.sample``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def sample(self, *args: Any, **kwargs: Any):
        logits, meta, mode = sampler_call_arguments(signature, self, args, kwargs)
        wants_values = meta.max_num_logprobs is not None or bool(meta.logprob_token_ids)
        if wants_values and mode.startswith("processed"):
            log_once("sampler:processed", "rl_kernel_vllm: logprobs_mode=%s batches are sampled by vLLM", mode)
            return original(self, *args, **kwargs)
        supported, min_p = _min_p(meta.logitsprocs)
        if not supported:
            log_once(
                "sampler:logitsprocs",
                "rl_kernel_vllm: batches with custom argmax-invariant logits processors are sampled by vLLM",
            )
            return original(self, *args, **kwargs)
        n = logits.shape[0]
        if meta.temperature is None:
            temperature = torch.zeros(n, dtype=torch.float32, device=logits.device)
        else:
            temperature = torch.where(meta.temperature < GREEDY_EPS, 0.0, meta.temperature).to(torch.float32)
        tokens, _ = rl_kernel_core.sample(
            logits,
            temperature=temperature,
            top_k=meta.top_k,
            top_p=meta.top_p,
            min_p=min_p,
            seeds=row_seeds(n, meta.generators, logits.device),
        )
        return tokens, None

    return sample


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _temperature_and_min_p_left_to_sample(states: Any) -> Iterator[None]:
    """Within the block, MRV2 ``SamplingStates.apply_temperature`` and ``apply_min_p`` of this one
    ``states`` object do nothing (instance attributes shadowing the class's methods, removed on
    exit, also when the block raises); the class and every other sampler are untouched."""
    states.apply_temperature = _skip
    states.apply_min_p = _skip
    try:
        yield
    finally:
        del states.apply_temperature, states.apply_min_p


def _row_values(values: Any, rows: torch.Tensor, slots: Any, unset: float) -> Optional[torch.Tensor]:
    """One MRV2 per-request parameter for the batch's rows, ``values.gpu[rows]``, or None when no
    request of the batch (``slots``, their host-side indices) sets it (all hold ``unset``)."""
    return values.gpu[rows] if bool((values.np[slots] != unset).any()) else None


_warmed: set[tuple] = set()


def warm_up_v2(logits: torch.Tensor) -> None:
    """Compile, once per process, device, logits dtype and vocabulary size, the kernels ``sample``
    launches for filtered, unfiltered and greedy rows, by running it on ``logits`` (``[N, V]``) with
    fixed parameters (V1's dummy sampler run's temperature 0.5, top-k V - 1 and top-p 0.9, with
    min-p 0.05; then temperature 1 unfiltered; then greedy). MRV2's dummy sampler run, vLLM's warm-up, hands the
    sampler rows in its default state (greedy), so without this the first sampled batch would
    compile kernels after vLLM's warm-up."""
    key = (logits.device, logits.dtype, logits.shape[-1])
    if key in _warmed or logits.shape[0] == 0:
        return
    _warmed.add(key)
    n, v = logits.shape
    rows = torch.ones(n, dtype=torch.float32, device=logits.device)
    seeds = torch.zeros(n, dtype=torch.int64, device=logits.device)
    filters = {"top_k": (rows * max(v - 1, 1)).to(torch.int32), "top_p": rows * 0.9, "min_p": rows * 0.05}
    rl_kernel_core.sample(logits, temperature=rows * 0.5, seeds=seeds, positions=seeds, **filters)
    rl_kernel_core.sample(logits, temperature=rows, seeds=seeds, positions=seeds)
    rl_kernel_core.sample(logits, temperature=rows * 0.0, seeds=seeds, positions=seeds)


def wrap_v2_sample(original: Callable) -> Callable:
    """Wrap MRV2 ``Sampler.sample``: returns ``(tokens [N] int64, logits [N, V])`` with the tokens
    from ``rl_kernel_core.sample`` keyed on each request's MRV2 seed and the row's position, and the
    logits as vLLM processed them short of temperature and min-p (the caller reads them only for
    processed log-probs or a sampling mask, which this wrapper leaves to vLLM)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def sample(self, *args: Any, **kwargs: Any):
        call = signature.bind(self, *args, **kwargs).arguments
        call.pop("self")
        return_logprobs = call.pop("return_logprobs", False)
        if return_logprobs and self.logprobs_mode.startswith("processed"):
            log_once(
                "sampler:processed", "rl_kernel_vllm: logprobs_mode=%s batches are sampled by vLLM", self.logprobs_mode
            )
            return original(self, *args, **kwargs)
        if getattr(self, "return_sampling_mask", False):
            log_once("sampler:mask", "rl_kernel_vllm: a sampler that returns its sampling mask samples with vLLM")
            return original(self, *args, **kwargs)
        states = self.sampling_states
        rows, slots = call["expanded_idx_mapping"], call["idx_mapping_np"]
        with _temperature_and_min_p_left_to_sample(states):
            logits = self.apply_sampling_params(**call, skip_top_k_top_p=True)
        warm_up_v2(logits)
        tokens, _ = rl_kernel_core.sample(
            logits,
            temperature=states.temperature.gpu[rows],
            top_k=_row_values(states.top_k, rows, slots, unset=states.vocab_size),
            top_p=_row_values(states.top_p, rows, slots, unset=1.0),
            min_p=_row_values(states.min_p, rows, slots, unset=0.0),
            seeds=states.seeds.gpu[rows],
            positions=call["pos"],
        )
        return tokens, logits

    return sample


WRAPPERS: dict[str, Callable[[Any], Any]] = {V1_TARGET: wrap_v1_sample, V2_TARGET: wrap_v2_sample}
