"""The requests the engine tests send to a real vLLM engine, the environment that engine runs
in, and the trainer's recomputation of what it returns (shared by ``test_engine.py`` on CPU and
``test_gpu_plugin.py`` on a GPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from rl_kernel_core import linear_logprob

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 6
JIT_EVENT = re.compile(r"kernel JIT compilation during inference: (\w+)")
"""A kernel vLLM's JIT monitor (verbose) saw compiled after the engine's warm-up."""
KV_CACHE_BYTES = 1 << 30
"""The GPU tests' fixed KV cache (``LLM(kv_cache_memory_bytes=...)``): vLLM then skips its memory profile, which
counts other processes' allocations on the same GPU (parallel test processes) as its own and finds no room."""
# SamplingParams per request (each also gets max_tokens, ignore_eos and its own seed)
REQUESTS = (
    {"temperature": 0.7, "logprobs": 0},
    {"temperature": 1.0, "logprobs": 0},
    {"temperature": 1.3, "logprobs": 2},
    {"temperature": 0.0, "logprobs": 0},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "logprobs": 0},
    {"temperature": 0.9, "presence_penalty": 0.5, "repetition_penalty": 1.2, "logprobs": 0},
)


def make_requests(seed: int, vocab: int) -> list[dict]:
    """One request per :data:`REQUESTS` entry: a random prompt of 3-8 ids in ``[3, vocab)`` (ids 0-2
    are specials) and its SamplingParams with ``MAX_TOKENS``, ``ignore_eos`` and seed ``seed + i``."""
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i, params in enumerate(REQUESTS):
        length = int(torch.randint(3, 9, (1,), generator=gen))
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        full = dict(params, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed + i)
        requests.append({"prompt_token_ids": prompt, "params": full})
    return requests


def engine_env(plugin_on: bool, profile: Path) -> dict[str, str]:
    """The engine subprocess's environment: the plugin's switches cleared, then on (with the LM
    head hook) when ``plugin_on``; step records to ``profile``; this folder importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_KERNEL_VLLM")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_LOGGING_LEVEL="INFO")
    env["RL_KERNEL_PROFILE"] = str(profile)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    if plugin_on:
        env.update(RL_KERNEL_VLLM="1", RL_KERNEL_VLLM_LM_HEAD="1")
    return env


def effective_temperature(params: dict) -> float:
    # vLLM samples greedily below 1e-5 and the trainer's definition then uses T = 1.
    return 1.0 if params["temperature"] < 1e-5 else params["temperature"]


def recompute_logprobs(
    model, prompt: list[int], completion: list[int], token_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``[L, K]`` log-probs of ``token_ids`` at each completion position, as a trainer computes them."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0]  # after the final norm
        rows = hidden[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        expanded = rows.unsqueeze(1).expand(-1, token_ids.shape[1], -1)
        return linear_logprob(expanded, model.lm_head.weight, token_ids, temperature=temperature)


def returned(result: dict, sampled_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids [L, K], logprobs [L, K])`` vLLM returned; column 0 is the sampled token."""
    ids, values = [], []
    for tok, pos in zip(result["token_ids"], result["logprobs"]):
        others = [] if sampled_only else sorted(int(t) for t in pos if int(t) != tok)
        row = [tok] + others
        ids.append(row)
        values.append([pos[str(t)][0] for t in row])
    width = min(len(r) for r in ids)
    return torch.tensor([r[:width] for r in ids]), torch.tensor([v[:width] for v in values], dtype=torch.float64)


def our_kernel_names() -> set[str]:
    """The names of rl-kernel's Triton kernels (what vLLM's JIT monitor would name)."""
    import importlib
    import pkgutil

    import rl_kernel_core.triton as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {name for name, value in vars(module).items() if name.endswith("_kernel") or hasattr(value, "fn")}
    return names


def skip_without_vllm() -> None:
    """Skip the calling test unless vLLM itself is importable: ``tests/vllm`` (no ``__init__``) imports
    as a namespace package named ``vllm`` wherever ``tests`` is on ``sys.path``, which
    ``pytest.importorskip("vllm")`` takes for vLLM."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("vllm.entrypoints") is None:
        pytest.skip("needs vLLM")


def run_gpu_engine(root: Path, seed: int, *, engine: dict, env: dict, logprobs: bool = True) -> dict:
    """One vLLM GPU engine (a subprocess, ``vllm_engine_run.py``) on a tiny fp32 model built in ``root``, serving
    :func:`make_requests` (without their ``logprobs`` when not ``logprobs``) with the plugin on, its default hook set
    and Triton kernels (the JIT monitor watches Triton compiles), a fixed KV cache and vLLM's JIT monitor; ``engine``
    and ``env`` add to both. Returns the engine's report with its ``log`` and the ``requests``. Skips the calling test
    without CUDA or vLLM."""
    import pytest

    import vllm_tiny_model

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    skip_without_vllm()

    vocab = vllm_tiny_model.build(root / "model", seed)
    requests = make_requests(seed, vocab)
    if not logprobs:
        for request in requests:
            request["params"].pop("logprobs")
    spec_engine = {
        "max_model_len": 64,
        "max_num_seqs": 8,
        "enforce_eager": False,
        "gpu_memory_utilization": 0.2,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "jit_monitor_verbose": True,
        **engine,
    }
    (root / "spec.json").write_text(
        json.dumps({"model": str(root / "model"), "requests": requests, "engine": spec_engine})
    )
    run_env = engine_env(True, root / "steps.jsonl")
    run_env.pop("RL_KERNEL_VLLM_LM_HEAD")
    run_env.pop("VLLM_CPU_KVCACHE_SPACE")
    run_env.update({"VLLM_USE_FLASHINFER_SAMPLER": "0", "RL_KERNEL_BACKEND": "triton", **env})
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_engine_run.py"), str(root / "spec.json"), str(root / "out.json")],
        env=run_env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = json.loads((root / "out.json").read_text())
    report.update(log=log, requests=requests)
    return report
