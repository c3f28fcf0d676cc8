"""The adversarial consistency harness (rl_kernel_vllm.harness) on vLLM's CPU build.

12 draws per run, each a random model (Llama, Qwen2, Qwen3 or Qwen3-MoE; rope theta, rope scaling, head_dim, GQA
ratio, tied head, dtype) and workload (prompt lengths up to max_model_len, shared prefixes and prefix
caching, chunked prefill budgets, samples per prompt, temperatures, per-request seeds, mixed
max_tokens, max_num_seqs, prompt log-probs, tensor parallel 2 or 4) from a fresh seed, printed: every
sampled and prompt token's log-prob must be bitwise the trainer's. A failing draw's row names the first
divergent module (rl_kernel_vllm.drift). Also: the draws are valid engine configurations, and the
drift probe names no module where the switches are on and one where they are off.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from rl_kernel_vllm import harness

DRAWS = 12


def test_harness_draws_are_bitwise_equal(tmp_path, seed):
    rows = harness.sweep(DRAWS, seed, "cpu", tmp_path)
    failed = [harness.line(r) for r in rows if not harness.passed(r)]
    assert not failed, f"seed={seed} (rerun: python -m rl_kernel_vllm.harness --seed {seed}):\n" + "\n".join(failed)
    assert all(r["on"]["seconds"] > 0 for r in rows), f"seed={seed}: a draw without its wall time"


def test_draws_are_valid_and_cover_every_setting(seed):
    rng = random.Random(seed)
    seen: dict[str, set] = {"arch": set(), "rope": set(), "dtype": set(), "tp": set(), "chunked": set()}
    for where in ("cpu", "gpu"):
        for _ in range(1000):  # TP=4 comes about once in 50 CPU draws
            d = harness.draw(rng, where)
            m, e = d["model"], d["engine"]
            longest = e["max_model_len"] - max(d["max_tokens"])
            assert all(1 <= n <= longest for n in d["prompt_lengths"]), d
            assert 0 <= d["shared_prefix"] <= min(d["prompt_lengths"]), d
            assert len(d["max_tokens"]) == len(d["prompt_lengths"])
            assert m["num_attention_heads"] % m["num_key_value_heads"] == 0
            tp = e.get("tensor_parallel_size", 1)
            if m["architecture"] == harness.MOE:
                assert tp == 1 and 1 <= m["num_experts_per_tok"] <= m["num_experts"], m
                if where == "gpu":  # Qwen3-30B-A3B's widths, fewer layers
                    assert (
                        m["hidden_size"],
                        m["num_experts"],
                        m["num_experts_per_tok"],
                        m["moe_intermediate_size"],
                        m["dtype"],
                    ) == (2048, 128, 8, 768, "bfloat16") and m["num_hidden_layers"] >= 8, m
            else:
                assert m["hidden_size"] == m["num_attention_heads"] * m["head_dim"]
            kv = m["num_key_value_heads"]
            assert (
                (kv % tp == 0 or tp % kv == 0)
                and m["num_attention_heads"] % tp == 0
                and m["intermediate_size"] % tp == 0
            )
            rope = m["rope_parameters"]
            if rope["rope_type"] == "yarn":
                assert rope["original_max_position_embeddings"] * rope["factor"] == e["max_model_len"]
            if where == "gpu":
                assert e["max_model_len"] >= 2048 and tp == 1
            seen["arch"].add(m["architecture"])
            seen["rope"].add(rope["rope_type"])
            seen["dtype"].add(m["dtype"])
            seen["tp"].add(tp)
            seen["chunked"].add("max_num_batched_tokens" in e)
    assert seen["arch"] == set(harness.ARCHITECTURES) and seen["rope"] == set(harness.ROPES)
    assert (
        seen["dtype"] == {"bfloat16", "float16", "float32"}
        and seen["tp"] == {1, 2, 4}
        and seen["chunked"] == {True, False}
    )


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_fixed_tensor_parallel_size_keeps_the_seeds_draws(seed, tp):
    for where in ("cpu", "gpu"):
        drawn, fixed = random.Random(seed), random.Random(seed)
        for i in range(200):
            d, f = harness.draw(drawn, where), harness.draw(fixed, where, tensor_parallel=tp)
            m = f["model"]
            fits = (
                m["architecture"] != harness.MOE
                and m["num_attention_heads"] % tp == 0
                and (m["num_key_value_heads"] % tp == 0 or tp % m["num_key_value_heads"] == 0)
                and m["intermediate_size"] % tp == 0
            )
            got = f["engine"].pop("tensor_parallel_size", 1)
            d["engine"].pop("tensor_parallel_size", None)
            assert got == (tp if fits else 1) and d == f, f"seed={seed} {where} draw {i}: {f}"
    with pytest.raises(ValueError, match="tensor_parallel: expected 1, 2, 4, 8 or None, got 3"):
        harness.draw(random.Random(seed), "cpu", tensor_parallel=3)


@pytest.mark.parametrize("on", [True, False])
def test_drift_probe_names_the_first_divergent_module(tmp_path, seed, on):
    spec = harness.draw(random.Random(seed), "cpu")
    spec["model"].update(
        dtype="float32",
        architecture="Qwen3ForCausalLM",
        head_dim=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size=64,
    )
    harness.write_model(spec, tmp_path / "model", "cpu")
    ids = harness.prompts(spec)[0][:40]
    env = harness.environment_without_switches()
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if on:
        env.update(harness.SWITCHES)
    out = tmp_path / "drift.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_kernel_vllm.drift",
            "--model",
            str(tmp_path / "model"),
            "--ids",
            ",".join(map(str, ids)),
            "--out",
            str(out),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--engine",
            json.dumps({"max_model_len": 64, "skip_tokenizer_init": True}),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert len(result["drifts"]) == 2 * 6 + 2 and all(v is not None for v in result["drifts"].values()), result[
        "drifts"
    ]
    if on:
        assert result["first_divergent"] is None, result
    else:  # vLLM as shipped against the trainer in the mode: its oneDNN GEMMs round otherwise
        assert result["first_divergent"] is not None and result["first_divergent"]["point"].startswith("layers.0."), (
            result
        )


def test_draws_run_in_groups_within_the_disk_limit(seed):
    rng = random.Random(seed)
    for where in ("cpu", "gpu"):
        specs = [harness.draw(rng, where) for _ in range(40)]
        limit = rng.uniform(0.5, 30) * 2**30
        groups = harness._groups(specs, limit)
        assert [i for g in groups for i in g] == list(range(40)), f"seed={seed}"
        for g in groups:
            size = sum(harness.checkpoint_bytes(specs[i]) for i in g)
            assert len(g) == 1 or size <= limit, f"seed={seed} {where}: group {g} holds {size} bytes over {limit}"


def test_checkpoint_bytes_is_the_written_checkpoints_size(tmp_path, seed):
    spec = harness.draw(random.Random(seed), "cpu")
    harness.write_model(spec, tmp_path / "model", "cpu")
    written = sum(f.stat().st_size for f in (tmp_path / "model").glob("*.safetensors"))
    estimate = harness.checkpoint_bytes(spec)
    assert 0.9 * written <= estimate <= written, f"seed={seed}: estimated {estimate} bytes, wrote {written}"


def test_table_has_a_row_per_draw_that_ran_and_counts_the_failures(tmp_path, seed):
    rng = random.Random(seed)
    reports, ran, failed = [], 0, 0
    for r in range(rng.randint(1, 3)):
        rows = []
        for i in range(rng.randint(1, 6)):
            spec = harness.draw(rng, rng.choice(["cpu", "gpu"]))
            fate = rng.choice(["equal", "differs", "error", "skipped"])
            if fate == "skipped":
                rows.append({"draw": i, "seed": r, "spec": spec, "skipped": "not run"})
                continue
            gap = {"max": 0.0 if fate == "equal" else rng.uniform(1e-6, 1.0), "equal_fraction": 1.0, "tokens": 99}
            on = {"error": "RuntimeError: boom | here"} if fate == "error" else gap
            rows.append({"draw": i, "seed": r, "spec": spec, "on": on, "off": {**gap, "max": 0.5}})
            ran, failed = ran + 1, failed + (fate != "equal")
        reports.append({"rows": rows})
    path = tmp_path / "h.json"
    path.write_text(json.dumps(reports[0]))
    text = harness.table(reports)
    body = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| seed", "| ---"))]
    assert len(body) == ran, f"seed={seed}: {text}"
    assert all(line.count(" | ") == 4 for line in body), f"seed={seed}: a cell holds a '|': {text}"
    assert text.splitlines()[-1] == f"{ran - failed} of {ran} draws bitwise equal.", f"seed={seed}"
    cli = subprocess.run(
        [sys.executable, "-m", "rl_kernel_vllm.harness", "table", str(path)], capture_output=True, text=True
    )
    assert cli.returncode == 0 and cli.stdout.strip() == harness.table(reports[:1]), f"seed={seed}: {cli.stderr}"
