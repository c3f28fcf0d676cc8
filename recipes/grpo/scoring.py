"""GSM8K reward, scored as verl's GSM8K scorer (``verl.utils.reward_score.gsm8k``) scores it.

``strict`` reads the number after the last ``#### `` in the final 300 characters; ``flexible``
takes the last number in the text. A match of the ground truth scores ``score``, any other
extracted answer ``format_score``, no answer 0.
"""

from __future__ import annotations

import re
from typing import Optional

_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(text: str, method: str = "strict") -> Optional[str]:
    """The answer ``text`` commits to under ``method`` ("strict" or "flexible"), or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = text[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def compute_score(
    text: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` for the right answer, ``format_score`` for another extracted one, else 0."""
    answer = extract_solution(text, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def verl_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info=None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """:func:`compute_score` with the signature of verl's ``custom_reward_function``.

    verl loads it by file path (``reward.custom_reward_function.path``/``name``) and passes
    ``method`` and ``format_score`` from ``reward_kwargs``, so the verl engine scores as the
    embedded one does. ``data_source`` and ``extra_info`` are verl's row fields, unused here.
    """
    return compute_score(solution_str, ground_truth, method, format_score, score)
