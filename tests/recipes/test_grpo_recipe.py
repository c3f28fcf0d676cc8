"""recipes/grpo_gsm8k.sh end to end on the tiny preset (embedded engine, CPU), and its helpers."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
sys.path.insert(0, str(ROOT / "recipes"))

from grpo import data, scoring  # noqa: E402
from recipe_runs import RUN_FILES, SMALL_RUN, assert_written, read_records, run_recipe_script  # noqa: E402

STEPS = 3


def _run_recipe(out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ("--preset", "tiny", "--steps", str(STEPS), "--prompts-per-step", "4", "--group-size", "4")
    return run_recipe_script("grpo_gsm8k.sh", [*args, "--out", str(out), "--no-progress", *extra], timeout=900)


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory):
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K}")
    out = tmp_path_factory.mktemp("grpo")
    proc = _run_recipe(out, "--data", str(GSM8K), "--limit", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_recipe_writes_logs_report_and_plots(gsm8k_run):
    out, proc = gsm8k_run
    assert_written(out, [*RUN_FILES, "first_step.json", "modules.png", "logprob_diff.png", "loss.png"])
    assert "engine: embedded" in proc.stdout
    off, on = read_records(out / "off.jsonl"), read_records(out / "on.jsonl")
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(STEPS))
    assert {r["backend"] for r in off} == {"off"} and {r["backend"] for r in on} == {"on"}
    for rec in off + on:
        assert set(rec["regions"]) >= {"rollout", "old_logprob", "logprob", "loss", "backward", "update", "step"}
        assert 0.0 <= rec["reward"] <= 1.0
    meta = json.loads((out / "on.meta.json").read_text())
    assert meta["config"]["steps"] == STEPS and meta["git_commit"] and meta["command"]
    assert meta["backends"]["linear_logprob"] == "torch"  # CPU, auto


def test_first_step_is_identical_off_and_on_within_contract(gsm8k_run):
    out, _ = gsm8k_run
    off, on = read_records(out / "off.jsonl")[0], read_records(out / "on.jsonl")[0]
    # the same samples: the same tokens, reward and rollout log-prob drift statistics
    assert off["tokens"] == on["tokens"] and off["response_tokens"] == on["response_tokens"]
    assert off["reward"] == on["reward"]
    check = json.loads((out / "first_step.json").read_text())
    assert check["samples_identical_across_runs"] is True  # CPU: the rollout forward is reproducible
    for name in ("old_logprob", "logprob", "entropy", "loss"):
        assert check[name]["within_contract"] is True, (name, check[name])
    # rollout (KV-cache decoding) and training (full forward) log-probs agree on CPU fp32
    assert off["logprob_diff_max"] < 1e-4 and on["logprob_diff_max"] < 1e-4


def test_report_numbers_match_the_logs(gsm8k_run):
    out, _ = gsm8k_run
    rows = {r["metric"]: r for r in json.loads((out / "comparison.json").read_text())["rows"]}
    for side in ("off", "on"):
        recs = read_records(out / f"{side}.jsonl")
        # timings leave out the first (warm-up) step, other series keep every step
        for key, values in (
            ("reward", [r["reward"] for r in recs]),
            ("region/step", [r["regions"]["step"] for r in recs[1:]]),
            ("tokens_per_s", [r["tokens_per_s"] for r in recs[1:]]),
        ):
            assert rows[key][side]["n"] == len(values)
            assert rows[key][side]["mean"] == pytest.approx(statistics.fmean(values), rel=1e-12)
    assert rows["region/step"]["on_over_off"] == pytest.approx(
        rows["region/step"]["on"]["mean"] / rows["region/step"]["off"]["mean"]
    )
    text = (out / "report.md").read_text()
    assert "## Per-module time" in text and "## First step, off vs on" in text and "![mean reward](reward.png)" in text
    assert "**Timing noise.**" in text and "| module | off min | off median | off max |" in text
    assert "## Known differences between the off and on paths" in text and "| reward of all 4 | off advantage" in text
    on = read_records(out / "on.jsonl")
    assert all(r["equal_reward_advantage_max"] == 0.0 for r in on)  # rl-kernel's are exactly 0
    assert {r["equal_reward_groups"] for r in on} <= set(range(5))
    assert "synthetic" not in text  # real GSM8K here


def test_synthetic_data_is_announced(tmp_path):
    proc = _run_recipe(tmp_path, "--data", "synthetic", "--sides", "on")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: synthetic GSM8K-format arithmetic" in proc.stdout
    assert len(read_records(tmp_path / "on.jsonl")) == STEPS


def test_no_data_source_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    with pytest.raises(data.DataUnavailableError, match="--data DIR.*GSM8K_DIR.*hub"):
        data.load_problems(None)  # `datasets` is not installed in this tier: the hub is unreachable
    with pytest.raises(data.DataUnavailableError, match="not a directory"):
        data.load_problems(str(tmp_path / "nope"))
    with pytest.raises(data.DataUnavailableError, match="neither train.jsonl nor"):
        data.load_problems(str(tmp_path))


def test_gsm8k_dir_and_synthetic_problems(monkeypatch):
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K}")
    monkeypatch.setenv("GSM8K_DIR", str(GSM8K))
    problems, where = data.load_problems(None, "test", limit=5)
    assert len(problems) == 5 and "GSM8K_DIR" in where
    assert all(scoring.compute_score(p.answer, p.ground_truth) == 1.0 for p in problems)
    for p in data.synthetic_problems(50, seed=1):
        assert scoring.compute_score(p.answer, p.ground_truth) == 1.0
        assert 0 <= int(p.ground_truth) <= 20


@pytest.mark.parametrize(
    "text,truth,method,expected",
    [
        ("so the answer is #### 72", "72", "strict", 1.0),
        ("#### 1,234", "1234", "strict", 1.0),
        ("#### 5 then #### 7", "7", "strict", 1.0),
        ("the answer is 72", "72", "strict", 0.0),
        ("the answer is 72", "72", "flexible", 1.0),
        ("we get 3 and then 5.", "72", "flexible", 0.1),
        ("no digits here .", "72", "flexible", 0.0),
        ("x" * 400 + "#### 9", "9", "strict", 1.0),
        ("#### 9" + "x" * 400, "9", "strict", 0.0),  # outside the last 300 characters
    ],
)
def test_scorer_follows_verl(text, truth, method, expected):
    assert scoring.compute_score(text, truth, method, format_score=0.1) == expected


def _diffs(out: Path, side: str) -> list[float]:
    return [r["logprob_diff_max"] for r in read_records(out / f"{side}.jsonl")]


def test_batch_invariant_rollout_and_training_logprobs_are_bitwise_equal(tmp_path):
    """--batch-invariant: each response token's rollout log-prob (KV-cache decode over the whole
    batch) equals its recomputation (one forward per micro-batch of 2) bit for bit, on both sides.
    Without it the on side's rollout (the sampler's log-softmax) and recomputation (linear_logprob)
    are different computations, and the difference shows."""
    small = (
        "--data",
        "synthetic",
        "--steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--micro-batch",
        "2",
        "--max-new-tokens",
        "6",
    )
    proc = _run_recipe(tmp_path / "bi", *small, "--batch-invariant")
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "bi" / "on.meta.json").read_text())
    assert meta["config"]["batch_invariant"] is True
    assert _diffs(tmp_path / "bi", "off") == [0.0] and _diffs(tmp_path / "bi", "on") == [0.0]
    proc = _run_recipe(tmp_path / "plain", *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _diffs(tmp_path / "plain", "on")[0] > 0.0
    print(f"without --batch-invariant: off {_diffs(tmp_path / 'plain', 'off')}, on {_diffs(tmp_path / 'plain', 'on')}")


def _main(*args: str, capsys) -> tuple[int, str]:
    """The recipe's main in this process: (exit status, stderr)."""
    import grpo_gsm8k

    try:
        code = grpo_gsm8k.main(list(args))
    except SystemExit as exc:  # argparse refusals
        assert isinstance(exc.code, int)
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, says",
    [
        (("--group-size", "0"), "argument --group-size: must be an integer >= 2, got 0"),
        (("--group-size", "1"), "argument --group-size: must be an integer >= 2, got 1"),
        (("--micro-batch", "0"), "argument --micro-batch: must be a positive integer, got 0"),
        (("--max-new-tokens", "0"), "argument --max-new-tokens: must be a positive integer, got 0"),
        (("--steps", "0"), "argument --steps: must be a positive integer, got 0"),
        (("--prompts-per-step", "-2"), "argument --prompts-per-step: must be a positive integer, got -2"),
        (("--max-prompt-tokens", "x"), "argument --max-prompt-tokens: must be a positive integer, got 'x'"),
        (("--temperature", "0"), "argument --temperature: must be a number in [1.17549e-38, 8.50706e+37], got '0'"),
        (("--temperature", "nan"), "argument --temperature: must be a number in [1.17549e-38, 8.50706e+37], got 'nan'"),
        (("--temperature", "-1"), "argument --temperature: must be a number in [1.17549e-38, 8.50706e+37], got '-1'"),
        (
            ("--temperature", "1e400"),
            "argument --temperature: must be a number in [1.17549e-38, 8.50706e+37], got '1e400'",
        ),
        (
            ("--temperature", "1e-40"),
            "argument --temperature: must be a number in [1.17549e-38, 8.50706e+37], got '1e-40'",
        ),
        (
            ("--temperature", "1e38"),
            "argument --temperature: must be a number in [1.17549e-38, 8.50706e+37], got '1e38'",
        ),
        (("--kl-coef", "-1"), "argument --kl-coef: must be a finite number >= 0, got '-1'"),
        (("--entropy-coef", "inf"), "argument --entropy-coef: must be a finite number >= 0, got 'inf'"),
        (("--lr", "0"), "argument --lr: must be a number in (0, 1], got '0'"),
        (("--lr", "1e300"), "argument --lr: must be a number in (0, 1], got '1e300'"),
        (("--lr", "1.5"), "argument --lr: must be a number in (0, 1], got '1.5'"),
        (("--format-score", "2"), "argument --format-score: must be a number in [0, 1], got '2'"),
        (("--limit", "0"), "argument --limit: must be a positive integer, got 0"),
        (("--seed", "-1"), "argument --seed: must be an integer in [0, 4294967295], got -1"),
        (("--device", "tpu"), "argument --device: must be cpu or cuda[:N], got 'tpu'"),
        (("--sides", "both"), "--sides must list off and/or on, got 'both'"),
        (("--sides", "on,on"), "--sides must list off and/or on, each once, got 'on,on'"),
        (("--sides", "off, on,off"), "--sides must list off and/or on, each once, got 'off,on,off'"),
    ],
)
def test_bad_options_are_one_line_errors(capsys, args, says):
    code, err = _main("--data", "synthetic", *args, capsys=capsys)
    assert code == 2 and says in err, err
    assert "Traceback" not in err


