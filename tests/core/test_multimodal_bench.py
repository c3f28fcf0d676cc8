"""``benchmarks/bench_spans.py`` runs end to end at its tiny shape on CPU and writes its JSON
(a smoke test of the script; no timing is asserted)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_spans.py"


def test_bench_spans_tiny_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_spans", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_spans_cpu_tiny.json").read_text())
    tiny = module.TINY
    length = tiny["image"] + tiny["prompt"] + tiny["response"]
    assert result["shape"]["scored_rows"] == tiny["seqs"] * tiny["response"] and result["shape"]["L"] == length
    rows = result["results"]
    assert set(rows) == {
        "transformers_default",
        "ours_fused_spans",
        "ours_logprob_then_loss_spans",
        "ours_fused_dense_mask",
    }
    for name, row in rows.items():
        assert row["median_ms"] > 0 and row["reps"] == 2
        if name != "transformers_default":
            assert all(diff < 1e-5 for diff in row["max_abs_diff_vs_transformers_default"].values()), (name, row)
    assert result["target"]["met"] is None and result["environment"]["device"] == "cpu"
