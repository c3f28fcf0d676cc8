"""argparse types shared by the command lines (``rl-kernel``, ``python -m rl_kernel_vllm.*``, the
native build, the recipes): each parses one option's text or raises ``argparse.ArgumentTypeError``
naming the expected value and the one given. Imports nothing of rl-kernel."""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable, Optional

import torch


def integer(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (no upper bound when ``high`` is None);
    the recipe's options use it too."""
    what = (
        f"an integer in [{low}, {high}]"
        if high is not None
        else {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def number(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``);
    the recipe's options use it."""
    what = (
        f"a finite number {'>' if low_open else '>='} {low:g}"
        if high == math.inf
        else f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    )

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (``--engine-args``; ``rl_kernel_vllm.consistency``'s ``--engine``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def device_name(text: str) -> str:
    """An argparse type for ``--device``: ``cpu`` or ``cuda[:N]`` that this process can use (the
    recipe's ``--device`` uses it too)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text} needs CUDA, and torch.cuda.is_available() is False")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text} names a GPU this process does not see ({torch.cuda.device_count()} visible)"
        )
    return text
