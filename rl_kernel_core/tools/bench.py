"""Benchmark plumbing shared by ``rl-kernel bench`` and the scripts in ``benchmarks/``.

Timing: warm-up calls first (compilation, autotuning and allocator growth stay out of the
numbers), then ``reps`` timed calls, each bracketed by CUDA events on GPU or the wall clock on
CPU; the median is what we quote. Memory: the peak allocated during one call minus what was
allocated before it (CUDA allocator statistics), i.e. extra memory over the inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch


def command_line() -> str:
    """This run's command line, with the output path (a machine path) written as ``<out>``."""
    argv = list(sys.argv)
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            argv[i + 1] = "<out>"
        elif arg.startswith("--out="):
            argv[i] = "--out=<out>"
    return " ".join([os.path.basename(sys.executable)] + argv)


def environment(device: torch.device) -> dict[str, Any]:
    """Hardware and software facts recorded with every benchmark result."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # recorded, not hidden
        info["triton"] = f"unavailable: {type(exc).__name__}: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sm_count"] = props.multi_processor_count
        info["capability"] = f"{props.major}.{props.minor}"
    return info


def write_json(directory: str, name: str, result: dict) -> str:
    """Write ``result`` as indented JSON to ``directory/name`` (creating the directory); return the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return path


def free_memory_bytes(device: torch.device) -> int:
    """Bytes that can be allocated on ``device`` now: the CUDA driver's free memory for a CUDA
    device, the operating system's available physical memory for the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_timing_options(p: argparse.ArgumentParser, *, reps: int, warmup: int = 3) -> None:
    """A benchmark's ``--device`` (default None: the script picks), ``--warmup`` and ``--reps`` (as
    :func:`time_ms` takes them) and ``--seed`` (default 0) options."""
    p.add_argument("--device", default=None)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--seed", type=int, default=0)


def time_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int = 3, reps: int = 10) -> dict[str, float]:
    """Median/min/max milliseconds of ``fn()`` over ``reps`` timed calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps}


def graph_time_ms(
    fn: Callable[[], Any], device: torch.device, *, warmup: int = 3, reps: int = 10, calls: int = 1
) -> dict[str, Any]:
    """:func:`time_ms` of ``calls`` back-to-back ``fn()`` captured as one CUDA graph, per call (the
    device's time: a short kernel timed from the host also counts its launch), or
    ``{"skipped": why}`` where capture fails (recorded, never hidden)."""
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as exc:
        return {"skipped": f"capture failed: {type(exc).__name__}: {exc}"}
    timed = time_ms(graph.replay, device, warmup=warmup, reps=reps)
    return {key: value / calls if key.endswith("_ms") else value for key, value in timed.items()} | {
        "calls_per_graph": calls
    }


def peak_extra_gib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak memory allocated during ``fn()`` beyond what was allocated before it (CUDA only).

    Raises ``RuntimeError`` when ``fn`` resets CUDA's peak-memory counter
    (``torch.cuda.reset_peak_memory_stats``, refused while it runs): the peak read after it would
    cover only the part of the call after the reset."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    reset = torch.cuda.reset_peak_memory_stats

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "peak_extra_gib: the measured call reset CUDA's peak-memory counter "
            "(torch.cuda.reset_peak_memory_stats), so its peak cannot be measured"
        )

    torch.cuda.reset_peak_memory_stats = refuse
    try:
        result = fn()
    finally:
        torch.cuda.reset_peak_memory_stats = reset
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    del result
    return (peak - before) / 2**30


def kernel_table(fn: Callable[[], Any], warmup: int) -> tuple[float, list[dict]]:
    """Device ms of one ``fn()`` call (the sum of its CUDA kernels under ``torch.profiler``, after
    ``warmup`` calls), and its kernels grouped by name, most time first (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    groups: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            groups[ev.name][0] += ev.device_time_total / 1e3
            groups[ev.name][1] += 1
    rows = [{"kernel": k, "ms": round(ms, 3), "launches": c} for k, (ms, c) in groups.items()]
    rows.sort(key=lambda r: -r["ms"])
    return round(sum(r["ms"] for r in rows), 3), rows
