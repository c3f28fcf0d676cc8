"""``benchmarks/bench_moe_experts.py`` runs on CPU at tiny widths: every row timed or skipped with
its reason, the grouped experts bitwise equal to the per-expert loop (the script asserts it), the
JSON with its shapes (a smoke test of the script; no timing is asserted)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe_experts.py"


def test_bench_moe_experts_tiny_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_moe_experts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = "--device cpu --experts 6 --hidden 32 --inter 16 --top-k 3 --tokens 1,9 --reps 1 --warmup 0".split()
    assert module.main([*argv, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_moe_experts.json").read_text())
    assert doc["shapes"] == {"experts": 6, "hidden": 32, "inter": 16, "top_k": 3, "tokens": "1,9"}
    assert [r["tokens"] for r in doc["rows"]] == [1, 9]
    for row in doc["rows"]:
        for name in ("grouped", "per_expert", "grouped_train", "per_expert_train", "transformers"):
            assert row[name]["median_ms"] > 0, (name, row[name])
        assert row["grouped_graph"] == {"skipped": "CUDA graphs need a CUDA device"}
        assert "median_ms" in row["vllm_fused"] or row["vllm_fused"]["skipped"]
