"""The native CUDA backend (native/csrc, built and registered by rl_kernel_core.native).

On a CUDA machine (tests marked ``gpu``) the extension is JIT-built on first use and every native
op is checked against fp64 formulas (the oracles of test_triton_losses: log-softmax of the upcast
logits, verl's surrogate and aggregation written as loops, group statistics per group) and
against the reference backend, with tolerances from rl_kernel_core.contract, on fresh random
inputs (never zeros): odd sizes (V not a multiple of the vector width or of a block, N prime),
logits of magnitude 100, all-equal logits, ``-inf`` entries, temperature 0.7, ignore_index rows.
Determinism and row independence are asserted bitwise. Without CUDA the tests check that the
backend says why it cannot run: ``backend="native"`` raises the reason, ``rl-kernel info`` shows
it and the ahead-of-time build command exits with it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch, native_build
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss import METRIC_NAMES
from oracles import (
    AGG_MODES, KL_TYPE_CASES, advantages_oracle, check_compiled_equals_eager, check_logprob, check_policy_loss, check_ratio_kl, kl_oracle, leaves, linear_oracle, linear_oracle_grads, logprob_oracle, make_inputs, make_logits, make_tokens, run_policy_loss, small_chunks, upstream,
)

NATIVE = "native"
SOURCES = Path(__file__).resolve().parents[2] / "native" / "csrc"
gpu = pytest.mark.gpu


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
        lambda: rk.policy_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool), backend=NATIVE),
        lambda: rk.group_advantages(torch.randn(4), group_size=2, backend=NATIVE),
        lambda: rk.linear_logprob(torch.randn(3, 4), torch.randn(5, 4), targets, backend=NATIVE),
    ]
    for call in cases:
        with pytest.raises(rk.BackendUnavailableError, match=r"backend='native' cannot run: ") as info:
            call()
        assert reason in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the extension can be built here")
def test_info_shows_why_native_is_unavailable():
    proc = subprocess.run([sys.executable, "-m", "rl_kernel_core.cli", "info", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    native = json.loads(proc.stdout)["backends"]["native"]
    assert native == f"unavailable: {native_build.unavailable_reason()}"
    reason = native_build.unavailable_reason()
    assert reason is not None and reason in _expected_reason()


def _aot_build() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl_kernel_core.native", "build"], capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this PyTorch can build CUDA extensions")
def test_ahead_of_time_build_on_cpu_only_torch_exits_with_the_reason():
    proc = _aot_build()
    assert proc.returncode == 1
    assert f"cannot build: PyTorch {torch.__version__} is a CPU-only build" in proc.stderr


def test_sources_are_warp_size_agnostic_and_hipify_friendly():
    """No warp shuffles or 32-lane masks (wavefront 64), no CUDA-only half/bfloat16 headers, no raw streams."""
    sources = sorted(SOURCES.glob("*.cu")) + sorted(SOURCES.glob("*.cuh")) + sorted(SOURCES.glob("*.cpp")) + sorted(SOURCES.glob("*.h"))
    assert any(p.suffix == ".cu" for p in sources)
    forbidden = [r"__shfl", r"0xffffffff", r"warpSize", r"cuda_bf16\.h", r"cuda_fp16\.h", r"cudaStreamCreate", r"atomicAdd"]
    for path in sources:
        text = path.read_text()
        for pattern in forbidden:
            assert not re.search(pattern, text), f"{path.name} uses {pattern}"


# ============================================================== logprob_from_logits (GPU)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [301, 2048])  # element-wise path (rows not 16-byte aligned) and vector path
def test_logprob_values_and_gradients(seed, dtype, temperature, vocab):
    logits, targets = make_logits(7, vocab, dtype, "cuda")
    check_logprob(logits, targets, temperature, backend=NATIVE)


@gpu
@pytest.mark.parametrize("vocab", [4096 + 37, 32000])
def test_logprob_long_rows(seed, vocab):
    # many loads per thread, two in flight, a scalar tail (4133) or none (32000)
    logits, targets = make_logits(5, vocab, torch.bfloat16, "cuda")
    check_logprob(logits, targets, 0.7, backend=NATIVE)


@gpu
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 257), (torch.bfloat16, 256)])
def test_logprob_large_magnitude_and_all_equal_logits(seed, with_entropy, dtype, vocab):
    logits, targets = make_logits(5, vocab, torch.float32, "cuda", ignore_frac=0.0)
    logits[0] = torch.where(torch.rand(vocab, device="cuda") < 0.5, -100.0, 100.0)
    logits[1] = 100.0 * torch.rand(vocab, device="cuda")
    logits[2] = -100.0
    logits[3] = 3.25
    check_logprob(logits.to(dtype), targets, 0.7, with_entropy, backend=NATIVE)


def _masked_oracle(logits, targets, temperature, ignore_index):
    """fp64 log p(target) and entropy where -inf entries have probability 0 (and add 0 to the entropy)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    keep = targets != ignore_index
    lp = logp.gather(-1, torch.where(keep, targets, 0).long().unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


@gpu
def test_logprob_masked_entries_get_zero_probability_and_gradient(seed):
    logits, targets = make_logits(6, 1000, torch.float32, "cuda", ignore_frac=0.0)
    masked = torch.rand(6, 1000, device="cuda") < 0.3
    masked[torch.arange(6), targets] = False
    logits[masked] = float("-inf")
    _, _, grad = check_logprob(logits, targets, 0.7, oracle=_masked_oracle, backend=NATIVE)
    assert torch.equal(grad[masked], torch.zeros_like(grad[masked]))


@gpu
def test_logprob_gradient_through_entropy_only_and_logprob_only(seed):
    logits, targets = make_logits(4, 129, torch.float32, "cuda")
    x = logits.clone().requires_grad_()
    x64 = logits.double().requires_grad_()
    _, ent = rk.logprob_from_logits(x, targets, return_entropy=True, backend=NATIVE)
    ent.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[1].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via entropy")
    x.grad, x64.grad = None, None
    lp, _ = rk.logprob_from_logits(x, targets, return_entropy=True, backend=NATIVE)
    lp.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[0].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via logprob")


@gpu
def test_logprob_ignored_rows_are_zero_with_zero_gradient(seed):
    logits, targets = make_logits(5, 64, torch.bfloat16, "cuda", ignore_frac=0.0)
    targets[1:3] = 7  # a custom ignore id that is also a valid vocabulary id elsewhere
    lp, ent, grad = check_logprob(logits, targets, 1.0, True, ignore_index=7, backend=NATIVE)
    assert torch.equal(lp[1:3], torch.zeros(2, device="cuda")) and torch.equal(ent[1:3], torch.zeros(2, device="cuda"))
    assert torch.equal(grad[1:3], torch.zeros_like(grad[1:3]))


@gpu
@pytest.mark.parametrize("offset", [5, 8])  # rows strided: not 16-byte aligned (element loads) and aligned
def test_logprob_row_strided_logits_and_leading_dims(seed, offset):
    base = (torch.randn(2, 3, 112) * 3).to(torch.bfloat16).cuda()
    logits = base[..., offset : offset + 96]  # unit stride along V, rows 112 apart: passed without a copy
    targets = torch.randint(0, 96, (2, 3), device="cuda")
    x = logits.detach().clone().requires_grad_()
    lp_strided = rk.logprob_from_logits(logits, targets, backend=NATIVE)
    lp_contig = rk.logprob_from_logits(x, targets, backend=NATIVE)
    assert lp_strided.shape == (2, 3)
    assert torch.equal(lp_strided, lp_contig)  # alignment never changes the bits
    assert_close(lp_strided, logprob_oracle(logits, targets, 1.0, -100)[0], "logprob", torch.bfloat16, "strided logprob")


@gpu
def test_logprob_matches_reference_and_triton_backends(seed):
    logits, targets = make_logits(7, 333, torch.bfloat16, "cuda")
    ours = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend=NATIVE)
    for other in ("torch", "triton"):
        theirs = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend=other)
        for a, b, name in zip(ours, theirs, ("logprob", "entropy")):
            assert_close(a, b.double(), "logprob", torch.bfloat16, f"{name} vs {other}")


