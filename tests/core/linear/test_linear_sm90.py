"""The Hopper passes of linear_logprob's gemm route (``native/csrc/linear_sm90.cu``): bit for bit
the Triton statistics and gradient passes, so ``LinearTuning.sm90`` changes the time and never the
bits; they refuse what they cannot read. The selection rule and the build flags are checked on CPU;
the kernels on a compute capability 9.0 GPU."""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch, native_build
from rl_kernel_core.linear import chunks as linear_chunks
from rl_kernel_core.linear import triton_grad, triton_sm90, triton_stats

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not _HOPPER, reason="the sm_90a kernel needs a compute capability 9.0 device")


def test_tuning_refuses_an_unknown_sm90():
    with pytest.raises(ValueError, match="sm90 must be 'auto', 'all' or 'off', got 'on'"):
        linear_chunks.LinearTuning(sm90="on")


def test_sm90_passes_are_never_taken_off_a_gpu(tune):
    tune(sm90="all")
    h = torch.randn(8, 64).bfloat16()
    w = torch.randn(300, 64).bfloat16()
    assert triton_sm90.serves("stats", h, w, None) is None
    assert triton_sm90.serves("grad", h, w, None) is None


@pytest.mark.parametrize(
    "arch_list, flags",
    [("9.0a", ["-DRLK_SM90A_BUILT"]), ("8.0;9.0a", ["-DRLK_SM90A_BUILT"]), ("9.0", []), ("8.0 9.0", [])],
)
def test_sm90a_flags_follow_the_arch_list(monkeypatch, arch_list, flags):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    assert native_build.sm90a_flags("linear_logprob") == flags
    assert native_build.sm90a_flags("loss") == []
    assert "linear_sm90.cu" in native_build.GROUPS["linear_logprob"]


def _kernel_cases(test):
    """On a Hopper GPU, over bf16 and fp16, with and without a bias, at a temperature and at 1 (whose
    epilogue skips the scaling), and three shapes: rows not a multiple of the 128-row block, D not a
    multiple of the 64-wide K block, a ragged last vocab tile (whose epilogue checks the columns) and
    an odd V (whose 16-bit rows allow no paired stores)."""
    test = pytest.mark.parametrize("n, d, v", [(1000, 1024, 1000), (300, 200, 777), (513, 4096, 5000)])(test)
    test = pytest.mark.parametrize("temperature", [0.7, 1.0])(test)
    test = pytest.mark.parametrize("bias", [False, True])(test)
    test = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])(test)
    return pytest.mark.gpu(hopper(test))


def _inputs(n, d, v, dtype, bias, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.15).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    t[1] = v - 1  # a target in the last, partial vocab tile
    return h, w, b, t


def _stats(h, w, b, t, want_entropy, mode, keep=False, temperature=0.7):
    n, v = h.shape[0], w.shape[0]
    n_tiles = (v + 255) // 256
    partials = torch.full((3, n, n_tiles), float("nan"), device="cuda")
    ztgt = torch.full((n,), float("nan"), device="cuda")
    logits = torch.full((n, v), float("nan"), device="cuda") if keep else None
    with linear_chunks.tuned(sm90=mode):
        triton_stats.launch_stats(h, w, b, t, n, 1 / temperature, -100, partials, ztgt, False, want_entropy, logits)
    kept = partials if want_entropy else partials[:2]
    return (kept, ztgt[t != -100]) + ((logits,) if keep else ())


