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
        assert record is not None and record["step"] == step
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
    assert (stats["min"], stats["max"]) == (min(values), max(values))
    assert profiling.summarize_values([]) == {"n": 0}


def test_enable_from_env(monkeypatch, tmp_path):
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("RL_KERNEL_PROFILE", str(path))
    assert profiling.enable_from_env()
    profiling.step_end()
    assert path.exists()


@pytest.mark.parametrize("value", ["0", "false", " OFF ", "no", ""])
def test_off_values_leave_profiling_off_and_write_nothing(monkeypatch, tmp_path, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RL_KERNEL_PROFILE", value)
    assert profiling.enable_from_env() is False
    assert profiling.step_end(tokens=1) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["1", "true", "On", " yes "])
def test_on_values_turn_profiling_on_without_a_file(monkeypatch, tmp_path, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RL_KERNEL_PROFILE", value)
    assert profiling.enable_from_env() is True
    assert profiling.step_end(tokens=1) is not None
    assert list(tmp_path.iterdir()) == []


def test_a_directory_is_refused_at_start(monkeypatch, tmp_path):
    monkeypatch.setenv("RL_KERNEL_PROFILE", str(tmp_path))
    with pytest.raises(ValueError, match=r"RL_KERNEL_PROFILE must be a JSONL file path .* which is a directory"):
        profiling.enable_from_env()
    assert not profiling.is_enabled()
    with pytest.raises(ValueError, match="path must be a JSONL file path"):
        profiling.enable(str(tmp_path))


def test_an_unwritable_path_is_refused_at_start(monkeypatch, tmp_path):
    missing_dir = tmp_path / "no" / "such" / "dir" / "steps.jsonl"
    monkeypatch.setenv("RL_KERNEL_PROFILE", str(missing_dir))
    with pytest.raises(ValueError, match=r"RL_KERNEL_PROFILE must be a writable JSONL file path, got .*steps.jsonl'"):
        profiling.enable_from_env()
    assert not profiling.is_enabled()


def test_a_read_only_directory_is_refused_at_start(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root can write into a read-only directory")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="writable"):
            profiling.enable(str(ro / "steps.jsonl"))
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("memory", [True, False])
def test_the_peak_memory_counter_is_touched_only_when_profiling_owns_it(monkeypatch, memory):
    """``memory=True`` resets CUDA's process-wide peak counter at enable and at each step_end and
    records the step's peak; ``memory=False`` (an adapter inside a framework that reads the counter
    itself) neither reads nor resets it. CUDA's functions are stand-ins: this runs on CPU."""
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: resets.append(1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 3 * 2**30)
    profiling.enable(memory=memory)
    with profiling.region("loss", "cpu"):
        pass
    record = profiling.step_end()
    assert record is not None
    if memory:
        assert record["peak_vram_gib"] == 3.0 and len(resets) == 2
    else:
        assert "peak_vram_gib" not in record and not resets


@pytest.mark.gpu
def test_cuda_regions_use_events_and_report_vram():
    profiling.enable()
    x = torch.randn(2048, 2048, device="cuda")
    with profiling.region("logprob"):
        y = x @ x
    record = profiling.step_end(tokens=1)
    assert record is not None and record["regions"]["logprob"] > 0
    assert record["peak_vram_gib"] > 0
    del y


def test_step_records_name_the_route_each_op_ran():
    from rl_kernel_core.batch_invariant_mode.api import bi_mean

    profiling.enable()
    bi_mean(torch.randn(4, 8), -1, backend="torch")
    record = profiling.step_end()
    assert record is not None and record["routes"]["bi_mean"] == "torch"
