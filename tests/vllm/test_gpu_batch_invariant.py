"""The identity on vLLM's GPU release: with ``RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_BATCH_INVARIANT=1`` and
CUDA graphs allowed (``enforce_eager=False``), vLLM's returned log-probs, sampled and prompt tokens,
equal the trainer's recomputation (transformers under rl-kernel's batch-invariant mode, on the
GPU) bit for bit, in bf16, with more requests than ``max_num_seqs`` (requests join and leave running
batches: prefill, mixed and decode steps replayed as full CUDA graphs) and prefix-cache hits.

``python -m rl_kernel_vllm.consistency`` runs in a subprocess (the plugin reads its switches once per
process). Runs where vLLM and CUDA are present (``gpu`` marker).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from rl_kernel_vllm import harness

import vllm_tiny_model
from vllm_engine_requests import KV_CACHE_BYTES, skip_without_vllm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(tmp_path_factory, module_seed) -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    skip_without_vllm()
    from importlib.metadata import entry_points

    if not any(e.value.startswith("rl_kernel_vllm") for e in entry_points(group="vllm.general_plugins")):
        pytest.fail(
            "rl-kernel's vLLM plugin is not registered (vLLM loads it through the vllm.general_plugins "
            "entry point): install the checkout first, pip install -e . (scripts/gpu_check.sh does)"
        )
    root = tmp_path_factory.mktemp("vllm_gpu_bi")
    vllm_tiny_model.build(root / "model", module_seed)
    env = harness.environment_without_switches()
    env.update(
        RL_KERNEL_VLLM="1",
        RL_KERNEL_VLLM_BATCH_INVARIANT="1",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_LOGGING_LEVEL="INFO",
    )
    engine = {
        "max_model_len": 128,
        "max_num_seqs": 6,
        "enforce_eager": False,
        "gpu_memory_utilization": 0.2,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "enable_prefix_caching": True,
        # every step (prefill chunks, mixed, decode) within the largest captured graph
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 64,
        "compilation_config": {"max_cudagraph_capture_size": 64},
    }
    cmd = [
        sys.executable,
        "-m",
        "rl_kernel_vllm.consistency",
        "--model",
        str(root / "model"),
        "--out",
        str(root / "on.json"),
        "--prompts",
        "8",
        "--prompt-len",
        "40",
        "--shared-prefix",
        "32",
        "--n",
        "2",
        "--max-tokens",
        "24",
        "--dtype",
        "bfloat16",
        "--temperature",
        "0.8",
        "--seed",
        str(module_seed),
        "--device",
        "cuda",
        "--train-batch-size",
        "5",
        "--prompt-logprobs",
        "--batch-invariant",
        "--engine",
        json.dumps(engine),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    result = json.loads((root / "on.json").read_text())
    result["log"] = log
    return result


def test_runs_every_batch_kind_as_full_cuda_graphs(report):
    assert report["plugin"]["hooks"]["batch_invariant"]["live"], report["plugin"]
    assert re.search(r"cudagraph_mode=FULL(?!_)", report["log"]), report["log"][-3000:]


def test_rollout_logprobs_equal_training_bitwise(report):
    assert report["gap"]["tokens"] == 8 * 2 * 24
    assert report["gap"]["max"] == 0.0, report["gap"]
    assert report["prompt_gap"]["max"] == 0.0, report["prompt_gap"]
