"""Profiler: regions accumulate per step, records go to JSONL, summaries are right, off is free."""

import json
import time

import pytest
import torch

from rl_kernel_core import profiling


@pytest.fixture(autouse=True)
def _off_afterwards():
    yield
    profiling.disable()


def test_off_returns_the_shared_noop_and_writes_nothing(tmp_path):
    profiling.disable()
    assert profiling.region("logprob") is profiling.region("loss")
    with profiling.region("logprob"):
        pass
    assert profiling.step_end(tokens=10) is None


def test_regions_accumulate_and_step_records_are_written(tmp_path):
    path = tmp_path / "steps.jsonl"
    profiling.enable(str(path))
    for step in range(3):
        for _ in range(2):
            with profiling.region("logprob", device="cpu"):
                time.sleep(0.002)
        with profiling.region("step", device="cpu"):
            time.sleep(0.004)
        record = profiling.step_end(tokens=400, reward=torch.tensor(0.25))
        assert record["step"] == step
        assert record["regions"]["logprob"] >= 4.0  # two sleeps of 2 ms accumulate
        assert record["tokens_per_s"] == pytest.approx(400 / (record["regions"]["step"] / 1e3))
        assert record["reward"] == 0.25
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]


def test_summary_percentiles_match_numpy():
    np = pytest.importorskip("numpy")
    values = torch.rand(101).tolist()
    stats = profiling.summarize_values(values)
    assert stats["n"] == 101
    for q, key in ((50, "p50"), (90, "p90"), (99, "p99")):
        assert stats[key] == pytest.approx(float(np.percentile(values, q)))
    assert stats["mean"] == pytest.approx(sum(values) / 101)
    assert profiling.summarize_values([]) == {"n": 0}


def test_enable_from_env(monkeypatch, tmp_path):
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("RL_KERNEL_PROFILE", str(path))
    assert profiling.enable_from_env()
    profiling.step_end()
    assert path.exists()


@pytest.mark.gpu
def test_cuda_regions_use_events_and_report_vram():
    profiling.enable()
    x = torch.randn(2048, 2048, device="cuda")
    with profiling.region("logprob"):
        y = x @ x
    record = profiling.step_end(tokens=1)
    assert record["regions"]["logprob"] > 0
    assert record["peak_vram_gib"] > 0
    del y