@gpu
def test_logprob_deterministic_and_row_independent(seed):
    logits, targets = make_logits(11, 4096 + 100, torch.bfloat16, "cuda")
    g_lp, g_ent = upstream(11, "cuda").float(), upstream(11, "cuda").float()

    def run(x, t, rows=slice(None)):
        x = x.detach().clone().requires_grad_()
        lp, ent = rk.logprob_from_logits(x, t, temperature=0.7, return_entropy=True, backend=NATIVE)
        ((lp * g_lp[rows]).sum() + (ent * g_ent[rows]).sum()).backward()
        return lp, ent, x.grad

    first, second = run(logits, targets), run(logits, targets)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    sub = run(logits[3:5].flip(0), targets[3:5].flip(0), torch.tensor([4, 3], device="cuda"))
    for a, b in zip(sub, first):
        assert torch.equal(a, b[3:5].flip(0))


@gpu
def test_logprob_no_grad_builds_no_graph_and_fp64_is_refused(seed):
    logits, targets = make_logits(4, 50, torch.float32, "cuda")
    logits.requires_grad_()
    with torch.no_grad():
        lp, ent = rk.logprob_from_logits(logits, targets, return_entropy=True, backend=NATIVE)
    assert lp.grad_fn is None and ent.grad_fn is None
    with pytest.raises(rk.BackendUnavailableError, match="logits is float64"):
        rk.logprob_from_logits(logits.detach().double(), targets, backend=NATIVE)


