"""vLLM's GPU release with the plugin's sampler hook (``RL_KERNEL_VLLM_SAMPLER=1``) on each model
runner (V1 and Model Runner V2), CUDA graphs on, requests that ask for no log-probs (so every step
is the hook's).

Per runner, one engine (a subprocess) serves the seeded requests of ``vllm_engine_requests.py`` without their
``logprobs`` (mixed temperatures, greedy, top-k/top-p, penalties) in one batch of six rows on a
tiny fp32 model, after vLLM's warm-up ran its dummy sampler over ``max_num_seqs`` = 8 rows.
Checked: the hook sampled every step (vLLM's sampler was never handed a batch), and none of
``rl_kernel_core.sample``'s kernels compiled after that warm-up although six rows are not eight
(vLLM's JIT monitor, verbose, logs every compile during inference). Runs where vLLM and CUDA are
present (``gpu`` marker).
"""

from __future__ import annotations

import pytest

from vllm_engine_requests import JIT_EVENT, our_kernel_names, run_gpu_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["0", "1"], ids=["v1", "mrv2"])
def run(request, tmp_path_factory, module_seed):
    return run_gpu_engine(
        tmp_path_factory.mktemp("vllm_gpu_sampler"),
        module_seed,
        logprobs=False,
        engine={},
        env={"RL_KERNEL_VLLM_SAMPLER": "1", "VLLM_USE_V2_MODEL_RUNNER": request.param},
    )


def test_the_sampler_hook_samples_every_step(run):
    for worker in run["workers"]:
        assert worker["status"]["hooks"]["sampler"]["live"], worker["status"]
    assert "are sampled by vLLM" not in run["log"], "a batch went to vLLM's sampler"
    for request, result in zip(run["requests"], run["results"]):
        assert len(result["token_ids"]) == request["params"]["max_tokens"]


def test_no_sampler_kernel_compiles_after_warm_up(run):
    compiled = set(JIT_EVENT.findall(run["log"]))
    print(f"compiled during inference: {sorted(compiled)}")
    ours = {name for name in compiled if name in our_kernel_names()}
    assert not ours, f"rl-kernel kernels compiled after vLLM's warm-up: {sorted(ours)}"
    assert "Kernel JIT monitor activated" in run["log"], "vLLM's JIT monitor did not start: nothing was watched"
