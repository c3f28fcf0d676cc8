"""recipes/grpo_vision.sh end to end on the tiny preset (CPU), its parity stop, data and options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

from grpo import vision_data  # noqa: E402
from recipe_runs import RUN_FILES, assert_written, read_records, run_recipe_script  # noqa: E402

STEPS = 2


def _run_recipe(out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["--data", "synthetic", "--steps", str(STEPS), "--prompts-per-step", "2", "--group-size", "4"]
    args += ["--problems", "64", "--out", str(out), "--no-progress"]
    return run_recipe_script("grpo_vision.sh", [*args, *extra], timeout=1200)


def test_recipe_runs_off_and_on_with_report_and_bitwise_rollout_logprobs(tmp_path):
    proc = _run_recipe(tmp_path, "--batch-invariant")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_written(tmp_path, [*RUN_FILES, "first_step.json", "logprob_diff.png"])
    assert proc.stdout.count("processor-layout parity of the first batch: no mismatch") == 2, proc.stdout
    off, on = read_records(tmp_path / "off.jsonl"), read_records(tmp_path / "on.jsonl")
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(STEPS))
    for rec in off + on:
        assert set(rec["regions"]) >= {"rollout", "old_logprob", "logprob", "backward", "update", "step"}
        assert 0.0 <= rec["reward"] <= 1.0
        # batch-invariant mode: a KV-cache rollout of the VLM and the training forward agree bit for bit
        assert rec["logprob_diff_max"] == 0.0, rec
    check = json.loads((tmp_path / "first_step.json").read_text())
    assert check["samples_identical_across_runs"] is True
    for name in ("old_logprob", "logprob", "entropy", "loss"):
        assert check[name]["within_contract"] is True, (name, check[name])
    meta = json.loads((tmp_path / "on.meta.json").read_text())
    assert meta["config"]["batch_invariant"] is True and meta["parity"].startswith("first batch checked")
    assert "processor-layout parity" in (tmp_path / "report.md").read_text()


def test_a_processor_mismatch_stops_the_recipe_before_training(tmp_path):
    """The trainer's image processor gets a smaller resolution budget: its prompts carry 4 image
    tokens per image where the rollout's carry 16. The parity check names the span and the counts,
    and no step is recorded."""
    proc = _run_recipe(tmp_path, "--training-max-pixels", "256")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert error == [
        "[grpo_vision] error: off run stopped before training: processor-layout parity failed on the first batch, "
        "rollout vs training: modality_spans[0] image 0: rollout image at 7, 16 tokens vs training image at 7, "
        "4 tokens (16 vs 4 image tokens)"
    ], proc.stderr[-2000:]
    assert not (tmp_path / "off.jsonl").exists() or read_records(tmp_path / "off.jsonl") == []
    assert not (tmp_path / "on.jsonl").exists() and not (tmp_path / "report.md").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--tasks", "count,shapes"],
            "--tasks: expected a comma-separated subset of count,digits,colour, got 'count,shapes'",
        ),
        (["--problems", "0"], "--problems"),
        (["--problems", "1000000000"], "argument --problems: must be an integer in [1, 100000], got 1000000000"),
        (["--problems", "100001"], "argument --problems: must be an integer in [1, 100000], got 100001"),
        (["--sides", "off,off"], "--sides must list off and/or on, each once, got 'off,off'"),
        (["--training-max-pixels", "-5"], "--training-max-pixels"),
        (["--data", "gsm8k"], "--data: invalid choice: 'gsm8k'"),
        (["--sides", "both"], "--sides must list off and/or on, got 'both'"),
        (["--max-prompt-tokens", "8"], "unrecognized arguments: --max-prompt-tokens 8"),
    ],
)
def test_bad_options_fail_up_front_with_one_line(capsys, args, message):
    import grpo_vision

    with pytest.raises(SystemExit) as exc:
        grpo_vision.parse_args(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err


def test_synthetic_problems_are_deterministic_and_answerable():
    a = vision_data.synthetic_problems(30, seed=3)
    b = vision_data.synthetic_problems(30, seed=3)
    c = vision_data.synthetic_problems(30, seed=4)
    assert [p.task for p in a] == list(vision_data.TASKS) * 10
    assert all(np.array_equal(x.image, y.image) and x.ground_truth == y.ground_truth for x, y in zip(a, b))
    assert any(not np.array_equal(x.image, y.image) for x, y in zip(a, c))
    for p in a:
        assert p.image.shape == (vision_data.IMAGE_SIZE, vision_data.IMAGE_SIZE, 3) and p.image.dtype == np.uint8
        lit = (p.image != np.array(vision_data._BACKGROUND, dtype=np.uint8)).any(-1)
        if p.task == "count":  # each square is a 6x6 block of one colour
            assert lit.sum() == 36 * int(p.ground_truth)
        elif p.task == "colour":
            assert (p.image[lit] == np.array(vision_data.COLOURS[p.ground_truth], dtype=np.uint8)).all()
        else:
            assert len(p.ground_truth) == 2 and p.ground_truth.isdigit() and lit.any()


def test_score_reads_the_first_word():
    colour, digits = (
        vision_data.VisualProblem(task, np.full((1, 1, 3), 7, np.uint8), "?", answer)
        for task, answer in (("colour", "blue"), ("digits", "47"))
    )
    assert vision_data.score(" Blue, I think", colour) == 1.0
    assert vision_data.score("red", colour, format_score=0.25) == 0.25
    assert vision_data.score("47 blue", colour) == 0.0
    assert vision_data.score("47.", digits) == 1.0
    assert vision_data.score("12", digits) == 0.1
    assert vision_data.score("it is 47", digits) == 0.0
    assert vision_data.score("", digits) == 0.0


def test_synthetic_problems_reject_bad_arguments():
    with pytest.raises(ValueError, match="count must be an int >= 1, got 0"):
        vision_data.synthetic_problems(0)
    with pytest.raises(
        ValueError, match="count must be at most 100000 \\(every problem is drawn up front\\), got 1000000000"
    ):
        vision_data.synthetic_problems(10**9)  # refused at once, before drawing (a billion took hours)
    with pytest.raises(ValueError, match="tasks must be a non-empty subset of count, digits, colour, got shapes"):
        vision_data.synthetic_problems(3, ("shapes",))
