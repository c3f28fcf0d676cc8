"""The native sources compile for sm_90 without a GPU, and declare the loss codes the Python side uses."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl_kernel_core import loss_codes


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_native_sources_compile_for_sm90():
    proc = subprocess.run([sys.executable, "-m", "rl_kernel_core.native", "check", "--arch", "90"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sources compiled for sm_90" in proc.stdout


def _enum(text: str, name: str) -> dict[str, int]:
    found = re.search(rf"enum {name} : int \{{([^}}]*)\}};", text)
    assert found, f"no enum {name} : int {{...}}; in the source"
    body = found.group(1)
    return {k.strip(): int(v) for k, v in (item.split("=") for item in body.split(","))}


def test_native_codes_match_python():
    text = (Path(__file__).resolve().parents[2] / "native" / "csrc" / "codes.h").read_text()
    kl = {"kK1": "k1", "kAbs": "abs", "kK2": "k2", "kK3": "k3"}
    assert {kl[k]: v for k, v in _enum(text, "KlCode").items()} == loss_codes.KL_CODES
    agg = {"kTokenMean": "token-mean", "kSeqMeanTokenSum": "seq-mean-token-sum", "kSeqMeanTokenMean": "seq-mean-token-mean",
           "kSeqMeanTokenSumNorm": "seq-mean-token-sum-norm", "kTokenSum": "token-sum"}
    assert {agg[k]: v for k, v in _enum(text, "Agg").items()} == loss_codes.AGG_CODES
    est = {"kGrpo": "grpo", "kDrGrpo": "dr_grpo", "kRloo": "rloo"}
    assert {est[k]: v for k, v in _enum(text, "EstimatorCode").items()} == loss_codes.ESTIMATOR_CODES


def test_info_builds_and_loads_nothing():
    code = ("import sys; from rl_kernel_core import cli; cli.main(['info']); "
            "assert 'rl_kernel_core.native' not in sys.modules, 'info imported the native backend'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "native" in proc.stdout


def test_status_says_not_built_yet_then_built(monkeypatch, tmp_path):
    from rl_kernel_core import native_build

    monkeypatch.setenv("RL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "unavailable_reason", lambda: None)
    assert native_build.status().startswith("not built yet")
    assert "python -m rl_kernel_core.native build" in native_build.status()
    native_build.build_dir().mkdir(parents=True)
    (native_build.build_dir() / f"{native_build.EXTENSION_PREFIX}loss.so").write_bytes(b"")
    status = native_build.status()
    assert status.startswith(f"built in {native_build.build_dir()}: loss; not built yet: logprob_from_logits, advantages, linear_logprob")
    for group in native_build.GROUPS:
        (native_build.build_dir() / f"{native_build.EXTENSION_PREFIX}{group}.so").write_bytes(b"")
    assert "not built yet" not in native_build.status()


def test_every_source_belongs_to_one_group():
    """Each .cu/.cpp in native/csrc is in exactly one group, so check and build cover the same files."""
    from rl_kernel_core import native_build

    grouped = [name for names in native_build.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(p.name for p in native_build.sources())
    assert len(set(grouped)) == len(grouped)


def test_build_names_an_unknown_group():
    proc = subprocess.run([sys.executable, "-m", "rl_kernel_core.native", "build", "sampling"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "GROUP must be among ['logprob_from_logits', 'loss', 'advantages', 'linear_logprob'], got ['sampling']" in proc.stderr


def _build_in(cache: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "RL_KERNEL_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "rl_kernel_core.native", "build"], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("mode, says", [(0o770, "writable by group (mode 0o770)"), (0o707, "writable by others (mode 0o707)"),
                                        (0o777, "writable by group and others (mode 0o777)")])
def test_a_shared_build_cache_is_refused(tmp_path, mode, says):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    proc = _build_in(cache)
    assert proc.returncode == 1
    assert f"rl-kernel native: cannot build: the rl-kernel build cache {str(cache)!r} (RL_KERNEL_CACHE) is {says}" in proc.stderr
    assert f"chmod go-w {str(cache)!r}" in proc.stderr


def test_a_build_cache_of_another_user_is_refused(tmp_path):
    import os

    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.chown(cache, os.getuid() + 4242, -1)
    proc = _build_in(cache)
    assert proc.returncode == 1
    assert f"is owned by uid {os.getuid() + 4242}, not by you (uid {os.getuid()})" in proc.stderr


@pytest.mark.parametrize("private", ["absent", "0700", "0755"])
def test_a_private_or_absent_build_cache_passes_the_check(tmp_path, private):
    if shutil.which("nvcc") is not None:
        pytest.skip("with a toolchain this would run a full build; test_native covers building")
    cache = tmp_path / "cache"
    if private != "absent":
        cache.mkdir()
        cache.chmod(int(private, 8))
    proc = _build_in(cache)
    assert "build cache" not in proc.stderr  # any failure left is the toolchain's (no nvcc, CPU-only torch)