def test_bad_out_and_model_are_one_line_errors(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = _main("--data", "synthetic", "--out", str(blocker), capsys=capsys)
    assert code == 2 and f"--out must be a directory, got {str(blocker)!r}, which is a file" in err
    code, err = _main("--data", "synthetic", "--out", str(blocker / "run"), capsys=capsys)
    assert (
        code == 2
        and err.strip() == f"[grpo_gsm8k] error: --out {str(blocker / 'run')!r} cannot be created: Not a directory"
    )
    for model, says in ((tmp_path / "missing", "no such directory"), (blocker, "not a directory"), (tmp_path, "")):
        code, err = _main("--data", "synthetic", "--out", str(tmp_path / "run"), "--model", str(model), capsys=capsys)
        assert code == 2 and err.startswith(f"[grpo_gsm8k] error: --model {model}: {says}") and err.count("\n") == 1, (
            err
        )


def _gsm8k_line(question="Q?", answer="A. #### 7", **extra) -> str:
    return json.dumps({"question": question, "answer": answer, **extra})


@pytest.mark.parametrize(
    "content, says",
    [
        (_gsm8k_line() + "\n{not json\n", "train.jsonl:2: not valid JSON"),
        (
            _gsm8k_line() + "\n" + json.dumps({"question": "Q?"}) + "\n",
            "train.jsonl:2: 'answer' must be a string, got missing",
        ),
        (json.dumps({"question": 3, "answer": "#### 1"}) + "\n", "train.jsonl:1: 'question' must be a string, got int"),
        ("\n" + _gsm8k_line(answer="no final line") + "\n", "train.jsonl:2: GSM8K answer has no '#### <number>' line"),
        ("[1, 2]\n", "train.jsonl:1: expected a JSON object (a GSM8K row with 'question' and 'answer'), got list"),
        ("\n\n", "train.jsonl: holds no problems"),
    ],
)
def test_bad_data_rows_name_file_and_line(tmp_path, capsys, content, says):
    (tmp_path / "train.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(data.DataError, match="^" + re.escape(f"{tmp_path}/{says}")):
        data.load_problems(str(tmp_path))
    code, err = _main("--data", str(tmp_path), "--out", str(tmp_path / "run"), capsys=capsys)
    assert code == 2 and err.startswith(f"[grpo_gsm8k] error: {tmp_path}/{says}") and err.count("\n") == 1, err


def test_latin1_data_names_file_and_line(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(
        (_gsm8k_line() + '\n{"question": "Caf\u00e9?", "answer": "#### 7"}\n').encode("latin-1")
    )
    with pytest.raises(data.DataError, match=r"train.jsonl:2: not UTF-8 \(invalid continuation byte at byte 17\)"):
        data.load_problems(str(tmp_path))


def test_parquet_data_is_read_with_pyarrow(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is in requirements/core.txt")
    import pyarrow as pa

    rows = [{"question": f"Q{i}?", "answer": f"so #### {i}", "extra": i} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train-00000.parquet")
    problems, where = data.load_problems(str(tmp_path))
    assert [p.ground_truth for p in problems] == ["0", "1", "2"] and where == f"{tmp_path} (train)"
    pq.write_table(pa.Table.from_pylist([{"question": "Q?", "answer": "no number"}]), tmp_path / "train-00001.parquet")
    with pytest.raises(data.DataError, match=r"train-00001.parquet: row 0: GSM8K answer has no"):
        data.load_problems(str(tmp_path))
    pq.write_table(pa.Table.from_pylist([{"question": "Q?"}]), tmp_path / "train-00001.parquet")
    with pytest.raises(
        data.DataError, match=r"train-00001.parquet: not a parquet file with the columns 'question' and 'answer'"
    ):
        data.load_problems(str(tmp_path))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(
        data.DataUnavailableError, match=r"train-00000.parquet: reading parquet needs pyarrow \(pip install pyarrow\)"
    ):
        data.load_problems(str(tmp_path))


def test_known_differences_name_the_equal_reward_residue_with_its_size(tmp_path):
    import grpo_gsm8k
    from grpo import embedded

    assert grpo_gsm8k.equal_reward_residues(8, [0.0, 0.1, 1.0]) == [
        (0.0, 0.0, 0.0),
        (0.1, pytest.approx(0.0074, abs=1e-4), 0.0),
        (1.0, 0.0, 0.0),
    ]
    logs = {}
    for side, residue in (("off", 0.0073917), ("on", 0.0)):
        logs[side] = tmp_path / f"{side}.jsonl"
        logs[side].write_text(
            "".join(
                json.dumps(
                    {
                        "step": i,
                        "regions": {"step": 1.0},
                        "equal_reward_groups": i,
                        "equal_reward_advantage_max": residue if i >= 2 else 0.0,
                    }
                )
                + "\n"
                for i in range(4)
            )
        )
    cfg = embedded.GRPOConfig(group_size=8, format_score=0.1)
    text = grpo_gsm8k.known_differences("embedded", cfg, logs["off"], logs["on"])
    assert "| 0.1 | 0.00739 | 0 |" in text
    assert (
        "off: 6 such groups over 4 steps, largest |advantage| 0.00739, first nonzero at step 2; "
        "on: 6 such groups over 4 steps, largest |advantage| 0."
    ) in text
    verl = grpo_gsm8k.known_differences("verl", cfg, logs["off"], logs["on"])
    assert "same float residue in both runs" in verl and "| 0.1 | 0.00739 | 0 |" in verl


def test_numeric_options_property(seed):
    """Property: random numbers over the whole float range (and beyond it, NaN, infinities) for
    --temperature and --lr are accepted exactly when inside the documented range, and a refusal is
    argparse's one line (exit 2), never a traceback later in the run."""
    import argparse
    import math
    import random

    from grpo import runs

    rng = random.Random(seed)
    parse = {name: kind for name, kind, _ in runs.OVERRIDES}
    ranges = {"temperature": (2.0**-126, 2.0**126, False), "lr": (0.0, 1.0, True)}
    for _ in range(400):
        name = rng.choice(sorted(ranges))
        text = rng.choice(
            [
                f"{rng.choice('+-')}{rng.random():.3f}e{rng.randint(-400, 400)}",
                f"{rng.uniform(-2, 2):.6g}",
                "nan",
                "inf",
                "-inf",
                f"1e{rng.randint(-330, 330)}",
                "0",
                "1",
                "2.0",
                "x",
            ]
        )
        low, high, low_open = ranges[name]
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
        try:
            got = parse[name](text)
        except argparse.ArgumentTypeError as exc:
            assert not inside, (name, text, f"seed={seed}")
            assert str(exc).startswith("must be a number in ") and text in str(exc), (str(exc), f"seed={seed}")
        else:
            assert inside and got == value, (name, text, f"seed={seed}")


def test_verl_engine_without_pandas_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """``--engine verl`` in a Python without pandas went through the data and model, then failed
    writing the parquet files with a ModuleNotFoundError; it is refused up front, naming what is
    missing, and ``auto`` does not pick verl there."""
    import grpo_gsm8k
    import torch

    monkeypatch.setitem(sys.modules, "pandas", None)  # importlib finds no spec for it: not importable
    code, err = _main("--engine", "verl", "--data", "synthetic", "--out", str(tmp_path / "run"), capsys=capsys)
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("[grpo_gsm8k] error: --engine verl needs verl, vllm, pandas, pyarrow in this Python (")
    assert "missing: " in err and "pandas" in err.split("missing: ")[1], err
    engine, why = grpo_gsm8k.resolve_engine("auto", torch.device("cuda"))
    assert engine == "embedded" and "pandas" in why, why


def test_progress_is_plain_lines_when_not_a_terminal():
    """On a stream that is not a terminal (a log file) the progress is a plain line about every
    tenth of the run, never tqdm's carriage-return frames (one 30 KB line per run in a log)."""
    import io

    from grpo.embedded import StepProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for total, expected in ((25, [1, 3, 6, 9, 12, 15, 18, 21, 24, 25]), (3, [1, 2, 3]), (1, [1])):
        log = io.StringIO()
        bar = StepProgress("GRPO [off]", total, True, log)
        for k in range(total):
            bar.step(reward=f"{k / 10:.3f}", step_ms=f"{100 + k}")
        bar.close()
        lines = log.getvalue().splitlines()
        assert "\r" not in log.getvalue()
        assert [int(line.split(" step ")[1].split("/")[0]) for line in lines] == expected, lines
        assert lines[0] == f"GRPO [off] step 1/{total}: reward 0.000, step_ms 100"
    quiet = io.StringIO()
    bar = StepProgress("GRPO [on]", 5, False, quiet)
    bar.step(reward="1.000")
    bar.close()
    assert quiet.getvalue() == ""
    term = Terminal()
    bar = StepProgress("GRPO [on]", 5, True, term)
    for _ in range(5):
        bar.step(reward="1.000")
    bar.close()
    assert "\r" in term.getvalue() and "GRPO [on] step" not in term.getvalue()  # tqdm's bar on a terminal


def test_recipe_progress_in_a_log_file_is_plain_lines(tmp_path):
    args = [*SMALL_RUN, "--out", str(tmp_path), "--data", "synthetic", "--sides", "off"]
    proc = run_recipe_script("grpo_gsm8k.sh", args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr
    assert [line.split(":")[0] for line in proc.stderr.splitlines() if line.startswith("GRPO [")] == [
        "GRPO [off] step 1/2",
        "GRPO [off] step 2/2",
    ], proc.stderr[-2000:]
