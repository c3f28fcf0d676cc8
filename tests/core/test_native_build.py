"""The native backend as a build: its sources compile for sm_90 without a GPU, are warp-size
agnostic, build every error message with ``cat`` and declare the loss codes the Python side uses;
without a usable extension the backend says why (``backend="native"`` raises the reason,
``rl-kernel info`` shows it, the ahead-of-time build exits with it); on a CUDA machine (``gpu``)
the ahead-of-time build succeeds, ``auto`` follows the order measured on that GPU and the entry
points' own checks raise one-line errors. The ops' values are checked in each family's tests (tests/core/<family>/)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch, loss_codes, native_build
from oracles import make_logits, make_tokens

NATIVE = "native"
SOURCES = Path(__file__).resolve().parents[2] / "native" / "csrc"
gpu = pytest.mark.gpu


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_native_sources_compile_for_sm90():
    proc = subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.native", "check", "--arch", "90"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sources compiled for sm_90" in proc.stdout


def _enum(text: str, name: str) -> dict[str, int]:
    found = re.search(rf"enum {name} : int \{{([^}}]*)\}};", text)
    assert found, f"no enum {name} : int {{...}}; in the source"
    body = found.group(1)
    return {k.strip(): int(v) for k, v in (item.split("=") for item in body.split(","))}


def test_native_codes_match_python():
    text = (SOURCES / "codes.h").read_text()
    kl = {"kK1": "k1", "kAbs": "abs", "kK2": "k2", "kK3": "k3"}
    assert {kl[k]: v for k, v in _enum(text, "KlCode").items()} == loss_codes.KL_CODES
    agg = {
        "kTokenMean": "token-mean",
        "kSeqMeanTokenSum": "seq-mean-token-sum",
        "kSeqMeanTokenMean": "seq-mean-token-mean",
        "kSeqMeanTokenSumNorm": "seq-mean-token-sum-norm",
        "kTokenSum": "token-sum",
    }
    assert {agg[k]: v for k, v in _enum(text, "Agg").items()} == loss_codes.AGG_CODES
    est = {"kGrpo": "grpo", "kDrGrpo": "dr_grpo", "kRloo": "rloo"}
    assert {est[k]: v for k, v in _enum(text, "EstimatorCode").items()} == loss_codes.ESTIMATOR_CODES


def test_info_builds_and_loads_nothing():
    code = (
        "import sys; from rl_kernel_core.tools import cli; cli.main(['info']); "
        "assert 'rl_kernel_core.native' not in sys.modules, 'info imported the native backend'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "native" in proc.stdout


def test_status_says_not_built_yet_then_built(monkeypatch, tmp_path):
    from rl_kernel_core import native_build

    monkeypatch.setenv("RL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "unavailable_reason", lambda: None)
    assert native_build.status().startswith("not built yet")
    assert "python -m rl_kernel_core.native build" in native_build.status()
    for group in native_build.GROUPS:
        native_build.group_dir(group).mkdir(parents=True)
    (native_build.group_dir("loss") / f"{native_build.EXTENSION_PREFIX}loss.so").write_bytes(b"")
    status = native_build.status()
    assert status.startswith(
        f"built in {native_build.build_dir()}: loss; not built yet: logprob_from_logits, advantages, linear_logprob, triton_launch"
    )
    for group in native_build.GROUPS:
        (native_build.group_dir(group) / f"{native_build.EXTENSION_PREFIX}{group}.so").write_bytes(b"")
    assert "not built yet" not in native_build.status()


def test_each_group_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """torch's JIT build locks a folder, not an extension: a process waiting on another group's build
    in a shared folder then loads an extension nobody built. Each group gets its own folder (and lock)."""
    from torch.utils import cpp_extension

    from rl_kernel_core import native_build

    monkeypatch.setenv("RL_KERNEL_CACHE", str(tmp_path))
    folders: dict[str, str] = {}
    monkeypatch.setattr(
        cpp_extension, "load", lambda name, build_directory, **kw: folders.setdefault(name, build_directory)
    )
    for group in native_build.GROUPS:
        native_build.build(group)
    assert len(set(folders.values())) == len(native_build.GROUPS)
    assert all(
        folder == str(native_build.group_dir(name.removeprefix(native_build.EXTENSION_PREFIX)))
        for name, folder in folders.items()
    )


def test_every_source_belongs_to_one_group():
    """Each .cu/.cpp in native/csrc is in exactly one group, so check and build cover the same files."""
    from rl_kernel_core import native_build

    grouped = [name for names in native_build.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(p.name for p in native_build.sources())
    assert len(set(grouped)) == len(grouped)


def test_build_names_an_unknown_group():
    proc = subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.native", "build", "sampling"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (
        "GROUP must be among ['logprob_from_logits', 'loss', 'advantages', 'linear_logprob', 'triton_launch'], got ['sampling']"
        in proc.stderr
    )


def test_where_prints_the_build_folder(monkeypatch, tmp_path):
    from rl_kernel_core import native_build

    monkeypatch.setenv("RL_KERNEL_CACHE", str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.native", "where"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(native_build.build_dir())


@pytest.mark.parametrize("command", ["build", "check"])
def test_jobs_below_one_is_a_one_line_error(command):
    proc = subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.native", command, "--jobs", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "--jobs: must be a positive integer, got 0" in proc.stderr, proc.stderr


def _build_in(cache: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "RL_KERNEL_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.native", "build"], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.parametrize(
    "mode, says",
    [
        (0o770, "writable by group (mode 0o770)"),
        (0o707, "writable by others (mode 0o707)"),
        (0o777, "writable by group and others (mode 0o777)"),
    ],
)
def test_a_shared_build_cache_is_refused(tmp_path, mode, says):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    proc = _build_in(cache)
    assert proc.returncode == 1
    assert (
        f"rl-kernel native: cannot build: the rl-kernel build cache {str(cache)!r} (RL_KERNEL_CACHE) is {says}"
        in proc.stderr
    )
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
        pytest.skip(
            "with a toolchain this would run a full build; test_ahead_of_time_build_succeeds_and_reuses_the_cache covers building"
        )
    cache = tmp_path / "cache"
    if private != "absent":
        cache.mkdir()
        cache.chmod(int(private, 8))
    proc = _build_in(cache)
    assert "build cache" not in proc.stderr  # any failure left is the toolchain's (no nvcc, CPU-only torch)


# ============================================================== without a usable extension


def _expected_reason() -> str:
    status = dispatch.backend_status()["native"]
    assert status, "the native backend loaded"
    return status


@pytest.mark.skipif(torch.cuda.is_available(), reason="the extension can be built here")
def test_explicit_native_raises_the_reason():
    reason = _expected_reason()
    assert "CPU-only" in reason or "CUDA" in reason or "nvcc" in reason or "ninja" in reason, reason
    logits, targets = torch.randn(3, 5), torch.tensor([1, 2, -100])
    cases = [
        lambda: rk.logprob_from_logits(logits, targets, backend=NATIVE),
        lambda: rk.ratio_kl(torch.randn(4), torch.randn(4), backend=NATIVE),
        lambda: rk.policy_loss(
            torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool), backend=NATIVE
        ),
        lambda: rk.group_advantages(torch.randn(4), group_size=2, backend=NATIVE),
        lambda: rk.linear_logprob(torch.randn(3, 4), torch.randn(5, 4), targets, backend=NATIVE),
    ]
    for call in cases:
        with pytest.raises(rk.BackendUnavailableError, match=r"backend='native' cannot run: ") as info:
            call()
        assert reason in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the extension can be built here")
def test_info_shows_why_native_is_unavailable():
    proc = subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.cli", "info", "--json"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    native = json.loads(proc.stdout)["backends"]["native"]
    assert native == f"unavailable: {native_build.unavailable_reason()}"
    reason = native_build.unavailable_reason()
    assert reason is not None and reason in _expected_reason()


def _aot_build() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl_kernel_core.native", "build"], capture_output=True, text=True, timeout=900
    )


@pytest.mark.skipif(torch.version.cuda is not None, reason="this PyTorch can build CUDA extensions")
def test_ahead_of_time_build_on_cpu_only_torch_exits_with_the_reason():
    proc = _aot_build()
    assert proc.returncode == 1
    assert f"cannot build: PyTorch {torch.__version__} is a CPU-only build" in proc.stderr


def test_sources_are_warp_size_agnostic_and_hipify_friendly():
    """No warp shuffles or 32-lane masks (wavefront 64), no CUDA-only half/bfloat16 headers, no raw
    streams. The Hopper-only sources (wgmma: warps of 32 by definition) may shuffle within a warp,
    and compile to a refusing stub under ROCm."""
    from rl_kernel_core.native_build import SM90A_SOURCES

    hopper = {name for names in SM90A_SOURCES.values() for name in names}
    sources = (
        sorted(SOURCES.glob("*.cu"))
        + sorted(SOURCES.glob("*.cuh"))
        + sorted(SOURCES.glob("*.cpp"))
        + sorted(SOURCES.glob("*.h"))
    )
    assert any(p.suffix == ".cu" for p in sources)
    forbidden = [
        r"__shfl",
        r"0xffffffff",
        r"warpSize",
        r"cuda_bf16\.h",
        r"cuda_fp16\.h",
        r"cudaStreamCreate",
        r"atomicAdd",
    ]
    for path in sources:
        text = path.read_text()
        if path.name in hopper:
            assert "#ifndef USE_ROCM" in text, f"{path.name} must compile to a stub under ROCm"
        for pattern in forbidden[2:] if path.name in hopper else forbidden:
            assert not re.search(pattern, text), f"{path.name} uses {pattern}"


def test_sources_build_error_messages_with_cat_only():
    """A formatted TORCH_CHECK (c10::str, std::ostringstream) crashed a JIT-built extension on the
    H200 instead of raising (message.h): every message goes through ``cat``."""
    for path in sorted(SOURCES.iterdir()):
        if path.name == "message.h":
            continue
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        for pattern in (r"TORCH_CHECK\s*\(", r"c10::str\s*\(", r"ostringstream"):
            assert not re.search(pattern, code), f"{path.name} uses {pattern}: build the message with cat (message.h)"


# ============================================================== on a CUDA machine


@gpu
def test_auto_follows_the_measured_order_on_this_gpu(seed):
    from rl_kernel_core import ops

    major, minor = torch.cuda.get_device_capability()

    def first(op: str) -> str:
        spec = ops.OPS[op]
        return spec.measured_order.get(f"{major}.{minor}", spec.auto_order)[0]

    logits, targets = make_logits(3, 64, torch.float32, "cuda")
    rk.logprob_from_logits(logits, targets)
    assert dispatch.explain("logprob_from_logits").backend == first("logprob_from_logits")
    t = make_tokens((2, 8), "cuda")
    rk.policy_loss(t["lp"], t["old"], t["adv"], t["mask"])
    assert dispatch.explain("policy_loss").backend == first("policy_loss")


@gpu
def test_ahead_of_time_build_succeeds_and_reuses_the_cache():
    proc = _aot_build()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rl-kernel native: built " in proc.stdout


@gpu
def test_native_entry_points_raise_one_line_errors_with_the_numbers():
    """Each group's own checks (what would read out of bounds) raise a RuntimeError that names the
    argument, the expected and the actual shape, instead of crashing the process (message.h)."""
    from rl_kernel_core.native import extension

    cuda = torch.device("cuda")
    rewards = torch.randn(6, device=cuda)
    advantages = extension("advantages")
    with pytest.raises(RuntimeError, match=r"^rl_kernel native: rewards must be \[N\], got \[2, 3\]$"):
        advantages.group_advantages(rewards.view(2, 3), 3, None, 0, True, 1e-6)
    with pytest.raises(RuntimeError, match=r"group_size must be positive and divide N = 6, got 4$"):
        advantages.group_advantages(rewards, 4, None, 0, True, 1e-6)
    with pytest.raises(RuntimeError, match=r"estimator code must be in \[0, 2\], got 7$"):
        advantages.group_advantages(rewards, 3, None, 7, True, 1e-6)
    with pytest.raises(RuntimeError, match=r"rewards must be a CUDA tensor, got cpu$"):
        advantages.group_advantages(rewards.cpu(), 3, None, 0, True, 1e-6)

    lp = torch.randn(2, 5, device=cuda)
    loss = extension("loss")
    with pytest.raises(
        RuntimeError, match=r"ratio_kl tensors must share one shape, got \[2, 5\], \[2, 4\] and \[2, 5\]$"
    ):
        loss.ratio_kl_fwd(lp, lp[:, :4], lp, 0)
    with pytest.raises(RuntimeError, match=r"kl_code must be in \[0, 3\], got 9$"):
        loss.ratio_kl_fwd(lp, lp, lp, 9)
    with pytest.raises(RuntimeError, match=r"per-token tensors must share logprob's shape \[2, 5\], got \[5\]$"):
        loss.policy_loss_fwd(lp, lp, lp[0], lp, lp, None, None, 0.2, 0.2, None, 0, 0.0, 0.0, 0)

    logits = torch.randn(4, 11, device=cuda)
    targets = torch.randint(0, 11, (4,), device=cuda)
    from_logits = extension("logprob_from_logits")
    with pytest.raises(RuntimeError, match=r"logits must be \[N, V\], got \[44\]$"):
        from_logits.logprob_fwd(logits.view(-1), targets, 1.0, -100, False)
    with pytest.raises(RuntimeError, match=r"targets must be \[4\], got \[3\]$"):
        from_logits.logprob_fwd(logits, targets[:3], 1.0, -100, False)
    with pytest.raises(RuntimeError, match=r"logits must be float32, bfloat16 or float16, got Double$"):
        from_logits.logprob_fwd(logits.double(), targets, 1.0, -100, False)

    linear = extension("linear_logprob")
    rows = torch.empty(4, device=cuda)
    with pytest.raises(RuntimeError, match=r"the logits chunk must be fp32 \[rows, V\], got BFloat16 \[4, 11\]$"):
        linear.linear_chunk_stats(logits.bfloat16(), None, targets, 1.0, -100, rows, None, rows)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[11\] tensor, got \[10\]$"):
        linear.linear_chunk_stats(logits, torch.zeros(10, device=cuda), targets, 1.0, -100, rows, None, rows)
    with pytest.raises(RuntimeError, match=r"lse must be a contiguous fp32 \[4\] tensor, got Float \[3\]$"):
        linear.linear_chunk_stats(logits, None, targets, 1.0, -100, rows, None, rows[:3])
    with pytest.raises(RuntimeError, match=r"dl must be \[>=4, 11\] with unit stride along V, got \[4, 10\]$"):
        linear.linear_chunk_grad(logits, logits[:, :10], None, targets, rows, None, rows, None, 1.0, -100)
