"""``benchmarks/bench_mode_eager.py`` runs on CPU with the tiny preset (Triton in its interpreter):
both cases, both modes, the JSON with its shapes and targets, ``--cprofile`` for the case named
(a smoke test of the script; no timing is asserted)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mode_eager.py"


def test_bench_mode_eager_tiny_on_cpu(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_mode_eager", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--gen-batch",
        "2",
        "--prompt-len",
        "5",
        "--new-tokens",
        "3",
        "--train-batch",
        "2",
        "--train-len",
        "7",
        "--out",
        str(tmp_path),
        "--cprofile",
        "--cases",
        "train",
    ]
    assert module.main(argv) == 0
    doc = json.loads((tmp_path / "bench_mode_eager.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["generate", "train"]
    assert all(
        r["off"]["median_ms"] > 0 and r["on"]["median_ms"] > 0 and r["target"] in (1.3, 1.15) for r in doc["rows"]
    )
    assert (
        doc["shapes"]["generate"] == {"batch": 2, "prompt_len": 5, "new_tokens": 3}
        and doc["environment"]["device"] == "cpu"
    )
    generate, train = doc["rows"]
    assert "cprofile" not in generate and set(train["cprofile"]) == {"off", "on"}
    assert (
        "route" in train["cprofile"]["on"] and "route" not in train["cprofile"]["off"]
    )  # the mode's routes ran, on only