@_kernel_cases
def test_sm90_statistics_have_the_triton_pass_bits(monkeypatch, dtype, bias, temperature, n, d, v):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, b, t = _inputs(n, d, v, dtype, bias)
    assert triton_sm90.serves("stats", h, w, b) is not None
    for want_entropy in (True, False):
        ours, ours_z = _stats(h, w, b, t, want_entropy, "all", temperature=temperature)
        ref, ref_z = _stats(h, w, b, t, want_entropy, "off", temperature=temperature)
        assert torch.equal(ours, ref), f"tile statistics differ (entropy={want_entropy})"
        assert torch.equal(ours_z, ref_z), f"target logits differ (entropy={want_entropy})"
    # the raw logits kept for a gradient pass that reads them (the fused loss from D=2048)
    ours, _, ours_logits = _stats(h, w, b, t, True, "all", keep=True, temperature=temperature)
    ref, _, ref_logits = _stats(h, w, b, t, True, "off", keep=True, temperature=temperature)
    assert torch.equal(ours, ref) and torch.equal(ours_logits, ref_logits)
    # a row's statistics do not depend on the other rows
    alone, alone_z = _stats(h[:77].contiguous(), w, b, t[:77].contiguous(), True, "all", temperature=temperature)
    full, _ = _stats(h, w, b, t, True, "all", temperature=temperature)
    assert torch.equal(alone, full[:, :77])


def _dl(h, w, b, t, lse, ent, g_lp, g_ent, mode, temperature):
    dl = torch.full((h.shape[0], w.shape[0]), float("nan"), device="cuda").to(h.dtype)
    with linear_chunks.tuned(sm90=mode):
        triton_grad.launch_grad(h, w, b, t, h.shape[0], 1 / temperature, -100, lse, ent, g_lp, g_ent, dl, False)
    return dl


@_kernel_cases
def test_sm90_gradient_has_the_triton_pass_bits(monkeypatch, dtype, bias, temperature, n, d, v):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, b, t = _inputs(n, d, v, dtype, bias)
    lp, ent = rk.linear_logprob(
        h.float(),
        w.float(),
        t,
        bias=None if b is None else b.float(),
        temperature=temperature,
        return_entropy=True,
        backend="torch",
    )
    lse = torch.randn(n, device="cuda") + 3.0  # any saved lse: the pass is elementwise in it
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    assert triton_sm90.serves("grad", h, w, b) is not None
    for with_entropy in (True, False):
        e, ge = (ent.contiguous(), g_ent) if with_entropy else (None, None)
        ours = _dl(h, w, b, t, lse, e, g_lp, ge, "all", temperature)
        ref = _dl(h, w, b, t, lse, e, g_lp, ge, "off", temperature)
        assert not ours.isnan().any()
        assert torch.equal(ours, ref), f"dl differs (entropy={with_entropy})"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_linear_logprob_has_the_same_bits_with_and_without_the_sm90_passes(monkeypatch, temperature):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, b, t = _inputs(700, 896, 3000, torch.bfloat16, True, seed=1)
    outs = {}
    for mode in ("all", "off"):
        hh, ww, bb = (x.detach().clone().requires_grad_() for x in (h, w, b))
        with linear_chunks.tuned(sm90=mode):
            lp, ent = rk.linear_logprob(
                hh, ww, t, bias=bb, temperature=temperature, return_entropy=True, backend="triton"
            )
            (lp.sum() + 0.1 * ent.sum()).backward()
        outs[mode] = (lp, ent, hh.grad, ww.grad, bb.grad)
    for ours, ref in zip(outs["all"], outs["off"]):
        assert torch.equal(ours, ref)


