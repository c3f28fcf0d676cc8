"""Hook (c): vLLM's V1 sampler draws tokens with :func:`rl_kernel_core.sample` and per-row seeds.

Target: ``vllm.v1.sample.sampler:Sampler.sample(self, logits, sampling_metadata, ...)``, which
receives the fp32 logits after vLLM's non-argmax-invariant processing (allowed-token mask, bad
words, min-tokens, logit bias, penalties) and before temperature. The replacement passes them,
with each row's temperature (greedy rows as 0), top-k, top-p and min-p, to ``sample``.

Seeds: a request with ``SamplingParams.seed`` has its own ``torch.Generator`` in vLLM; each step
draws one 62-bit seed from it (:func:`row_seeds`), so a row's token depends only on its logits,
parameters, request seed and step, never on the batch it shares or its position there, and
``rl_kernel_core.sample`` reproduces it offline from the same seed. Unseeded rows draw their seed
from the global RNG, as vLLM's own unseeded sampling does.

Left to vLLM (logged once): batches that must return *processed* log-probs or logits (vLLM builds
those from its own filtered logits), and batches with argmax-invariant logits processors other
than vLLM's min-p (custom processors whose effect ``sample`` cannot reproduce).

Model Runner V2 is not covered: with the hook on, building MRV2's sampler raises
(:func:`refuse_model_runner_v2`), so an engine on that runner stops at start with the setting to
change instead of sampling with vLLM's sampler while the switch says otherwise.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch

import rl_kernel_core
from rl_kernel_vllm._device_copy import to_device_async
from rl_kernel_vllm._log import log_once
from rl_kernel_vllm._v1_sampler_call import sampler_call_arguments

TARGETS: tuple[str, ...] = ("vllm.v1.sample.sampler:Sampler.sample",)
V2_SAMPLER_INIT = "vllm.v1.worker.gpu.sample.sampler:Sampler.__init__"
"""Model Runner V2's sampler, which the hook refuses (:func:`refuse_model_runner_v2`)."""
OVERRIDES: tuple[str, ...] = (
    "the V1 runner's tokens are drawn by rl_kernel_core.sample with one seed per row and step "
    "(in place of vLLM's sampler; processed-log-prob batches and custom logits processors stay vLLM's)",
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


def refuse_model_runner_v2(original: Callable) -> Callable:
    """Replace MRV2 ``Sampler.__init__`` by a clear error: the hook covers the V1 runner only."""

    @functools.wraps(original)
    def init(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "RL_KERNEL_VLLM_SAMPLER=1: rl-kernel's sampler hook covers vLLM's V1 model runner, and this engine "
            f"builds Model Runner V2's sampler; set {_ways_out()}"
        )

    return init


def _ways_out() -> str:
    """The settings that let an engine start: the V1 runner where this vLLM still has it (vLLM 0.34
    removed it and ``VLLM_USE_V2_MODEL_RUNNER``), else the hook off."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.sample.sampler") is None:
        return "RL_KERNEL_VLLM_SAMPLER=0 (this vLLM has no V1 runner)"
    return "VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner) or RL_KERNEL_VLLM_SAMPLER=0"


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
