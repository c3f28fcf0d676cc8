"""The rl-kernel command: info, bench and compare, run as a user runs them."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch


def _run(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_info_names_every_backend_and_why_unavailable():
    data = json.loads(_run("info", "--json"))
    assert data["torch"]
    assert set(data["backends"]) == {"native", "triton", "torch", "flashinfer"}
    assert data["backends"]["torch"] == "available"
    if not data["cuda_devices"]:
        assert data["backends"]["native"].startswith("unavailable: ")
    if importlib.util.find_spec("flashinfer") is None:
        assert data["backends"]["flashinfer"].startswith("unavailable: flashinfer is not installed")
    if not data["cuda_devices"]:
        assert data["linear_logprob_hopper_passes"].startswith("not used: they need a compute capability 9.0 GPU")
    text = _run("info")
    assert "backends:" in text and "native" in text


def test_bench_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    text = _run(
        "bench",
        "-N",
        "64",
        "-D",
        "16",
        "-V",
        "100",
        "--reps",
        "2",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--out",
        str(out),
    )
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
    proc = subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.cli", "compare", str(tmp_path / "missing.jsonl"), str(good)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"rl-kernel compare: error: {tmp_path / 'missing.jsonl'}: no such file"]


def _main(*args, capsys):
    """``rl-kernel ARGS`` in this process: (exit status, stdout, stderr)."""
    from rl_kernel_core.tools.cli import main

    code: int | str | None
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse refusals
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_info_reports_a_bad_backend_variable_and_goes_on(monkeypatch, capsys):
    monkeypatch.setenv("RL_KERNEL_BACKEND", "garbage")
    code, out, err = _main("info", "--json", capsys=capsys)
    assert code == 0
    data = json.loads(out)
    assert (
        data["default_backend"].startswith("invalid: RL_KERNEL_BACKEND must be")
        and "'garbage'" in data["default_backend"]
    )
    assert data["backends"]["torch"] == "available"
    assert "RL_KERNEL_BACKEND" in err and "'garbage'" in err


def test_bench_refuses_a_bad_backend_variable(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RL_KERNEL_BACKEND", "garbage")
    code, out, err = _main("bench", "-N", "8", "-D", "4", "-V", "16", "--device", "cpu", capsys=capsys)
    assert code == 2 and out == ""
    assert err.startswith("rl-kernel bench: error: RL_KERNEL_BACKEND must be") and "'garbage'" in err


@pytest.mark.parametrize(
    "command, args, says",
    [
        ("bench", ("--reps", "0"), "argument --reps: must be a positive integer, got 0"),
        ("bench", ("--reps", "x"), "argument --reps: must be a positive integer, got 'x'"),
        ("bench", ("--warmup", "-1"), "argument --warmup: must be a non-negative integer, got -1"),
        ("bench", ("-N", "0"), "argument --tokens/-N: must be a positive integer, got 0"),
        ("bench", ("-D", "-3"), "argument --hidden/-D: must be a positive integer, got -3"),
        ("bench", ("-V", "0"), "argument --vocab/-V: must be a positive integer, got 0"),
        ("consistency", ("--sequences", "0"), "argument --sequences: must be a positive integer, got 0"),
        (
            "consistency",
            ("--prompt-len", "8"),
            "rl-kernel consistency: error: prompt_len must be in [1, min_len=8), got 8",
        ),
        ("consistency", ("--min-len", "30"), "rl-kernel consistency: error: max_len must be >= min_len=30, got 24"),
        ("consistency", ("--seed", "-1"), "argument --seed: must be a non-negative integer, got -1"),
    ],
)
def test_bench_and_consistency_refuse_bad_sizes(capsys, command, args, says):
    code, out, err = _main(command, "--device", "cpu", *args, capsys=capsys)
    assert code == 2 and out == ""
    assert says in err


def test_bench_checks_out_before_running(capsys, tmp_path):
    code, out, err = _main(
        "bench", "-N", "8", "-D", "4", "-V", "16", "--device", "cpu", "--out", str(tmp_path), capsys=capsys
    )
    assert code == 2 and out == "" and "which is a directory" in err
    missing = tmp_path / "no" / "such" / "bench.json"
    code, out, err = _main(
        "bench", "-N", "8", "-D", "4", "-V", "16", "--device", "cpu", "--out", str(missing), capsys=capsys
    )
    assert code == 2 and out == ""  # refused before any timing was printed
    assert err.startswith(f"rl-kernel bench: error: --out must be a writable file path, got {str(missing)!r}")
    assert list(tmp_path.iterdir()) == []


def test_bench_checks_memory_before_allocating(capsys):
    from rl_kernel_core.tools import bench
    from rl_kernel_core.tools.cli import bench_bytes

    free = bench.free_memory_bytes(torch.device("cpu"))
    n = v = 1 << 20  # [N, V] fp32 tensors of 4 TiB each: more than any host here
    need = bench_bytes(n, 8, v, torch.float32)["total"]
    assert need > free
    code, out, err = _main("bench", "-N", str(n), "-D", "8", "-V", str(v), "--device", "cpu", capsys=capsys)
    assert code == 2 and out == ""
    assert f"needs about {need / 2**30:.2f} GiB on cpu" in err and "GiB is free" in err
    assert "lower --tokens or --vocab" in err


def test_bench_bytes_counts_inputs_and_the_eager_logits():
    from rl_kernel_core.tools.cli import bench_bytes

    got = bench_bytes(10, 4, 100, torch.bfloat16)
    assert got["inputs"] == 2 * (10 * 4 + 100 * 4) * 2 + 10 * 8 + 10 * 4
    assert got["eager"] == 10 * 100 * (2 + 4 + 4 + 4)
    assert got["total"] == got["inputs"] + got["eager"]


def test_compare_reports_a_skipped_line_and_prints_valid_json(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"step": i, "regions": {"step": 1e308}}) + "\n" for i in range(3)))
    cut = tmp_path / "cut.jsonl"
    cut.write_text(good.read_text() + '{"step": 3, "regi')
    code, out, err = _main("compare", str(good), str(cut), "--json", capsys=capsys)
    assert code == 0
    assert f"ON: skipped 1 unterminated last line of {cut}" in err
    rows = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert rows[0]["off"]["mean"] is None  # an overflowed mean, not Infinity
    code, out, err = _main("compare", str(good), str(cut), capsys=capsys)
    assert code == 0 and "ON: skipped 1 unterminated last line" in out


def test_compare_refuses_bad_out_and_warmup(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"step": 0, "regions": {"step": 1.0}}) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = _main("compare", str(good), str(good), "--out", str(blocker / "rep"), capsys=capsys)
    assert code == 2 and err.startswith(f"rl-kernel compare: error: --out {str(blocker / 'rep')!r} cannot be written")
    code, out, err = _main("compare", str(good), str(good), "--warmup-steps", "-1", capsys=capsys)
    assert code == 2 and "argument --warmup-steps: must be a non-negative integer, got -1" in err


def test_every_option_has_help():
    import argparse

    from rl_kernel_core.tools.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, command in sub.choices.items()
        for action in command._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert missing == []


@pytest.mark.parametrize("command", ["bench", "consistency"])
@pytest.mark.parametrize(
    "device, says",
    [
        ("foo", "argument --device: must be cpu or cuda[:N], got 'foo'"),
        ("meta", "argument --device: must be cpu or cuda[:N], got 'meta'"),
        ("cuda:99", "argument --device: cuda:99 "),
    ],
)
def test_bad_device_is_one_line_error(capsys, command, device, says):
    code, out, err = _main(command, "--device", device, capsys=capsys)
    assert code == 2 and out == "" and says in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["bench", "consistency"])
def test_cuda_without_cuda_is_one_line_error(capsys, command):
    code, out, err = _main(command, "--device", "cuda", capsys=capsys)
    assert code == 2 and out == ""
    assert "argument --device: cuda needs CUDA, and torch.cuda.is_available() is False" in err


def _steps(path, steps, ms=1.0):
    path.write_text("".join(json.dumps({"step": i, "regions": {"step": ms}}) + "\n" for i in steps))
    return str(path)


def test_compare_warns_on_empty_disjoint_and_repeated_steps(tmp_path, capsys):
    good = _steps(tmp_path / "good.jsonl", range(3))
    cases = [
        (_steps(tmp_path / "empty.jsonl", []), f"warning: ON log {tmp_path / 'empty.jsonl'} has no step records"),
        (
            _steps(tmp_path / "late.jsonl", range(10, 13)),
            "warning: the logs share no step number (OFF steps 0..2, ON steps 10..12)",
        ),
        (
            _steps(tmp_path / "twice.jsonl", [0, 1, 2, 0, 1, 2]),
            f"warning: ON log {tmp_path / 'twice.jsonl'} repeats step numbers (3 of 6 records, first step 0)",
        ),
    ]
    for other, says in cases:
        for extra in ((), ("--json",)):
            code, out, err = _main("compare", good, other, *extra, capsys=capsys)
            assert code == 0 and err.count("warning:") == 1 and says in err, err
    code, out, err = _main("compare", good, good, capsys=capsys)
    assert code == 0 and "warning:" not in err


def test_compare_reads_huge_numbers_as_missing_and_refuses_a_huge_step(tmp_path, capsys):
    big = tmp_path / "big.jsonl"
    big.write_text('{"step": 0, "regions": {"step": 1.0}, "loss": ' + "9" * 401 + "}\n")
    code, out, err = _main("compare", str(big), str(big), "--json", capsys=capsys)
    assert code == 0 and "loss" not in {r["metric"] for r in json.loads(out)}
    big.write_text('{"step": ' + "9" * 401 + ', "regions": {"step": 1.0}}\n')
    code, out, err = _main("compare", str(big), str(big), capsys=capsys)
    assert (
        code == 2
        and err.strip() == f"rl-kernel compare: error: {big}:1: 'step' must fit in int64, got an integer of 401 digits"
    )


def test_compare_shows_medians_spreads_and_timing_noise(tmp_path, capsys):
    off = _steps(tmp_path / "off.jsonl", range(5), ms=10.0)
    noisy = tmp_path / "noisy.jsonl"
    noisy.write_text(
        "".join(json.dumps({"step": i, "regions": {"step": ms}}) + "\n" for i, ms in enumerate([99, 5, 6, 7, 60]))
    )
    code, out, err = _main("compare", off, str(noisy), capsys=capsys)
    row = next(line for line in out.splitlines() if line.startswith("region/step"))
    assert code == 0 and row.endswith(" ~") and "0.65" in row and "1.95" in row  # medians 6.5/10, means 19.5/10
    assert "timing noise: 1 of 1 timing series have overlapping off and on spreads" in out
    code, out, err = _main("compare", off, _steps(tmp_path / "fast.jsonl", range(5), ms=5.0), capsys=capsys)
    assert code == 0 and "timing noise" not in out and not out.rstrip().endswith("~")


@pytest.mark.parametrize("meta, kind", [("[1, 2]", "array"), ('"a run"', "string"), ("3", "number"), ("null", "null")])
@pytest.mark.parametrize("with_out", [False, True])
def test_compare_refuses_a_meta_file_that_is_not_an_object(tmp_path, capsys, meta, kind, with_out):
    """A ``<log>.meta.json`` holding a JSON array or string was a traceback under ``--out``."""
    off, on = tmp_path / "off.jsonl", tmp_path / "on.jsonl"
    for path in (off, on):
        path.write_text(json.dumps({"step": 0, "regions": {"step": 1.0}}) + "\n")
    (tmp_path / "on.meta.json").write_text(meta)
    code, out, err = _main(
        "compare", str(off), str(on), *(["--out", str(tmp_path / "rep")] if with_out else []), capsys=capsys
    )
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"rl-kernel compare: error: {tmp_path / 'on.meta.json'}: must hold a JSON object "
        f"(hardware, versions, config...), got a JSON {kind}"
    ]


def test_compare_shows_a_meta_environment_that_is_not_an_object(tmp_path, capsys):
    off, on = tmp_path / "off.jsonl", tmp_path / "on.jsonl"
    for path in (off, on):
        path.write_text(json.dumps({"step": 0, "regions": {"step": 1.0}}) + "\n")
    (tmp_path / "on.meta.json").write_text(json.dumps({"environment": "cpu box", "config": [1]}))
    code, _, err = _main("compare", str(off), str(on), "--out", str(tmp_path / "rep"), capsys=capsys)
    assert code == 0, err
    assert "- environment: `cpu box`" in (tmp_path / "rep" / "report.md").read_text()


def test_compare_refuses_logs_that_share_no_metric(tmp_path, capsys):
    """Two logs with disjoint metrics compared silently (two half-empty rows per metric): refused
    with exit 2, naming both files; a log with no records at all stays a warning."""
    off, on, empty = tmp_path / "off.jsonl", tmp_path / "other.jsonl", tmp_path / "empty.jsonl"
    off.write_text(json.dumps({"step": 0, "regions": {"step": 1.0}, "reward": 0.5}) + "\n")
    on.write_text(json.dumps({"step": 0, "loss_a": 1.0, "loss_b": 2.0}) + "\n")
    empty.write_text("")
    for extra in ([], ["--json"], ["--out", str(tmp_path / "rep")]):
        code, out, err = _main("compare", str(off), str(on), *extra, capsys=capsys)
        assert code == 2 and out == "", (extra, out)
        assert err.strip().splitlines() == [
            f"rl-kernel compare: error: {off} and {on} share no metric (off.jsonl: "
            "region/step, reward; other.jsonl: loss_a, loss_b): they are not two runs of "
            "one kind to compare"
        ], err
    assert not (tmp_path / "rep").exists()
    code, _, err = _main("compare", str(off), str(empty), capsys=capsys)
    assert code == 0 and "has no step records" in err