@pytest.mark.gpu
@hopper
def test_explain_names_the_hopper_passes_where_they_ran(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, b, t = _inputs(700, 896, 3000, torch.bfloat16, True, seed=1)
    for mode, route in (("all", "triton+sm90"), ("off", "triton")):
        with linear_chunks.tuned(sm90=mode), torch.no_grad():
            rk.linear_logprob(h, w, t, bias=b, backend="triton")
        assert dispatch.explain("linear_logprob").route == route, mode


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [1024, 2048])  # from D=2048 the statistics pass keeps the logits for the gradient pass
def test_fused_loss_has_the_same_bits_with_and_without_the_sm90_passes(monkeypatch, d):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, _, t = _inputs(4 * 75, d, 1000, torch.bfloat16, False, seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    old = -torch.rand(4, 75, device="cuda", generator=g) * 2.0 - 5.0
    adv = torch.randn(4, 75, device="cuda", generator=g)
    mask = torch.rand(4, 75, device="cuda", generator=g) < 0.9
    outs = {}
    for mode in ("all", "off"):
        hh, ww = (x.detach().clone().requires_grad_() for x in (h, w))
        with linear_chunks.tuned(sm90=mode):
            loss = rk.fused_linear_policy_loss(
                hh.view(4, 75, d), ww, t.clamp_min(0).view(4, 75), old, adv, mask, entropy_coef=0.01, backend="triton"
            )[0]
            loss.backward()
        outs[mode] = (loss, hh.grad, ww.grad)
    for ours, ref in zip(outs["all"], outs["off"]):
        assert torch.equal(ours, ref)


@pytest.mark.gpu
@hopper
def test_sm90_kernel_refuses_what_it_cannot_read(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, b, t = _inputs(64, 256, 512, torch.bfloat16, False)
    ext = triton_sm90.serves("stats", h, w, b)
    assert ext is not None
    partials = torch.empty(3, 64, 2, device="cuda")
    ztgt = torch.empty(64, device="cuda")
    lse, g = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    dl = torch.empty(64, 512, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="hidden and weight must both be bf16 or both fp16"):
        ext.linear_stats_sm90(h.float(), w.float(), None, t, 64, 1.0, -100, partials, ztgt, True, None, 16)
    with pytest.raises(RuntimeError, match=r"hidden must be a 2-d CUDA tensor with unit inner stride.*got \[256, 64\]"):
        ext.linear_stats_sm90(h.t(), w, None, t, 64, 1.0, -100, partials, ztgt, True, None, 16)
    with pytest.raises(
        RuntimeError, match=r"partials must be fp32 \[3, >=64, 2\] with unit inner stride, got \[3, 64, 1\]"
    ):
        ext.linear_stats_sm90(h, w, None, t, 64, 1.0, -100, partials[:, :, :1], ztgt, True, None, 16)
    with pytest.raises(RuntimeError, match=r"keep must be fp32 \[>=64, 512\] with unit inner stride, got \[64, 511\]"):
        ext.linear_stats_sm90(
            h, w, None, t, 64, 1.0, -100, partials, ztgt, True, torch.empty(64, 511, device="cuda"), 16
        )
    with pytest.raises(RuntimeError, match=r"dl must be a \[>=64, 512\] tensor of weight's dtype"):
        ext.linear_grad_sm90(h, w, None, t, 64, 1.0, -100, lse, None, g, None, dl.float(), 16)
    with pytest.raises(RuntimeError, match="entropy and grad_entropy must be given together"):
        ext.linear_grad_sm90(h, w, None, t, 64, 1.0, -100, lse, lse, g, None, dl, 16)
    with pytest.raises(
        RuntimeError, match="grad_logprob must be a contiguous fp32 CUDA tensor of at least 64 elements, got \\[32\\]"
    ):
        ext.linear_grad_sm90(h, w, None, t, 64, 1.0, -100, lse, None, g[:32], None, dl, 16)
    # the Python rule sends a misaligned operand or another tile to the Triton pass instead
    assert triton_sm90.serves("stats", h[:, 1:], w[:, 1:], None) is None
    with linear_chunks.tuned(gemm_tiles=linear_chunks.TileConfig(128, 128, 64, num_warps=8, tma=True, persistent=True)):
        assert triton_sm90.serves("stats", h, w, None) is None
        assert triton_sm90.serves("grad", h, w, None) is not None
    # the default takes the kernels at every D, and "off" never
    wide = torch.randn(512, 4096, device="cuda").bfloat16()
    hw = torch.randn(64, 4096, device="cuda").bfloat16()
    assert triton_sm90.serves("stats", hw, wide, None) is not None
    with linear_chunks.tuned(sm90="off"):
        assert triton_sm90.serves("stats", hw, wide, None) is None