@gpu
@pytest.mark.parametrize("n,v", [(1021, 151936), (2048, 128256)])
def test_logprob_realistic(seed, n, v):
    logits, targets = make_logits(n, v, torch.bfloat16, "cuda", scale=3.0)
    logits[:7] = logits[:7] * 30  # logits of magnitude ~100
    check_logprob(logits, targets, 0.7, backend=NATIVE)
    first = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend=NATIVE)
    again = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend=NATIVE)
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    half = rk.logprob_from_logits(logits[: n // 2], targets[: n // 2], temperature=0.7, backend=NATIVE)
    assert torch.equal(half, first[0][: n // 2])


# ============================================================== ratio_kl (GPU)


@gpu
@pytest.mark.parametrize("kl_type", KL_TYPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ratio_kl_values_and_gradients(seed, kl_type, dtype):
    check_ratio_kl(make_tokens((3, 53), "cuda", dtype), NATIVE, kl_type)


@gpu
def test_ratio_kl_one_output_default_ref_and_refusals(seed):
    t = make_tokens((71,), "cuda")
    lp = t["lp"].clone().requires_grad_()
    _, kl = rk.ratio_kl(lp, t["old"], backend=NATIVE)
    kl.sum().backward()
    lp64 = t["lp"].double().requires_grad_()
    kl_oracle(lp64, t["old"].double(), "k3").sum().backward()
    assert_close(lp.grad, lp64.grad, "gradient", torch.float32, "d logprob via kl against old")
    with pytest.raises(rk.BackendUnavailableError, match="old_logprob requires grad"):
        rk.ratio_kl(t["lp"], t["old"].clone().requires_grad_(), backend=NATIVE)


# ============================================================== policy_loss (GPU)


@gpu
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_aggregation_modes_and_dual_clip(seed, mode, dual):
    t = make_tokens((5, 37), "cuda")
    t["mask"][1] = False  # an empty sequence
    kl_type = KL_TYPE_CASES[(AGG_MODES.index(mode) * 2 + (dual is None)) % len(KL_TYPE_CASES)]
    check_policy_loss(t, NATIVE, mode=mode, c=dual, kl_type=kl_type)


@gpu
@pytest.mark.parametrize("kl_type", KL_TYPE_CASES)
def test_policy_loss_every_kl_type(seed, kl_type):
    check_policy_loss(make_tokens((3, 41), "cuda"), NATIVE, kl_type=kl_type, kl_coef=0.3, mode="seq-mean-token-mean")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # fp32: the direct-load path
def test_policy_loss_float_mask(seed, dtype):
    check_policy_loss(make_tokens((4, 33), "cuda", dtype, mask_kind="float"), NATIVE, mode="seq-mean-token-sum")


@gpu
@pytest.mark.parametrize("opts", [dict(ref=False, ent=False, is_w=False, kl_coef=0.0), dict(ent=False, c=None), dict(is_w=False, kl_coef=0.0)])
def test_policy_loss_optional_terms(seed, opts):
    check_policy_loss(make_tokens((2, 3, 21), "cuda"), NATIVE, **opts)


@gpu
@pytest.mark.parametrize("shape", [(2, 2100), (1, 9001), (1031, 7)])
def test_policy_loss_sequence_shapes(seed, shape):
    # several token blocks per sequence (the finish kernel joins them over lanes), one long
    # sequence, many short ones
    check_policy_loss(make_tokens(shape, "cuda"), NATIVE, mode="seq-mean-token-mean")


@gpu
def test_policy_loss_empty_mask_gives_zero_and_zero_gradients(seed):
    t = make_tokens((3, 9), "cuda")
    t["mask"][:] = False
    t["old"][0, 0] = float("nan")  # outside the mask: must not leak
    loss, metrics, g_lp, g_ent = check_policy_loss(t, NATIVE, mode="token-mean")
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    assert torch.equal(g_lp, torch.zeros_like(g_lp)) and torch.equal(g_ent, torch.zeros_like(g_ent))


@gpu
def test_policy_loss_non_contiguous_inputs(seed):
    t = make_tokens((4, 60), "cuda")
    strided = {k: v[:, ::2] for k, v in t.items()}
    contiguous = {k: v.contiguous() for k, v in strided.items()}
    g = upstream((), "cuda")
    a, b = run_policy_loss(strided, NATIVE, g), run_policy_loss(contiguous, NATIVE, g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    check_policy_loss(strided, NATIVE, mode="seq-mean-token-sum-norm")


@gpu
def test_policy_loss_deterministic(seed):
    t = make_tokens((6, 1500), "cuda")
    g = upstream((), "cuda")
    first = run_policy_loss(t, NATIVE, g, mode="seq-mean-token-mean")
    second = run_policy_loss(t, NATIVE, g, mode="seq-mean-token-mean")
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    for name in METRIC_NAMES:
        assert torch.equal(first[1][name], second[1][name])


@gpu
def test_policy_loss_refuses_what_it_does_not_serve(seed):
    t = make_tokens((2, 8), "cuda")
    with pytest.raises(rk.BackendUnavailableError, match="advantages requires grad"):
        rk.policy_loss(t["lp"], t["old"], t["adv"].clone().requires_grad_(), t["mask"], backend=NATIVE)
    with pytest.raises(rk.BackendUnavailableError, match="float64"):
        rk.policy_loss(t["lp"].double(), t["old"], t["adv"], t["mask"], backend=NATIVE)


@gpu
@pytest.mark.parametrize("shape,mode", [((2048, 512), "token-mean"), ((256, 4096), "seq-mean-token-mean"), ((997, 1031), "seq-mean-token-sum-norm")])
def test_policy_loss_realistic(seed, shape, mode):
    check_policy_loss(make_tokens(shape, "cuda"), NATIVE, mode=mode, kl_type="k3+")


@gpu
def test_losses_never_sync_with_the_host(seed):
    t = make_tokens((512, 1024), "cuda")
    g = upstream((), "cuda")
    rewards = t["adv"][:, 0].contiguous()

    def step():
        run_policy_loss(t, NATIVE, g)
        rk.group_advantages(rewards, group_size=8, backend=NATIVE)
        rk.ratio_kl(t["lp"], t["old"], t["ref"], backend=NATIVE)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ============================================================== group_advantages (GPU)


@gpu
@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False), ("dr_grpo", True), ("rloo", True)])
def test_group_advantages_by_size_and_by_index(seed, estimator, norm_by_std):
    rewards = torch.randn(48).cuda()
    kw = dict(estimator=estimator, norm_by_std=norm_by_std, eps=1e-6, backend=NATIVE)
    by_size = rk.group_advantages(rewards, group_size=8, **kw)
    assert by_size.dtype == torch.float32 and by_size.shape == (48,)
    expected = advantages_oracle(rewards, [list(range(g, g + 8)) for g in range(0, 48, 8)], estimator, norm_by_std, 1e-6)
    assert_close(by_size, expected, "reduction", torch.float32, "by size")
    index = torch.randint(0, 9, (48,))
    index[:2] = 100  # a group of two, and (likely) some of one
    index[2] = 101
    groups = [torch.nonzero(index == g).flatten().tolist() for g in index.unique()]
    by_index = rk.group_advantages(rewards, group_index=index.cuda(), **kw)
    assert_close(by_index, advantages_oracle(rewards, groups, estimator, norm_by_std, 1e-6), "reduction", torch.float32, "by index")
    ref = rk.group_advantages(rewards, group_index=index.cuda(), **{**kw, "backend": "torch"})
    assert_close(by_index, ref.double(), "reduction", torch.float32, "by index vs reference")
    assert torch.equal(by_index, rk.group_advantages(rewards, group_index=index.cuda().to(torch.int32), **kw))


@gpu
def test_group_advantages_large_groups_low_precision_and_fp64(seed):
    rewards = (torch.randn(2 * 1500) * 2 + 1).to(torch.bfloat16).cuda()  # groups span several strides of the block
    out = rk.group_advantages(rewards, group_size=1500, backend=NATIVE)
    groups = [list(range(0, 1500)), list(range(1500, 3000))]
    assert_close(out, advantages_oracle(rewards, groups, "grpo", True, 1e-6), "reduction", torch.bfloat16, "bf16 rewards")
    assert torch.equal(out, rk.group_advantages(rewards, group_size=1500, backend=NATIVE))
    r64 = torch.randn(300, dtype=torch.float64).cuda()
    out64 = rk.group_advantages(r64, group_size=30, estimator="rloo", backend=NATIVE)
    assert out64.dtype == torch.float64
    ref64 = rk.group_advantages(r64, group_size=30, estimator="rloo", backend="torch")
    assert_close(out64, ref64, "reduction", torch.float64, "fp64 rewards vs reference")


# ============================================================== custom ops, torch.compile, auto (GPU)


@gpu
def test_custom_ops_pass_opcheck(seed):
    """Fake impls, schemas and autograd registrations agree with the real kernels."""
    logits, targets = make_logits(4, 40, torch.float32, "cuda")
    ops = torch.ops.rl_kernel
    torch.library.opcheck(ops.native_logprob_from_logits, (logits.requires_grad_(), targets, 0.8, -100, True))
    t = make_tokens((3, 11), "cuda")
    torch.library.opcheck(ops.native_ratio_kl, (t["lp"].requires_grad_(), t["old"], t["ref"], "k3"))
    torch.library.opcheck(
        ops.native_policy_loss,
        (t["lp"], t["old"], t["adv"], t["mask"], t["ref"], t["ent"].requires_grad_(), t["is_w"], 0.2, 0.28, 3.0, "k3+", 0.1, 0.01, "seq-mean-token-mean"),
    )
    torch.library.opcheck(ops.native_group_advantages, (torch.randn(12, device="cuda"), 4, None, "grpo", True, 1e-6))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_step_fullgraph(seed, dtype):
    torch._dynamo.reset()
    check_compiled_equals_eager(NATIVE, "inductor", "cuda", dtype)


@gpu
def test_auto_follows_the_measured_order_on_this_gpu(seed):
    from rl_kernel_core import native

    major, minor = torch.cuda.get_device_capability()
    measured = native.MEASURED_PREFERENCE.get(f"{major}.{minor}", {})
    logits, targets = make_logits(3, 64, torch.float32, "cuda")
    rk.logprob_from_logits(logits, targets)
    expected = measured.get("logprob_from_logits", ("native", "triton", "torch"))[0]
    assert dispatch.explain("logprob_from_logits").backend == expected
    t = make_tokens((2, 8), "cuda")
    rk.policy_loss(t["lp"], t["old"], t["adv"], t["mask"])
    assert dispatch.explain("policy_loss").backend == measured.get("policy_loss", ("native",))[0]


@gpu
def test_ahead_of_time_build_succeeds_and_reuses_the_cache():
    proc = _aot_build()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rl-kernel native: built " in proc.stdout


# ============================================================== linear_logprob (cuBLAS chunk + CUDA pass)

# N prime, D not a multiple of 64; V odd (not a multiple of the 4-wide fp32 groups: the
# element-wise path) and the Qwen2 / Llama-3 heads (vector path)
LINEAR_SHAPES = [dict(n=1031, d=896, v=32003), dict(n=257, d=896, v=151936), dict(n=131, d=4096, v=128256)]
LINEAR_CHUNK_ROWS = 256  # several chunks and a zero-padded last chunk at every shape


def run_linear(hidden, weight, bias, targets, temperature, g_lp=None, g_ent=None, backend=NATIVE):
    """``(logprob, entropy, grads of (hidden, weight[, bias]))`` through the public op (no grads without ``g_lp``)."""
    h, w, b = leaves(hidden, weight, bias)
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=temperature, return_entropy=True, backend=backend)
    if g_lp is None:
        return lp, ent, ()
    loss = (lp * g_lp.float()).sum() + (ent * g_ent.float()).sum()
    return lp, ent, torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])


