"""``rl_kernel_core.tools.bench.peak_extra_gib``: the peak of the measured call over what was allocated
before it, refused when the call resets CUDA's peak counter. CUDA's memory functions are stand-ins
(CPU)."""

from __future__ import annotations

import pytest
import torch

from rl_kernel_core.tools import bench


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"allocated": 2 * 2**30, "peak": 2 * 2**30}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: state["peak"])

    def reset(*args, **kwargs):
        state["peak"] = state["allocated"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    return state


def test_peak_extra_is_the_calls_peak_over_what_was_allocated_before(fake_cuda):
    def work():
        fake_cuda["peak"] = 7 * 2**30

    assert bench.peak_extra_gib(work, torch.device("cuda")) == 5.0


def test_a_call_that_resets_the_peak_counter_is_refused(fake_cuda):
    original = torch.cuda.reset_peak_memory_stats

    def work():
        fake_cuda["peak"] = 9 * 2**30
        torch.cuda.reset_peak_memory_stats()  # what an adapter closing a profiling step used to do

    with pytest.raises(RuntimeError, match="reset CUDA's peak-memory counter"):
        bench.peak_extra_gib(work, torch.device("cuda"))
    assert torch.cuda.reset_peak_memory_stats is original


def test_cpu_has_no_peak():
    assert bench.peak_extra_gib(lambda: None, torch.device("cpu")) is None
