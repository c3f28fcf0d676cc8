"""rl_kernel_core.tools.report: reading step logs (malformed input named by file and line), the
comparison statistics, and the report with its plots."""

import json
import math

import pytest

from rl_kernel_core.tools import report


def _log(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _rec(step, ms=10.0, **extra):
    return {
        "step": step,
        "regions": {"step": ms, "logprob": ms / 4, "loss": 1.0, "backward": ms / 2, "update": 0.5},
        **extra,
    }


def test_statistics_and_actor_update(tmp_path):
    off = report.read_step_log(_log(tmp_path / "off.jsonl", [_rec(i, 100.0 + i, reward=0.1 * i) for i in range(5)]))
    on = report.read_step_log(_log(tmp_path / "on.jsonl", [_rec(i, 50.0 + i, reward=0.1 * i) for i in range(5)]))
    rows = {r["metric"]: r for r in report.compare_table(off, on, warmup_steps=1)}
    assert rows["region/step"]["off"]["n"] == 4 and rows["region/step"]["off"]["mean"] == pytest.approx(102.5)
    assert rows["reward"]["off"]["n"] == 5  # warm-up steps leave only timings
    # actor update = logprob + loss + backward + update per step
    assert rows["region/actor_update"]["off"]["mean"] == pytest.approx(102.5 / 4 + 1.0 + 102.5 / 2 + 0.5)
    assert rows["region/step"]["on_over_off"] == pytest.approx(52.5 / 102.5)
    assert list(rows)[:2] == ["region/step", "region/actor_update"]


def test_partial_last_line_is_skipped_and_counted(tmp_path):
    path = _log(tmp_path / "run.jsonl", [_rec(0), _rec(1)], tail='{"step": 2, "regions": {"st')
    log = report.read_step_log(path)
    assert log.steps == 2 and log.skipped_partial == 1
    # a complete last record without a final newline is read
    log = report.read_step_log(_log(tmp_path / "b.jsonl", [_rec(0)], tail=json.dumps(_rec(1))))
    assert log.steps == 2 and log.skipped_partial == 0


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"step": 0}\n{"step": 1, "regi\n{"step": 2}\n', r"bad.jsonl:2: not valid JSON"),
        ("[1, 2]\n", r"bad.jsonl:1: expected a JSON object \(a step record\), got list"),
        ('{"step": "x"}\n', r"bad.jsonl:1: 'step' must be an integer"),
        ('{"step": 0, "regions": [1]}\n', r"bad.jsonl:1: 'regions' must be an object"),
        ("[" * 100000 + "\n", r"bad.jsonl:1: (JSON nested too deeply|not valid JSON)"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(report.StepLogError, match=message):
        report.read_step_log(path)


def test_invalid_utf8_missing_file_and_directory(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(_rec(0)).encode() + b"\n\xff\xfe\n")
    with pytest.raises(report.StepLogError, match=r"bin.jsonl:2: not UTF-8"):
        report.read_step_log(path)
    with pytest.raises(report.StepLogError, match="no such file"):
        report.read_step_log(tmp_path / "missing.jsonl")
    with pytest.raises(report.StepLogError, match="not a regular file"):
        report.read_step_log(tmp_path)


def test_null_regions_nan_and_oom(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(
        '{"step": 0, "regions": null, "reward": NaN, "loss": Infinity, "kl": 0.5}\n'
        '{"step": 1, "oom": true, "error": "CUDA out of memory"}\n'
    )
    log = report.read_step_log(path)
    assert log.steps == 1 and "reward" not in log.series and "loss" not in log.series
    assert log.values("kl") == [0.5]
    assert log.oom == (1, "CUDA out of memory")


def test_values_that_are_not_finite_are_missing_and_said(tmp_path):
    """NaN, infinities and an integer beyond the float range (a 401-digit value) count as missing,
    and the comparison's warnings count them per field; text and booleans are not numbers."""
    path = tmp_path / "run.jsonl"
    path.write_text(
        '{"step": 0, "regions": {"step": 1.0}, "reward": NaN, "kl": %s, "note": "x", "flag": true}\n'
        '{"step": 1, "regions": {"step": Infinity}, "reward": 0.5, "kl": 0.1}\n' % ("9" * 401)
    )
    log = report.read_step_log(path)
    assert log.values("reward") == [0.5] and log.values("kl") == [0.1] and log.values("region/step") == [1.0]
    assert log.not_finite == {"reward": 1, "kl": 1, "region/step": 1}
    clean = report.read_step_log(_log(tmp_path / "clean.jsonl", [_rec(i) for i in range(2)]))
    warnings = report.step_warnings(clean, log)
    assert warnings == [
        f"ON log {path} has values that are NaN, infinite or beyond the float range, counted as missing: "
        "kl 1, region/step 1, reward 1"
    ]


def test_report_files_and_valid_json(tmp_path):
    off = _log(tmp_path / "off.jsonl", [_rec(i, reward=0.1, kl=float("nan")) for i in range(3)])
    on = _log(
        tmp_path / "on.jsonl", [_rec(i, reward=0.2) for i in range(2)] + [{"step": 2, "oom": True, "error": "boom"}]
    )
    (tmp_path / "on.meta.json").write_text(
        json.dumps({"command": "x", "environment": {"gpu": "G"}, "config": {"steps": 3}})
    )
    out = tmp_path / "rep"
    path = report.write_report(off, on, out, title="T", sections=[("Extra", "body")])
    text = path.read_text()
    assert text.startswith("# T") and "## Extra\n\nbody" in text and "on ran out of memory at step 2" in text
    assert "- off: `" in text and str(tmp_path) in text  # logs outside the report dir keep their path
    assert "Resolved config" in text and "- gpu: `G`" in text
    for name in ("step_time.png", "reward.png", "modules.png"):
        assert (out / name).stat().st_size > 1000
    doc = json.loads((out / "comparison.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert doc["oom"]["on"] == [2, "boom"]
    assert all(v is None or math.isfinite(v) for r in doc["rows"] for v in [r["on_over_off"]])


def test_overflowing_statistics_are_null_in_json(tmp_path, monkeypatch):
    huge = _log(tmp_path / "huge.jsonl", [{"step": i, "regions": {"step": 1e308}} for i in range(3)])
    off = report.read_step_log(huge)
    rows = report.compare_table(off, off)
    assert math.isinf(rows[0]["off"]["mean"])  # the sum of three 1e308 overflows
    text = json.dumps(report.json_safe(rows), allow_nan=False)
    assert json.loads(text)[0]["off"]["mean"] is None
    monkeypatch.setattr(report, "write_plots", lambda *args: [])  # matplotlib cannot scale an axis to 1e308
    report.write_report(huge, huge, tmp_path / "rep")
    doc = json.loads(
        (tmp_path / "rep" / "comparison.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON")
    )
    assert doc["rows"][0]["off"]["mean"] is None and doc["skipped_partial_lines"] == {"off": 0, "on": 0}


def test_a_line_beyond_the_limit_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "MAX_LINE_BYTES", 1024)
    path = _log(tmp_path / "long.jsonl", [_rec(0), {"step": 1, "note": "x" * 2000}])
    with pytest.raises(report.StepLogError, match=r"long.jsonl:2: a line longer than"):
        report.read_step_log(path)


def test_the_reader_streams(tmp_path):
    """Memory follows the values kept, not the file: 16 MiB of text, well under 4 MiB traced."""
    import tracemalloc

    path = tmp_path / "big.jsonl"
    note = "x" * 2000
    with open(path, "w") as f:
        for i in range(8000):
            f.write(json.dumps({"step": i, "regions": {"step": 1.0}, "note": note}) + "\n")
    assert path.stat().st_size > 16e6
    tracemalloc.start()
    try:
        log = report.read_step_log(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert log.steps == 8000 and log.values("region/step")[-1] == 1.0
    assert peak < 4 * 2**20, peak


def test_report_states_timing_noise_medians_and_step_warnings(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "write_plots", lambda *args: [])
    off = _log(tmp_path / "off.jsonl", [_rec(i, 100.0 + i, reward=0.5) for i in range(6)])
    on = _log(
        tmp_path / "on.jsonl", [_rec(i, ms, reward=0.5) for i, ms in enumerate([500.0, 50.0, 51.0, 52.0, 53.0, 400.0])]
    )
    text = report.write_report(off, on, tmp_path / "rep").read_text()
    assert "| metric | off mean | off median | on mean | on median | on/off (means) | on/off (medians) |" in text
    # step: off 101..105 (median 103), on 50..53 and 400 (median 52, mean 121.2): the spreads overlap
    assert "| region/step | 103 | 103 | 121.2 | 52 | 1.177 | 0.5049 |" in text
    assert "**Timing noise.** " in text and "timing series have overlapping off and on spreads" in text
    assert "| logprob | 25.25 | 25.75 | 26.25 | 12.5 | 13 | 100 | 0.5049 | 1.177 | overlap |" in text
    doc = json.loads((tmp_path / "rep" / "comparison.json").read_text())
    assert "region/step" in doc["timing_noise"][0] and doc["warnings"] == []
    rows = {r["metric"]: r for r in doc["rows"]}
    assert rows["region/step"]["spreads_overlap"] is True and rows["reward"]["spreads_overlap"] is None
    assert rows["region/loss"]["spreads_overlap"] is True and rows["region/update"]["on_over_off_median"] == 1.0

    apart = _log(tmp_path / "apart.jsonl", [_rec(i + 100, 10.0 + i) for i in range(6)])
    text = report.write_report(off, apart, tmp_path / "rep2").read_text()
    assert "- **warning:** the logs share no step number" in text
    assert "| logprob | 25.25 | 25.75 | 26.25 | 2.75 | 3.25 | 3.75 | 0.1262 | 0.1262 | apart |" in text


def test_timing_noise_counts_a_run_s_timed_steps_not_a_one_sided_region(tmp_path):
    off = report.read_step_log(
        _log(tmp_path / "off.jsonl", [{"step": i, "regions": {"step": 10.0 + i, "ratio_kl": 1.0}} for i in range(5)])
    )
    on = report.read_step_log(
        _log(tmp_path / "on.jsonl", [{"step": i, "regions": {"step": 1.0 + i}} for i in range(5)])
    )
    assert report.timing_noise(report.compare_table(off, on, warmup_steps=1)) == []  # ratio_kl is off's only
    short = report.read_step_log(
        _log(tmp_path / "short.jsonl", [{"step": i, "regions": {"step": 1.0}} for i in range(2)])
    )
    assert report.timing_noise(report.compare_table(off, short, warmup_steps=1)) == [
        "only 1 timed step(s) in a run: too few for its spread to show the noise"
    ]
    assert report.timing_noise(report.compare_table(off, short, warmup_steps=2)) == [
        "only 0 timed step(s) in a run: too few for its spread to show the noise"
    ]


def test_disjoint_logs_are_refused_by_the_report_too(tmp_path):
    off, on = tmp_path / "off.jsonl", tmp_path / "on.jsonl"
    _log(off, [_rec(0), _rec(1)])
    on.write_text(json.dumps({"step": 0, "accuracy": 1.0}) + "\n")
    with pytest.raises(
        report.StepLogError,
        match=r"off.jsonl and .*on.jsonl share no metric \(off.jsonl: region/actor_update, "
        r"region/backward, region/logprob, region/loss and 2 more; on.jsonl: accuracy\)",
    ):
        report.write_report(off, on, tmp_path / "rep")
    assert not (tmp_path / "rep").exists()
