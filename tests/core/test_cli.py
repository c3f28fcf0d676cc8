"""The rl-kernel command: info, bench and compare, run as a user runs them."""

import json
import subprocess
import sys



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


def test_compare_prints_table_json_and_report(tmp_path):
    off, on = tmp_path / "off.jsonl", tmp_path / "on.jsonl"
    for path, scale in ((off, 1.0), (on, 0.5)):
        with open(path, "w") as f:
            for i, ms in enumerate([100.0, 110.0, 90.0]):
                f.write(json.dumps({"step": i, "regions": {"step": ms * scale}, "tokens_per_s": 1000.0 / scale}) + "\n")
    text = _run("compare", str(off), str(on))
    assert "region/step" in text and "tokens_per_s" in text and "0.5" in text
    rows = {r["metric"]: r for r in json.loads(_run("compare", str(off), str(on), "--json"))}
    assert rows["region/step"]["on_over_off"] == 0.5 and rows["tokens_per_s"]["on_over_off"] == 2.0
    _run("compare", str(off), str(on), "--out", str(tmp_path / "report"))
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "step_time.png").is_file()


def test_compare_bad_file_is_one_line_error(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"step": 0, "regions": {"step": 1.0}}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "rl_kernel_core.cli", "compare", str(tmp_path / "missing.jsonl"), str(good)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"rl-kernel compare: error: {tmp_path / 'missing.jsonl'}: no such file"]
