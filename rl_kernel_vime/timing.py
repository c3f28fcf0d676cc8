"""Per-module timings through :mod:`rl_kernel_core.profiling`, closed once per training step.

Every hook body runs in a profiling region named after its module: ``logprob`` (training
forward), ``old_logprob`` (log-probs computed without grad: the old- and reference-policy
passes), ``ratio_kl`` and ``loss``; the step hook wraps vime's ``train_one_step`` in ``step``.
On GPU a region records two CUDA events and nothing else; :func:`close_step` resolves them once
per step (one synchronisation) and returns ``{"perf/rl_kernel/<region>_ms": ms}``.

Timing is on only while the step hook is live (:func:`enable` is called when vime's
``train_one_step`` is patched): without a step boundary, regions would accumulate forever.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rl_kernel_core import profiling

METRIC_PREFIX = "perf/rl_kernel/"


def enable(path: Optional[str]) -> None:
    """Start timing (step records appended to ``path`` when given), unless already on; CUDA's peak
    counter is left to vime (``memory=False``, see :func:`rl_kernel_core.profiling.enable`)."""
    if not profiling.is_enabled():
        profiling.enable(path, memory=False)


def region(name: str, device: torch.device):
    """A profiling region ``name`` for work on ``device`` (a no-op when timing is off)."""
    return profiling.region(name, device)


def logprob_region() -> str:
    """``logprob`` under autograd (training), ``old_logprob`` without (old/ref passes)."""
    return "logprob" if torch.is_grad_enabled() else "old_logprob"


def close_step(**fields: Any) -> dict[str, float]:
    """End the step: write its JSONL record and return its region times as step metrics."""
    record = profiling.step_end(**fields)
    if record is None:
        return {}
    return {f"{METRIC_PREFIX}{name}_ms": ms for name, ms in record["regions"].items()}
