"""Running a GRPO recipe from the tests in a subprocess, and checking and reading what it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]

SMALL_RUN = (
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "4",
)
"""The tiny preset's smallest run: 2 steps of 2 prompts x 2 responses of at most 4 tokens."""

RUN_FILES = (
    "off.jsonl",
    "on.jsonl",
    "off.meta.json",
    "on.meta.json",
    "report.md",
    "comparison.json",
    "step_time.png",
    "reward.png",
)
"""What every off-and-on run of a recipe writes, whatever its engine."""


def run_recipe_script(script: str, args: Sequence[str], timeout: int) -> subprocess.CompletedProcess:
    """``bash recipes/<script> <args>`` in the checkout, output captured as text. The interpreter
    running the tests comes first on ``PATH``: it is the recipe's python3, so the recipe never builds
    another."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    cmd = ["bash", str(ROOT / "recipes" / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def read_records(path: Path) -> list[dict]:
    """The step records of a recipe's ``off.jsonl``/``on.jsonl``, one dict a line."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_written(out: Path, names: Sequence[str]) -> None:
    """Each of ``names`` is a non-empty file in ``out``."""
    for name in names:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
