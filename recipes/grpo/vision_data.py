"""Generated image problems with verifiable answers, for the vision recipe.

Three tasks, each a small RGB image (drawn with numpy, bitwise the same for the same seed on any
machine) and a question whose answer is one word:

* ``count``: 1 to 4 filled squares on a dark background; the answer is their number ("3");
* ``digits``: a two-digit string drawn in a 3x5 bitmap font; the answer is the string ("47");
* ``colour``: one large filled square; the answer is its colour's name ("blue").

A response is scored by its first word (lowercased, punctuation stripped): 1 when it is the answer,
``format_score`` when it is an answer of the task's kind but not this one (a number for ``count``
and ``digits``, a colour name for ``colour``), else 0; as GSM8K's format score, it gives a
random policy a signal before it finds right answers.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

TASKS = ("count", "digits", "colour")
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 230), "yellow": (230, 210, 40)}
QUESTIONS = {
    "count": "How many squares are in the image?",
    "digits": "What number is written in the image?",
    "colour": "What colour is the square?",
}
IMAGE_SIZE = 32
_BACKGROUND = (24, 24, 24)
# 3 columns x 5 rows per digit, row-major, "#" lit
_FONT = {
    "0": "####.##.##.####",
    "1": ".#.##..#..#.###",
    "2": "###..#####..###",
    "3": "###..####..####",
    "4": "#.##.####..#..#",
    "5": "####..###..####",
    "6": "####..####.####",
    "7": "###..#.#..#..#.",
    "8": "####.#####.####",
    "9": "####.####..####",
}
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class VisualProblem:
    """One generated problem: ``task`` (one of :data:`TASKS`), ``image`` ``[H, W, 3]`` uint8,
    the ``question`` text and the one-word ``ground_truth``."""

    task: str
    image: np.ndarray
    question: str
    ground_truth: str

    @property
    def prompt(self) -> str:
        return self.question


def _canvas() -> np.ndarray:
    return np.full((IMAGE_SIZE, IMAGE_SIZE, 3), _BACKGROUND, dtype=np.uint8)


def _count(rng: random.Random) -> tuple[np.ndarray, str]:
    img, n = _canvas(), rng.randint(1, 4)
    cells = rng.sample(range(16), n)  # a 4x4 grid of 8-pixel cells, one square per chosen cell
    colour = COLOURS[rng.choice(sorted(COLOURS))]
    for cell in cells:
        y, x = 8 * (cell // 4) + 1, 8 * (cell % 4) + 1
        img[y : y + 6, x : x + 6] = colour
    return img, str(n)


def _digits(rng: random.Random) -> tuple[np.ndarray, str]:
    img, text = _canvas(), f"{rng.randint(10, 99)}"
    for i, ch in enumerate(text):
        glyph = np.array([c == "#" for c in _FONT[ch]]).reshape(5, 3)
        scaled = glyph.repeat(3, 0).repeat(3, 1)  # 15 x 9 pixels
        y, x = 8, 5 + 12 * i
        img[y : y + 15, x : x + 9][scaled] = (235, 235, 235)
    return img, text


def _colour(rng: random.Random) -> tuple[np.ndarray, str]:
    img, name = _canvas(), rng.choice(sorted(COLOURS))
    y, x = rng.randint(2, 10), rng.randint(2, 10)
    img[y : y + 20, x : x + 20] = COLOURS[name]
    return img, name


_DRAW = {"count": _count, "digits": _digits, "colour": _colour}

MAX_PROBLEMS = 100_000
"""The most problems :func:`synthetic_problems` draws: every one is drawn up front (about 40 us and
3 KB of image each on a 2-core CPU), so 100,000 take seconds and about 300 MB, where a billion took
hours and more memory than a machine has before the first step."""


def synthetic_problems(count: int, tasks: tuple[str, ...] = TASKS, seed: int = 0) -> list[VisualProblem]:
    """``count`` problems (1 to :data:`MAX_PROBLEMS`) cycling through ``tasks``, drawn from ``seed``
    (the same list every time)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    if count > MAX_PROBLEMS:
        raise ValueError(f"count must be at most {MAX_PROBLEMS} (every problem is drawn up front), got {count}")
    unknown = [t for t in tasks if t not in _DRAW]
    if not tasks or unknown:
        raise ValueError(f"tasks must be a non-empty subset of {', '.join(TASKS)}, got {', '.join(tasks) or 'none'}")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        task = tasks[i % len(tasks)]
        image, answer = _DRAW[task](rng)
        out.append(VisualProblem(task, image, QUESTIONS[task], answer))
    return out


def score(text: str, problem: VisualProblem, format_score: float = 0.1) -> float:
    """The reward of response ``text`` to ``problem`` (see the module docstring)."""
    words = _WORD.findall(text.lower())
    if not words:
        return 0.0
    if words[0] == problem.ground_truth:
        return 1.0
    kind = words[0] in COLOURS if problem.task == "colour" else words[0].isdigit()
    return format_score if kind else 0.0


def vocabulary_texts() -> list[str]:
    """The texts the local model's tokenizer is trained on: every question and every possible
    answer (the same for any problem set, so one model serves every seed and size)."""
    return list(QUESTIONS.values()) + sorted(COLOURS) + [str(n) for n in range(100)]