@gpu
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: f"n{s['n']}-d{s['d']}-v{s['v']}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_linear_logprob_values_entropy_and_gradients(seed, tune, shape, dtype, temperature, with_bias):
    small_chunks(tune, LINEAR_CHUNK_ROWS, shape["v"])
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=dtype, bias=with_bias)
    g_lp, g_ent = upstream(shape["n"], "cuda"), upstream(shape["n"], "cuda")
    lp, ent, grads = run_linear(hidden, weight, bias, targets, temperature, g_lp, g_ent)
    assert dispatch.explain("linear_logprob").backend == NATIVE
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    assert_close(lp, ref_lp, "logprob", dtype, f"logprob {shape}")
    assert_close(ent, ref_ent, "logprob", dtype, f"entropy {shape}")
    ignored = targets == -100
    assert ignored.any() and torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    want = linear_oracle_grads(hidden, weight, bias, targets, temperature, g_lp, g_ent)
    assert len(grads) == len(want)
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, want):
        assert got.dtype == dtype
        assert_close(got, ref, "gradient", dtype, f"d{name} {shape}")
    assert torch.all(grads[0][ignored] == 0)


@gpu
def test_linear_logprob_fp16_int32_targets_logprob_only_gradient(seed, tune):
    shape = LINEAR_SHAPES[0]
    small_chunks(tune, LINEAR_CHUNK_ROWS, shape["v"])
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=torch.float16)
    g_lp = upstream(shape["n"], "cuda")
    h, w, b = leaves(hidden, weight, bias)
    lp = rk.linear_logprob(h, w, targets.to(torch.int32), bias=b, temperature=0.7, backend=NATIVE)
    grads = torch.autograd.grad((lp * g_lp.float()).sum(), (h, w, b))
    assert_close(lp, linear_oracle(hidden, weight, bias, targets, 0.7)[0], "logprob", torch.float16, "logprob")
    want = linear_oracle_grads(hidden, weight, bias, targets, 0.7, g_lp, torch.zeros_like(g_lp))
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, want):
        assert_close(got, ref, "gradient", torch.float16, f"d{name}")


