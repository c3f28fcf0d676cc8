"""Timed regions and per-step records shared by every adapter.

Usage::

    from rl_kernel_core import profiling
    profiling.enable("steps.jsonl")          # or RL_KERNEL_PROFILE=steps.jsonl
    with profiling.region("logprob"):
        ...
    record = profiling.step_end(tokens=n_tokens, reward=mean_reward)

On GPU a region records two CUDA events and nothing else; the events are resolved in
:func:`step_end`, so there is one synchronisation per step, not one per region. On CPU a region
reads the wall clock. A region entered several times in a step accumulates. When profiling is
off, :func:`region` returns one shared no-op context manager: no allocation, no clock read.

Each step record holds ``step``, ``regions`` (name -> ms), ``tokens``, ``tokens_per_s`` (tokens
over the ``step`` region, or over the wall time since the previous step_end when there is no
``step`` region), ``peak_vram_gib`` (CUDA only, reset each step; only where profiling owns
CUDA's peak-memory counter, see :func:`enable`), ``routes`` (op -> what ran at its last call in
this process, :attr:`rl_kernel_core.dispatch.Decision.route`; absent before any op ran) and every
extra field the caller passes (``reward``, ``logprob_diff``, ...). ``rl-kernel compare`` (:mod:`rl_kernel_core.tools.report`) reads
these files.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Iterable, Iterator, Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.switches import env_flag_or_path

PROFILE_ENV = "RL_KERNEL_PROFILE"

REGION_NAMES: tuple[str, ...] = (
    "rollout",
    "old_logprob",
    "ref_logprob",
    "logprob",
    "ratio_kl",
    "loss",
    "backward",
    "update",
    "weight_sync",
    "step",
)

_NULL = contextlib.nullcontext()


class _State:
    def __init__(self) -> None:
        self.enabled = False
        self.memory = True
        self.path: Optional[str] = None
        self.step = 0
        self.cpu_ms: dict[str, float] = {}
        self.cuda_events: list[tuple[str, Any, Any]] = []
        self.last_step_time = time.perf_counter()


_state = _State()


def _check_writable(path: str, name: str) -> None:
    """Fail now, not at the first ``step_end``: ``path`` must be a file that can be appended to."""
    if os.path.isdir(path):
        raise ValueError(
            f"{name} must be a JSONL file path to append step records to, got {path!r}, which is a directory"
        )
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ValueError(f"{name} must be a writable JSONL file path, got {path!r}: {exc.strerror or exc}") from exc


def enable(path: Optional[str] = None, *, memory: bool = True) -> None:
    """Turn profiling on; step records are appended to ``path`` (JSONL) when given.

    ``memory``: profiling owns CUDA's process-wide peak-memory counter: reset now and at each
    :func:`step_end`, which records the step's peak as ``peak_vram_gib``. An adapter inside a
    framework's process passes False: the framework reads that counter itself (verl's
    ``perf/max_memory_allocated_gb``, vLLM's memory profiling, a benchmark's peak), and a reset
    would hide its peak.

    Raises:
        ValueError: ``path`` is a directory or cannot be opened for appending (checked now,
            creating the file when absent, so a bad path fails before training starts).
    """
    _enable(path, "path", memory)


def _enable(path: Optional[str], name: str, memory: bool) -> None:
    if path is not None:
        _check_writable(path, name)
    _state.enabled = True
    _state.memory = memory
    _state.path = path
    _state.step = 0
    _state.cpu_ms.clear()
    _state.cuda_events.clear()
    _state.last_step_time = time.perf_counter()
    if memory and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def disable() -> None:
    """Turn profiling off and drop unfinished regions."""
    _state.enabled = False
    _state.cpu_ms.clear()
    _state.cuda_events.clear()


def is_enabled() -> bool:
    """Whether regions are being timed."""
    return _state.enabled


def enable_from_env(*, memory: bool = True) -> bool:
    """Enable from ``RL_KERNEL_PROFILE`` unless already on; return whether profiling is on.
    ``memory`` as :func:`enable`.

    The value is read with :func:`rl_kernel_core.switches.env_flag_or_path`: unset, empty or an
    off spelling (``0``, ``false``, ``no``, ``off``) leaves profiling as it is; an on spelling
    (``1``, ``true``, ``yes``, ``on``) turns it on without a file; anything else is the JSONL
    path, checked now (see :func:`enable`; the error names the variable).
    """
    value = env_flag_or_path(PROFILE_ENV)
    if value is not False and not _state.enabled:
        _enable(None if value is True else value, PROFILE_ENV, memory)
    return _state.enabled


@contextlib.contextmanager
def _timed(name: str, device: Optional[torch.device]) -> Iterator[None]:
    if device is not None and device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            _state.cuda_events.append((name, start, end))
    else:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _state.cpu_ms[name] = _state.cpu_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3


def region(name: str, device: Optional[torch.device | str] = None):
    """Context manager timing ``name`` in the current step.

    ``device``: where the work runs; CUDA events are used when it is a CUDA device (default: the
    current CUDA device when CUDA is available, else the wall clock).
    """
    if not _state.enabled:
        return _NULL
    if device is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else None
    else:
        dev = torch.device(device)
    return _timed(name, dev)


def step_end(**fields: Any) -> Optional[dict[str, Any]]:
    """Close the step: resolve its regions, write one JSONL record, return it (None when off)."""
    if not _state.enabled:
        return None
    regions = dict(_state.cpu_ms)
    if _state.cuda_events:
        _state.cuda_events[-1][2].synchronize()
        for name, start, end in _state.cuda_events:
            regions[name] = regions.get(name, 0.0) + start.elapsed_time(end)
    now = time.perf_counter()
    record: dict[str, Any] = {"step": fields.pop("step", _state.step), "regions": regions}
    tokens = fields.pop("tokens", None)
    if tokens is not None:
        tokens = int(tokens)
        seconds = regions["step"] / 1e3 if "step" in regions else now - _state.last_step_time
        record["tokens"] = tokens
        record["tokens_per_s"] = tokens / seconds if seconds > 0 else None
    if _state.memory and torch.cuda.is_available() and torch.cuda.is_initialized():
        record["peak_vram_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    routes = {op: decision.route for op, decision in dispatch.explain().items()}
    if routes:
        record["routes"] = routes
    record.update({k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()})
    if _state.path:
        with open(_state.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    _state.step += 1
    _state.cpu_ms.clear()
    _state.cuda_events.clear()
    _state.last_step_time = now
    return record


def _percentile(sorted_values: list[float], q: float) -> float:
    # linear interpolation between closest ranks, as numpy's default
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_values(values: Iterable[float]) -> dict[str, float]:
    """``{"n", "mean", "min", "p50", "p90", "p99", "max"}`` of ``values`` (empty input gives ``{"n": 0}``)."""
    vals = sorted(float(v) for v in values if v is not None)
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "mean": sum(vals) / len(vals),
        "min": vals[0],
        "p50": _percentile(vals, 0.5),
        "p90": _percentile(vals, 0.9),
        "p99": _percentile(vals, 0.99),
        "max": vals[-1],
    }
