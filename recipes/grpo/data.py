"""GSM8K problems for the recipe: from a directory, ``$GSM8K_DIR``, the hub, or generated.

A problem is a question, its worked solution and the ground-truth number that follows ``####``.
Prompts are built as verl's GSM8K preprocessing builds them: the question, a space, and
:data:`INSTRUCTION`.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rl_kernel_core.tools.report import json_object_line

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SYNTHETIC = "synthetic"
HUB_DATASET = "openai/gsm8k"

_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


@dataclass(frozen=True)
class Problem:
    """One GSM8K item: ``question``, the worked ``answer`` text, and its ``ground_truth`` number."""

    question: str
    answer: str
    ground_truth: str

    @property
    def prompt(self) -> str:
        """The user turn the policy sees (verl's preprocessing: question + instruction)."""
        return f"{self.question} {INSTRUCTION}"


class DataUnavailableError(RuntimeError):
    """No GSM8K source could be read; the message names every source tried."""


class DataError(ValueError):
    """A GSM8K file or row that is not a problem; the message names the file and line (or row)."""


def ground_truth_of(answer: str) -> str:
    """The number after ``#### `` in a GSM8K solution, commas removed (verl's extraction)."""
    match = _ANSWER.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def _problem(row: dict, where: str) -> Problem:
    """The problem in ``row`` (with the strings ``question`` and ``answer``), or a
    :class:`DataError` naming ``where``."""
    for name in ("question", "answer"):
        if not isinstance(row.get(name), str):
            found = "missing" if row.get(name) is None else type(row[name]).__name__
            raise DataError(f"{where}: '{name}' must be a string, got {found}")
    try:
        return Problem(row["question"], row["answer"], ground_truth_of(row["answer"]))
    except ValueError as exc:
        raise DataError(f"{where}: {exc}") from None


def _read_jsonl(path: Path) -> list[Problem]:
    problems = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            row = json_object_line(raw, where, "a GSM8K row with 'question' and 'answer'", DataError)
            if row is not None:
                problems.append(_problem(row, where))
    return problems


def _read_parquet(path: Path) -> list[Problem]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataUnavailableError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow), or give the data as train.jsonl/test.jsonl"
        ) from None
    try:
        rows = pq.read_table(path, columns=["question", "answer"]).to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid, KeyError, OSError, ... for a file it cannot read
        raise DataError(
            f"{path}: not a parquet file with the columns 'question' and 'answer' "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    return [_problem(row, f"{path}: row {i}") for i, row in enumerate(rows)]


def _read_dir(directory: Path, split: str) -> list[Problem]:
    jsonl = directory / f"{split}.jsonl"
    if jsonl.is_file():
        files, problems = [jsonl], _read_jsonl(jsonl)
    else:
        files = sorted(directory.rglob(f"{split}*.parquet"))
        problems = [p for path in files for p in _read_parquet(path)]
    if not files:
        raise DataUnavailableError(
            f"data directory {directory} holds neither {split}.jsonl nor {split}*.parquet "
            "(GSM8K rows with 'question' and 'answer')"
        )
    if not problems:
        raise DataError(f"{', '.join(map(str, files))}: holds no problems")
    return problems


def _read_hub(split: str) -> list[Problem]:
    import datasets  # optional: only this source needs it

    rows = datasets.load_dataset(HUB_DATASET, "main", split=split)
    return [_problem(row, f"hub {HUB_DATASET} ({split}) row {i}") for i, row in enumerate(rows)]


_NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
_ITEMS = ("apples", "pencils", "stickers", "coins", "books", "marbles", "cards", "shells")


def synthetic_problems(count: int, seed: int = 0) -> list[Problem]:
    """``count`` generated GSM8K-format word problems (one addition or subtraction, answer 0..20).

    Same format as GSM8K (calculator annotation, ``#### <n>`` line), so the same scorer applies;
    small answers let a randomly initialised model find reward within a short CPU run.
    """
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        if rng.random() < 0.5:
            question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
            result, expr = a + b, f"{a}+{b}"
        else:
            a, b = max(a, b), min(a, b)
            question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
            result, expr = a - b, f"{a}-{b}"
        answer = f"{name} has {expr} = <<{expr}={result}>>{result} {item}.\n#### {result}"
        problems.append(Problem(question, answer, str(result)))
    return problems


def load_problems(
    source: Optional[str], split: str = "train", limit: Optional[int] = None, seed: int = 0
) -> tuple[list[Problem], str]:
    """GSM8K problems and a description of where they came from.

    ``source``: a directory (``{split}.jsonl``, UTF-8, or ``{split}*.parquet``, read with
    pyarrow), ``"synthetic"``, or None, which tries ``$GSM8K_DIR`` and then the hub
    (``datasets``, ``openai/gsm8k``). When nothing is reachable, :class:`DataUnavailableError`
    names the three ways to provide data; a line or row that is not a GSM8K problem (not UTF-8,
    not JSON, no string ``question``/``answer``, no ``#### <number>`` in the answer) raises
    :class:`DataError` naming the file and line (or row). ``limit`` keeps the first ``limit``
    problems.
    """
    if source == SYNTHETIC:
        problems = synthetic_problems(limit or 1000, seed)
        return problems, f"synthetic GSM8K-format arithmetic ({len(problems)} generated problems, seed {seed})"
    if source is not None:
        directory = Path(source)
        if not directory.is_dir():
            raise DataUnavailableError(
                f"--data {source}: not a directory (expected GSM8K {split}.jsonl or parquet files, or 'synthetic')"
            )
        problems, where = _read_dir(directory, split), f"{directory} ({split})"
    elif os.environ.get("GSM8K_DIR"):
        directory = Path(os.environ["GSM8K_DIR"])
        if not directory.is_dir():
            raise DataUnavailableError(f"GSM8K_DIR={directory}: not a directory")
        problems, where = _read_dir(directory, split), f"$GSM8K_DIR={directory} ({split})"
    else:
        try:
            problems, where = _read_hub(split), f"hub {HUB_DATASET} ({split})"
        except DataError:
            raise
        except Exception as exc:  # any failure to reach the hub ends in the same advice
            raise DataUnavailableError(
                "no GSM8K data: pass --data DIR (train.jsonl/test.jsonl or parquet), set GSM8K_DIR, "
                f"or make the hub reachable for `datasets` ({HUB_DATASET}; it failed: "
                f"{type(exc).__name__}: {str(exc)[:200]}); or run with --data synthetic"
            ) from None
    return (problems[:limit] if limit else problems), where
