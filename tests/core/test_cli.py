"""The rl-kernel command: info, bench and compare, run as a user runs them."""

import json
import subprocess
import sys

from rl_kernel_core import cli, profiling


def _run(*args):
    proc = subprocess.run([sys.executable, "-m", "rl_kernel_core.cli", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_info_names_every_backend_and_why_unavailable():
    data = json.loads(_run("info", "--json"))
    assert data["torch"]
    assert set(data["backends"]) == {"native", "triton", "torch"}
    assert data["backends"]["torch"] == "available"
    if not data["cuda_devices"]:
        assert data["backends"]["native"].startswith("unavailable: ")
    text = _run("info")
    assert "backends:" in text and "native" in text


def test_bench_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    text = _run("bench", "-N", "64", "-D", "16", "-V", "100", "--reps", "2", "--warmup", "1", "--device", "cpu", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["shape"] == {"N": 64, "D": 16, "V": 100}
    assert [r["impl"] for r in result["results"]] == ["rl_kernel", "eager"]
    assert result["backend"] == "torch"
    assert all(r["median_ms"] > 0 for r in result["results"])
    assert "ratio rl_kernel/eager" in text


def _write(path, step_ms, tps):
    with open(path, "w") as f:
        for i, (ms, t) in enumerate(zip(step_ms, tps)):
            f.write(json.dumps({"step": i, "regions": {"step": ms, "logprob": ms / 2}, "tokens_per_s": t, "peak_vram_gib": 1.0}) + "\n")


def test_compare_table_and_ratio(tmp_path):
    off, on = tmp_path / "off.jsonl", tmp_path / "on.jsonl"
    _write(off, [100.0, 110.0, 90.0], [1000.0, 900.0, 1100.0])
    _write(on, [50.0, 55.0, 45.0], [2000.0, 1800.0, 2200.0])
    rows = {r["metric"]: r for r in cli.compare_table(profiling.read_jsonl(str(off)), profiling.read_jsonl(str(on)))}
    assert rows["region/step"]["on_over_off"] == 0.5
    assert rows["tokens_per_s"]["on_over_off"] == 2.0
    assert rows["region/logprob"]["off"]["p50"] == 50.0
    text = _run("compare", str(off), str(on))
    assert "region/step" in text and "tokens_per_s" in text and "peak_vram_gib" in text and "0.500" in text
