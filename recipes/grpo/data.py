"""GSM8K problems for the recipe: from a directory, ``$GSM8K_DIR``, the hub, or generated.

A problem is a question, its worked solution and the ground-truth number that follows ``####``.
Prompts are built as verl's GSM8K preprocessing builds them: the question, a space, and
:data:`INSTRUCTION`.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

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


def ground_truth_of(answer: str) -> str:
    """The number after ``#### `` in a GSM8K solution, commas removed (verl's extraction)."""
    match = _ANSWER.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def _from_rows(rows) -> list[Problem]:
    return [Problem(r["question"], r["answer"], ground_truth_of(r["answer"])) for r in rows]


def _read_dir(directory: Path, split: str) -> list[Problem]:
    jsonl = directory / f"{split}.jsonl"
    if jsonl.is_file():
        with open(jsonl, encoding="utf-8") as f:
            return _from_rows(json.loads(line) for line in f if line.strip())
    parquets = sorted(directory.rglob(f"{split}*.parquet"))
    if parquets:
        import pandas as pd

        frame = pd.concat([pd.read_parquet(p, columns=["question", "answer"]) for p in parquets])
        return _from_rows(frame.to_dict("records"))
    raise DataUnavailableError(
        f"data directory {directory} holds neither {split}.jsonl nor {split}*.parquet "
        "(GSM8K rows with 'question' and 'answer')")


def _read_hub(split: str) -> list[Problem]:
    import datasets  # optional: only this source needs it

    return _from_rows(datasets.load_dataset(HUB_DATASET, "main", split=split))


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


def load_problems(source: Optional[str], split: str = "train", limit: Optional[int] = None,
                  seed: int = 0) -> tuple[list[Problem], str]:
    """GSM8K problems and a description of where they came from.

    ``source``: a directory (``{split}.jsonl`` or ``{split}*.parquet``), ``"synthetic"``, or
    None, which tries ``$GSM8K_DIR`` and then the hub (``datasets``, ``openai/gsm8k``). When
    nothing is reachable, :class:`DataUnavailableError` names the three ways to provide data.
    ``limit`` keeps the first ``limit`` problems.
    """
    if source == SYNTHETIC:
        problems = synthetic_problems(limit or 1000, seed)
        return problems, f"synthetic GSM8K-format arithmetic ({len(problems)} generated problems, seed {seed})"
    if source is not None:
        directory = Path(source)
        if not directory.is_dir():
            raise DataUnavailableError(f"--data {source}: not a directory (expected GSM8K {split}.jsonl or parquet files, or 'synthetic')")
        problems, where = _read_dir(directory, split), f"{directory} ({split})"
    elif os.environ.get("GSM8K_DIR"):
        directory = Path(os.environ["GSM8K_DIR"])
        if not directory.is_dir():
            raise DataUnavailableError(f"GSM8K_DIR={directory}: not a directory")
        problems, where = _read_dir(directory, split), f"$GSM8K_DIR={directory} ({split})"
    else:
        try:
            problems, where = _read_hub(split), f"hub {HUB_DATASET} ({split})"
        except Exception as exc:  # any failure to reach the hub ends in the same advice
            raise DataUnavailableError(
                "no GSM8K data: pass --data DIR (train.jsonl/test.jsonl or parquet), set GSM8K_DIR, "
                f"or make the hub reachable for `datasets` ({HUB_DATASET}; it failed: "
                f"{type(exc).__name__}: {str(exc)[:200]}); or run with --data synthetic") from None
    return (problems[:limit] if limit else problems), where