@gpu
def test_linear_logprob_large_magnitude_logits(seed):
    n, d, v = 257, 896, 32003
    hidden, weight, _, targets = make_inputs("cuda", n, d, v, torch.bfloat16, bias=False, scale=33.0)
    assert (hidden.double() @ weight.double().T).abs().max() > 100
    g_lp, g_ent = upstream(n, "cuda"), upstream(n, "cuda")
    lp, ent, grads = run_linear(hidden, weight, None, targets, 1.0, g_lp, g_ent)
    ref_lp, ref_ent = linear_oracle(hidden, weight, None, targets, 1.0)
    assert_close(lp, ref_lp, "logprob", torch.bfloat16, "logprob")
    assert_close(ent, ref_ent, "logprob", torch.bfloat16, "entropy")
    want = linear_oracle_grads(hidden, weight, None, targets, 1.0, g_lp, g_ent)
    for name, got, ref in zip(("hidden", "weight"), grads, want):
        assert_close(got, ref, "gradient", torch.bfloat16, f"d{name}")


@gpu
@pytest.mark.parametrize("shape", LINEAR_SHAPES[:2], ids=lambda s: f"v{s['v']}")
def test_linear_logprob_deterministic_and_batch_invariant(seed, tune, shape):
    """Bitwise: two runs agree, and a row's log-prob, entropy and dh do not depend on N or on the other rows."""
    rows = LINEAR_CHUNK_ROWS
    small_chunks(tune, rows, shape["v"])
    n = shape["n"]
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(n, "cuda"), upstream(n, "cuda")
    full = run_linear(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
    again = run_linear(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
    for a, b in zip(full[:2] + tuple(full[2]), again[:2] + tuple(again[2])):
        assert torch.equal(a, b)
    other = make_inputs("cuda", **shape, dtype=torch.bfloat16)
    for m in (1, min(rows + 3, n - 1)):  # m rows kept, the other n - m replaced
        h2 = torch.cat([hidden[:m], other[0][: n - m]])
        t2 = torch.cat([targets[:m], other[3][: n - m]])
        for take in (m, n):
            part = run_linear(h2[:take], weight, bias, t2[:take], 0.8, g_lp[:take], g_ent[:take])
            assert torch.equal(part[0][:m], full[0][:m]), f"logprob rows, N={take}"
            assert torch.equal(part[1][:m], full[1][:m]), f"entropy rows, N={take}"
            assert torch.equal(part[2][0][:m], full[2][0][:m]), f"dhidden rows, N={take}"
    with torch.no_grad():  # the forward-only path gives the same bits
        lp, ent = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=0.8, return_entropy=True, backend=NATIVE)
    assert torch.equal(lp, full[0]) and torch.equal(ent, full[1])


@gpu
def test_linear_logprob_no_grad_saves_nothing_and_refusals(seed):
    from rl_kernel_core.native import linear_logprob as native_linear

    shape = LINEAR_SHAPES[0]
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=torch.bfloat16)
    h, w, b = leaves(hidden, weight, bias)
    with torch.no_grad():
        lp, ent = native_linear.linear_logprob(h, w, targets, b, 0.7, -100, False, None)
    assert ent is None and lp.grad_fn is None and not lp.requires_grad
    with_grad, _ = native_linear.linear_logprob(h, w, targets, b, 0.7, -100, False, None)
    assert with_grad.grad_fn is not None and torch.equal(lp, with_grad.detach())
    with pytest.raises(rk.BackendUnavailableError, match="hidden is float64"):
        rk.linear_logprob(hidden.double(), weight.double(), targets, backend=NATIVE)
    reason = native_linear._supports(hidden, weight, targets, None, 1.0, -100, False, object())
    assert reason is not None and "tp_group" in reason
    # no measurement of the native linear_logprob yet: auto runs triton
    rk.linear_logprob(hidden, weight, targets)
    assert dispatch.explain("linear_logprob").backend == "triton"

