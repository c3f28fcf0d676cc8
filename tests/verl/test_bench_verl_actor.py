"""``benchmarks/bench_verl_actor.py`` end to end on CPU at the tiny shapes (Qwen3 and Qwen3-MoE), so the GPU
benchmark cannot rot.

The script's ``main`` runs in this process (on the tier's gloo group of world size 1), on verl
0.9.1's FSDP2 actor; its JSON must hold every variant on both layouts, the fp32 off-vs-on checks
against verl's default passed for rl-kernel's switch, the adapter's hooks live for the switch and
absent otherwise, and verl's fused Triton kernels either passed or recorded as unavailable with
verl's error (they need CUDA).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("verl_default", "rl_kernel", "rl_kernel_batch_invariant", "verl_fused_triton")
HOOKED = ("rl_kernel", "rl_kernel_batch_invariant")
LAYOUTS = ("packed", "padded")
TINY_CPU_BATCH: tuple[str, ...] = ("--device", "cpu", "--prompts", "4", "--samples", "2")
TINY_CPU_BATCH += ("--prompt-len", "8", "--response-len", "8", "--max-token-len", "48")
"""The benchmark's options of both tests: on CPU, 4 prompts x 2 samples of 8 + 8 tokens."""
CHECKED = {"log_probs", "entropy", "actor/pg_loss", "actor/ppo_kl", "kl_loss", "loss", "grad_norm", "gradients"}


def _load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_verl_actor", os.path.join(REPO, "benchmarks", "bench_verl_actor.py")
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _run_bench(tmp_path, seed: int, shape: str) -> tuple[int, dict]:
    import transformers

    bench = _load_bench()
    model_class = getattr(transformers, bench.architecture(shape))
    forward = model_class.forward
    try:
        rc = bench.main(
            [
                "--model-shape",
                shape,
                *TINY_CPU_BATCH,
                "--check-prompts",
                "1",
                "--reps",
                "1",
                "--profile",
                "5",
                "--seed",
                str(seed),
                "--model-dir",
                str(tmp_path / "model"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
    finally:  # verl's use_fused_kernels replaced the class's forward for the whole process
        model_class.forward = forward
    with open(tmp_path / "out" / f"bench_verl_actor_{shape}_packed-padded.json", encoding="utf-8") as f:
        return rc, json.load(f)


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_bench_verl_actor_tiny_cpu(tmp_path, shape):
    seed = int(torch.randint(0, 2**16, ()))
    rc, doc = _run_bench(tmp_path, seed, shape)
    assert rc == 0, f"seed {seed}: {json.dumps(doc['results'])[:3000]}"
    assert doc["environment"]["verl"] == "0.9.1" and doc["settings"]["model_shape"] == shape
    assert doc["settings"]["architecture"] == ("Qwen3MoeForCausalLM" if shape == "tiny-moe" else "Qwen3ForCausalLM")
    rows = {(r["layout"], r["variant"]): r for r in doc["results"]}
    assert set(rows) == {(layout, variant) for layout in LAYOUTS for variant in VARIANTS}
    for layout in LAYOUTS:
        for variant in ("verl_default", *HOOKED):
            row = rows[(layout, variant)]
            assert row["check"]["status"] == "ok" and row["timing"]["status"] == "ok", row
            for op in ("log_prob", "update"):
                timing = row["timing"][op]
                assert timing["median_ms"] > 0 and timing["reps"] == 1 and timing["peak_extra_gib"] is None
            for run in ("check", "timing"):
                assert row[run]["hooks"]["ok"] and row[run]["hooks"]["probe"] == "live"
            for op in ("log_prob", "update"):
                profiled = row["timing"]["profile"][op]
                assert profiled["sorted_by"] == "self_cpu_time_total" and 0 < len(profiled["top"]) <= 5
                assert all(e["calls"] > 0 and e["self_ms"] >= 0 for e in profiled["top"])
        for variant, op in (("rl_kernel", "linear_logprob"), ("rl_kernel_batch_invariant", "logprob_from_logits")):
            on = rows[(layout, variant)]
            assert CHECKED <= on["check"]["checks"].keys()
            failed = {k: v for k, v in on["check"]["checks"].items() if not v["within_contract"]}
            assert not failed, f"seed {seed}, {variant}: {failed}"
            assert on["check"]["checks"]["gradients"]["parameters"] > 0
            for run in ("check", "timing"):
                engine = on[run]["hooks"]["engine"]
                assert set(engine["hooks"].values()) == {"live"} and engine["micro_batches_served"] > 0
                assert not engine["micro_batches_on_verl_path"]
                assert engine["batch_invariant"] == (variant == "rl_kernel_batch_invariant")
                assert any(k.startswith(f"rl_kernel/backend/{op}/") for k in on[run]["hooks"]["rl_kernel_metrics"])
        off = rows[(layout, "verl_default")]
        assert not off["timing"]["hooks"]["engine_hooked"] and not off["timing"]["hooks"]["rl_kernel_metrics"]
        fused = rows[(layout, "verl_fused_triton")]
        if fused["timing"]["status"] == "ok":
            assert fused["check"]["status"] == "ok" and all(
                c["within_contract"] for c in fused["check"]["checks"].values()
            )
        else:  # verl's Triton kernels on a machine without CUDA: recorded with verl's error, nothing in its place
            assert (
                fused["timing"]["status"] == "unavailable"
                and fused["timing"]["error"]
                and "log_prob" not in fused["timing"]
            )
    assert {(s["layout"], s["variant"]) for s in doc["summary"]} >= {(layout, v) for layout in LAYOUTS for v in HOOKED}
    for s in doc["summary"]:
        if s["variant"] == "rl_kernel_batch_invariant":
            assert s["update_mode_cost"] > 0 and s["log_prob_mode_cost"] > 0, s


def test_microbatch_search_steps_run_the_micro_batches_they_ask_for(tmp_path):
    """The search's mechanics on CPU (no memory limit here: it stops at the whole batch): each step
    records how many micro-batches verl's engine ran, through the switch's hook, for the size it set,
    on the leading sequences that fill two of them (8 sequences: 4 of them at 2 per micro-batch, all
    8 at 4, then all 8 in one)."""
    bench = _load_bench()
    args = bench.parse_args(
        [
            "--model-shape",
            "tiny",
            *TINY_CPU_BATCH,
            "--check-prompts",
            "0",
            "--variants",
            "rl_kernel",
            "--layouts",
            "none",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    device = torch.device("cpu")
    bench.import_verl("cpu")
    bench.init_process_group("cpu")
    model_dir = str(tmp_path / "model")
    bench.write_random_model("tiny", model_dir, dtype="bfloat16", seed=0)
    batch = bench.grpo_batch(args, bench.PRESETS["tiny"]["vocab_size"], torch.Generator().manual_seed(0))
    rec = bench.Recorder(str(tmp_path / "out" / "search.json"), {})
    row = bench.search_microbatch(args, device, model_dir, "rl_kernel", batch, rec)
    assert "error" not in row, row
    assert [(t["micro_batch_size_per_gpu"], t["micro_batches"], t["sequences"]) for t in row["tried"]] == [
        (2, 2, 4),
        (4, 2, 8),
        (8, 1, 8),
    ], row
    assert row["largest_fitting_tokens"] == 128 and "whole batch" in row["note"]
