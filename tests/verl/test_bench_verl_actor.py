"""``benchmarks/bench_verl_actor.py`` end to end on CPU at the tiny shape, so the GPU benchmark cannot rot.

The script runs in its own process (it sets up verl's platform and a process group of its own),
on verl 0.9.1's FSDP2 actor with gloo; its JSON must hold every variant on both layouts, the
fp32 off-vs-on checks against verl's default passed for rl-kernel's switch, the adapter's hooks
live for the switch and absent otherwise, and verl's fused Triton kernels either passed or
recorded as unavailable with verl's error (they need CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("verl_default", "rl_kernel", "verl_fused_triton")
LAYOUTS = ("packed", "padded")
CHECKED = {"log_probs", "entropy", "actor/pg_loss", "actor/ppo_kl", "kl_loss", "loss", "grad_norm", "gradients"}


def _run_bench(tmp_path) -> dict:
    seed = int(torch.randint(0, 2**16, ()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_verl_actor.py"), "--model-shape", "tiny", "--device", "cpu",
           "--prompts", "2", "--samples", "2", "--prompt-len", "8", "--response-len", "8", "--max-token-len", "48",
           "--reps", "1", "--seed", str(seed), "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"seed {seed}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(tmp_path / "out" / "bench_verl_actor_tiny_packed-padded.json", encoding="utf-8") as f:
        return json.load(f)


def test_bench_verl_actor_tiny_cpu(tmp_path):
    doc = _run_bench(tmp_path)
    assert doc["environment"]["verl"] == "0.9.1" and doc["settings"]["model_shape"] == "tiny"
    assert doc["plugin"]["loaded_by_verl_entry_point"] in (True, False)
    rows = {(r["layout"], r["variant"]): r for r in doc["results"]}
    assert set(rows) == {(layout, variant) for layout in LAYOUTS for variant in VARIANTS}
    for layout in LAYOUTS:
        for variant in ("verl_default", "rl_kernel"):
            row = rows[(layout, variant)]
            assert row["check"]["status"] == "ok" and row["timing"]["status"] == "ok", row
            for op in ("log_prob", "update"):
                timing = row["timing"][op]
                assert timing["median_ms"] > 0 and timing["reps"] == 1 and timing["peak_extra_gib"] is None
            for run in ("check", "timing"):
                assert row[run]["hooks"]["ok"] and row[run]["hooks"]["probe"] == "live"
        on = rows[(layout, "rl_kernel")]
        assert CHECKED <= on["check"]["checks"].keys()
        failed = {k: v for k, v in on["check"]["checks"].items() if not v["within_contract"]}
        assert not failed, failed
        assert on["check"]["checks"]["gradients"]["parameters"] > 0
        for run in ("check", "timing"):
            engine = on[run]["hooks"]["engine"]
            assert set(engine["hooks"].values()) == {"live"} and engine["micro_batches_served"] > 0
            assert not engine["micro_batches_on_verl_path"]
            assert any(k.startswith("rl_kernel/backend/linear_logprob/") for k in on[run]["hooks"]["rl_kernel_metrics"])
        off = rows[(layout, "verl_default")]
        assert not off["timing"]["hooks"]["engine_hooked"] and not off["timing"]["hooks"]["rl_kernel_metrics"]
        fused = rows[(layout, "verl_fused_triton")]
        if fused["timing"]["status"] == "ok":
            assert fused["check"]["status"] == "ok" and all(c["within_contract"] for c in fused["check"]["checks"].values())
        else:  # verl's Triton kernels on a machine without CUDA: recorded with verl's error, nothing in its place
            assert fused["timing"]["status"] == "unavailable" and fused["timing"]["error"] and "log_prob" not in fused["timing"]
    assert {(s["layout"], s["variant"]) for s in doc["summary"]} >= {(layout, "rl_kernel") for layout in LAYOUTS}
