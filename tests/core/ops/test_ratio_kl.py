"""Triton backends of logprob_from_logits, ratio_kl, policy_loss and group_advantages.

Every op is checked against an fp64 formula written here (log-softmax of the upcast logits, verl's
surrogate and aggregation written as loops, group statistics per group) and against the
reference backend; tolerances come from rl_kernel_core.contract. Gradients use non-uniform
upstream gradients. Determinism and row independence are asserted bitwise.

Where they run: on a CUDA machine the small-shape tests run compiled on the GPU, and the
``gpu``-marked tests add realistic shapes. Without CUDA they run on CPU under the Triton
interpreter, which Triton binds when ``triton.language`` is first imported (``tl.sum``/``tl.max``
are themselves jit functions), so ``TRITON_INTERPRET=1`` must be set before anything imports
Triton. When this module is collected in a process where that did not happen,
``test_cpu_suite_under_interpreter`` re-runs it in a child pytest with ``TRITON_INTERPRET=1`` and
the in-process tests skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss import METRIC_NAMES
from oracles import (
    AGG_MODES, KL_TYPE_CASES, advantages_oracle, check_logprob, check_policy_loss, check_ratio_kl, kl_oracle, logprob_oracle, make_logits, make_tokens, run_policy_loss, upstream,
)


def _interpreter_bound() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


DEVICE = "cpu" if _interpreter_bound() else ("cuda" if torch.cuda.is_available() else None)


@pytest.fixture(autouse=True)
def _triton_runs_here(request):
    if DEVICE is None and request.node.name != "test_cpu_suite_under_interpreter":
        pytest.skip("Triton is not bound to its interpreter in this process: test_cpu_suite_under_interpreter runs this")


@pytest.mark.skipif(DEVICE is not None, reason="the suite runs in this process")
def test_cpu_suite_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"interpreted suite failed (exit {proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    skipped = re.search(r"(\d+) skipped", summary)
    # only this test may skip there: every other test must have run under the interpreter
    assert passed and int(passed.group(1)) > 0 and (skipped is None or int(skipped.group(1)) <= 1), summary




# ============================================================== logprob_from_logits








@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_values_and_gradients(seed, dtype, temperature):
    logits, targets = make_logits(6, 300, dtype, DEVICE)
    check_logprob(logits, targets, temperature)


def test_logprob_several_vocab_blocks_partial_last(seed):
    # V > 4096: the online log-sum-exp crosses blocks; the last block is partial
    logits, targets = make_logits(3, 4096 + 37, torch.bfloat16, DEVICE)
    check_logprob(logits, targets, 0.7)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_logprob_large_magnitude_and_all_equal_logits(seed, with_entropy):
    logits, targets = make_logits(5, 257, torch.float32, DEVICE, ignore_frac=0.0)
    logits[0] = torch.where(torch.rand(257, device=DEVICE) < 0.5, -100.0, 100.0)
    logits[1] = 100.0 * torch.rand(257, device=DEVICE)
    logits[2] = -100.0
    logits[3] = 3.25
    check_logprob(logits, targets, 0.7, with_entropy)


def test_logprob_gradient_through_entropy_only_and_logprob_only(seed):
    logits, targets = make_logits(4, 129, torch.float32, DEVICE)
    x = logits.clone().requires_grad_()
    x64 = logits.double().requires_grad_()
    _, ent = rk.logprob_from_logits(x, targets, return_entropy=True, backend="triton")
    ent.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[1].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via entropy")
    x.grad, x64.grad = None, None
    lp, _ = rk.logprob_from_logits(x, targets, return_entropy=True, backend="triton")
    lp.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[0].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via logprob")


def test_logprob_ignored_rows_are_zero_with_zero_gradient(seed):
    logits, targets = make_logits(5, 64, torch.float32, DEVICE, ignore_frac=0.0)
    targets[1:3] = 7  # a custom ignore id that is also a valid vocabulary id elsewhere
    lp, ent, grad = check_logprob(logits, targets, 1.0, True, ignore_index=7)
    assert torch.equal(lp[1:3], torch.zeros(2, device=DEVICE)) and torch.equal(ent[1:3], torch.zeros(2, device=DEVICE))
    assert torch.equal(grad[1:3], torch.zeros_like(grad[1:3]))


def test_logprob_row_strided_logits_and_leading_dims(seed):
    base = (torch.randn(2, 3, 90) * 3).to(DEVICE)
    logits = base[..., 5:85]  # rows strided (90), unit stride along V: passed without a copy
    targets = torch.randint(0, 80, (2, 3), device=DEVICE)
    x = logits.detach().clone().requires_grad_()
    lp_strided = rk.logprob_from_logits(logits, targets, backend="triton")
    lp_contig = rk.logprob_from_logits(x, targets, backend="triton")
    assert lp_strided.shape == (2, 3)
    assert torch.equal(lp_strided, lp_contig)
    assert_close(lp_strided, logprob_oracle(logits, targets, 1.0, -100)[0], "logprob", torch.float32, "strided logprob")


def test_logprob_matches_reference_backend(seed):
    logits, targets = make_logits(7, 333, torch.bfloat16, DEVICE)
    ours = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend="triton")
    ref = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend="torch")
    for a, b, name in zip(ours, ref, ("logprob", "entropy")):
        assert_close(a, b.double(), "logprob", torch.bfloat16, name)


def test_logprob_deterministic_and_row_independent(seed):
    logits, targets = make_logits(9, 4096 + 100, torch.bfloat16, DEVICE)
    g_lp, g_ent = upstream(9, DEVICE).float(), upstream(9, DEVICE).float()

    def run(x, t, rows=slice(None)):
        x = x.detach().clone().requires_grad_()
        lp, ent = rk.logprob_from_logits(x, t, temperature=0.7, return_entropy=True, backend="triton")
        ((lp * g_lp[rows]).sum() + (ent * g_ent[rows]).sum()).backward()
        return lp, ent, x.grad

    first, second = run(logits, targets), run(logits, targets)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    # the old/ref passes skip the entropy and the gradient: the same log-prob bits (ratio exactly 1)
    with torch.no_grad():
        assert torch.equal(rk.logprob_from_logits(logits, targets, temperature=0.7, backend="triton"), first[0])
    # a row's bits do not depend on N or on the other rows
    sub = run(logits[3:5].flip(0), targets[3:5].flip(0), torch.tensor([4, 3], device=DEVICE))
    for a, b in zip(sub, first):
        assert torch.equal(a, b[3:5].flip(0))


def test_logprob_no_grad_builds_no_graph(seed):
    logits, targets = make_logits(4, 50, torch.float32, DEVICE)
    logits.requires_grad_()
    with torch.no_grad():
        lp, ent = rk.logprob_from_logits(logits, targets, return_entropy=True, backend="triton")
    assert lp.grad_fn is None and ent.grad_fn is None


def test_logprob_triton_refuses_fp64_by_name(seed):
    logits, targets = make_logits(3, 20, torch.float64, DEVICE)
    with pytest.raises(rk.BackendUnavailableError, match="logits is float64"):
        rk.logprob_from_logits(logits, targets, backend="triton")


# ============================================================== ratio_kl / policy_loss oracles (fp64)
















# ============================================================== ratio_kl


@pytest.mark.parametrize("kl_type", KL_TYPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ratio_kl_values_and_gradients(seed, kl_type, dtype):
    check_ratio_kl(make_tokens((3, 50), DEVICE, dtype), "triton", kl_type)


def test_ratio_kl_gradient_of_one_output_and_default_ref(seed):
    t = make_tokens((70,), DEVICE)
    lp = t["lp"].clone().requires_grad_()
    ratio, kl = rk.ratio_kl(lp, t["old"], backend="triton")
    kl.sum().backward()
    lp64 = t["lp"].double().requires_grad_()
    kl_oracle(lp64, t["old"].double(), "k3").sum().backward()
    assert_close(lp.grad, lp64.grad, "gradient", torch.float32, "d logprob via kl against old")


def test_ratio_kl_refuses_gradients_it_does_not_form(seed):
    t = make_tokens((10,), DEVICE)
    with pytest.raises(rk.BackendUnavailableError, match="old_logprob requires grad"):
        rk.ratio_kl(t["lp"], t["old"].requires_grad_(), backend="triton")


# ============================================================== policy_loss


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_aggregation_modes_and_dual_clip(seed, mode, dual):
    t = make_tokens((5, 37), DEVICE)
    t["mask"][1] = False  # an empty sequence
    kl_type = KL_TYPE_CASES[(AGG_MODES.index(mode) * 2 + (dual is None)) % len(KL_TYPE_CASES)]
    check_policy_loss(t, mode=mode, c=dual, kl_type=kl_type)


@pytest.mark.parametrize("kl_type", KL_TYPE_CASES)
def test_policy_loss_every_kl_type(seed, kl_type):
    check_policy_loss(make_tokens((3, 40), DEVICE), kl_type=kl_type, kl_coef=0.3, mode="seq-mean-token-mean")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_policy_loss_low_precision_inputs_float_mask(seed, dtype):
    check_policy_loss(make_tokens((4, 33), DEVICE, dtype, mask_kind="float"), mode="seq-mean-token-sum")


@pytest.mark.parametrize("opts", [dict(ref=False, ent=False, is_w=False, kl_coef=0.0), dict(ent=False, c=None), dict(is_w=False, kl_coef=0.0)])
def test_policy_loss_optional_terms(seed, opts):
    check_policy_loss(make_tokens((2, 3, 21), DEVICE), **opts)


def test_policy_loss_long_sequences_several_blocks(seed):
    # T > 1024: several partial sums per sequence, the last block partial
    check_policy_loss(make_tokens((2, 2100), DEVICE), mode="seq-mean-token-mean")


def test_policy_loss_empty_mask_gives_zero_and_zero_gradients(seed):
    t = make_tokens((3, 9), DEVICE)
    t["mask"][:] = False
    t["old"][0, 0] = float("nan")  # outside the mask: must not leak
    loss, metrics, g_lp, g_ent = check_policy_loss(t, mode="token-mean")
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    assert torch.equal(g_lp, torch.zeros_like(g_lp)) and torch.equal(g_ent, torch.zeros_like(g_ent))


def test_policy_loss_non_contiguous_inputs(seed):
    t = make_tokens((4, 60), DEVICE)
    strided = {k: v[:, ::2] for k, v in t.items()}
    contiguous = {k: v.contiguous() for k, v in strided.items()}
    g = upstream((), DEVICE)
    a, b = run_policy_loss(strided, "triton", g), run_policy_loss(contiguous, "triton", g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    check_policy_loss(strided, mode="seq-mean-token-sum-norm")


def test_policy_loss_deterministic(seed):
    t = make_tokens((6, 1500), DEVICE)
    g = upstream((), DEVICE)
    first = run_policy_loss(t, "triton", g, mode="seq-mean-token-mean")
    second = run_policy_loss(t, "triton", g, mode="seq-mean-token-mean")
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    for name in METRIC_NAMES:
        assert torch.equal(first[1][name], second[1][name])


def test_policy_loss_refuses_what_it_does_not_serve(seed):
    t = make_tokens((2, 8), DEVICE)
    with pytest.raises(rk.BackendUnavailableError, match="advantages requires grad"):
        rk.policy_loss(t["lp"], t["old"], t["adv"].requires_grad_(), t["mask"], backend="triton")
    with pytest.raises(rk.BackendUnavailableError, match="float64"):
        rk.policy_loss(t["lp"].double(), t["old"], t["adv"].detach(), t["mask"], backend="triton")


# ============================================================== group_advantages




@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False), ("dr_grpo", True), ("rloo", True)])
def test_group_advantages_by_size_and_by_index(seed, estimator, norm_by_std):
    rewards = torch.randn(48).to(DEVICE)
    kw = dict(estimator=estimator, norm_by_std=norm_by_std, eps=1e-6, backend="triton")
    by_size = rk.group_advantages(rewards, group_size=8, **kw)
    assert by_size.dtype == torch.float32 and by_size.shape == (48,)
    assert_close(by_size, advantages_oracle(rewards, [list(range(g, g + 8)) for g in range(0, 48, 8)], estimator, norm_by_std, 1e-6), "reduction", torch.float32, "by size")
    index = torch.randint(0, 9, (48,))
    index[:2] = 100  # a group of two, and (likely) some of one
    index[2] = 101
    groups = [torch.nonzero(index == g).flatten().tolist() for g in index.unique()]
    by_index = rk.group_advantages(rewards, group_index=index.to(DEVICE), **kw)
    expected = advantages_oracle(rewards, groups, estimator, norm_by_std, 1e-6)
    assert_close(by_index, expected, "reduction", torch.float32, "by index")
    ref = rk.group_advantages(rewards, group_index=index.to(DEVICE), **{**kw, "backend": "torch"})
    assert_close(by_index, ref.double(), "reduction", torch.float32, "by index vs reference")
    assert torch.equal(by_index, rk.group_advantages(rewards, group_index=index.to(DEVICE), **kw))


def test_group_advantages_large_groups_bf16_rewards(seed):
    rewards = (torch.randn(2 * 1500) * 2 + 1).to(torch.bfloat16).to(DEVICE)  # groups span several blocks
    out = rk.group_advantages(rewards, group_size=1500, backend="triton")
    assert_close(out, advantages_oracle(rewards, [list(range(0, 1500)), list(range(1500, 3000))], "grpo", True, 1e-6), "reduction", torch.bfloat16, "advantages")


# ============================================================== custom ops and torch.compile


def test_custom_ops_pass_opcheck(seed):
    """Fake impls, schemas and autograd registrations agree with the real kernels."""
    logits, targets = make_logits(4, 40, torch.float32, DEVICE)
    ops = torch.ops.rl_kernel
    torch.library.opcheck(ops.triton_logprob_from_logits, (logits.requires_grad_(), targets, 0.8, -100, True))
    t = make_tokens((3, 11), DEVICE)
    torch.library.opcheck(ops.triton_ratio_kl, (t["lp"].requires_grad_(), t["old"], t["ref"], "k3"))
    torch.library.opcheck(
        ops.triton_policy_loss,
        (t["lp"], t["old"], t["adv"], t["mask"], t["ref"], t["ent"].requires_grad_(), t["is_w"], 0.2, 0.28, 3.0, "k3+", 0.1, 0.01, "seq-mean-token-mean"),
    )
    torch.library.opcheck(ops.triton_group_advantages, (torch.randn(12, device=DEVICE), 4, None, "grpo", True, 1e-6))


def test_eager_path_matches_custom_op_bitwise(seed):
    """Eager calls take a torch.autograd.Function over the kernels, torch.compile the custom op:
    same values and gradients, bit for bit; neither backward can be differentiated again (the
    eager one refuses create_graph=True at once, naming the op)."""
    from rl_kernel_core.triton import loss as triton_loss

    t = make_tokens((3, 11), DEVICE)
    args = (t["old"], t["adv"], t["mask"], t["ref"], None, t["is_w"], 0.2, 0.28, 3.0, "k3+", 0.1, 0.0, "seq-mean-token-mean")
    outs = []
    for op in (torch.ops.rl_kernel.triton_policy_loss, triton_loss._policy_loss_op):
        lp = t["lp"].detach().clone().requires_grad_()
        loss, metrics, _, _ = op(lp, *args)
        (grad,) = torch.autograd.grad(loss, (lp,), retain_graph=True)
        outs.append((loss, metrics, grad))
        scale = torch.ones((), device=DEVICE, requires_grad=True)  # an upstream gradient that requires grad
        if op is triton_loss._policy_loss_op:
            with pytest.raises(RuntimeError, match="rl_kernel::triton_policy_loss has no double backward"):
                torch.autograd.grad(loss * scale, (lp,), create_graph=True)
        else:
            (grad2,) = torch.autograd.grad(loss * scale, (lp,), create_graph=True)
            with pytest.raises(RuntimeError, match="no autograd formula was registered"):
                grad2.sum().backward()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_compiled_loss_step_fullgraph_triton(seed):
    """logprob_from_logits -> ratio_kl -> policy_loss under torch.compile(fullgraph=True) (a graph break raises)."""
    logits, targets = make_logits(2 * 12, 96, torch.float32, DEVICE)
    logits, targets = logits.view(2, 12, 96), targets.view(2, 12)
    t = make_tokens((2, 12), DEVICE)

    def step(x):
        lp, ent = rk.logprob_from_logits(x, targets, temperature=0.9, return_entropy=True, backend="triton")
        ratio, kl = rk.ratio_kl(lp, t["old"], t["ref"], backend="triton")
        loss, metrics = rk.policy_loss(lp, t["old"], t["adv"], t["mask"] & (targets != -100), ref_logprob=t["ref"], kl_coef=0.1,
                                       entropy=ent, entropy_coef=0.01, clip_ratio_c=3.0, backend="triton")
        return loss + 0.5 * (ratio * kl).mean(), metrics

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # inductor's CPU C++ build is too slow for CI
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    results = []
    for fn in (step, compiled):
        x = logits.clone().requires_grad_()
        loss, metrics = fn(x)
        loss.backward()
        results.append((loss.detach(), metrics, x.grad))
    (eager_loss, eager_m, eager_g), (comp_loss, comp_m, comp_g) = results
    assert_close(comp_loss, eager_loss.double(), "reduction", torch.float32, "compiled loss")
    for name in METRIC_NAMES:
        assert_close(comp_m[name], eager_m[name].double(), "reduction", torch.float32, f"compiled {name}")
    assert_close(comp_g, eager_g.double(), "gradient", torch.float32, "compiled d logits")


# ============================================================== realistic shapes on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n,v", [(1021, 151936), (2048, 128256), (1000, 32000)])
def test_gpu_logprob_realistic(seed, n, v):
    logits, targets = make_logits(n, v, torch.bfloat16, "cuda", scale=3.0)
    logits[:7] = logits[:7] * 30  # logits of magnitude ~100
    check_logprob(logits, targets, 0.7)
    again = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend="triton")
    first = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend="triton")
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    half = rk.logprob_from_logits(logits[: n // 2], targets[: n // 2], temperature=0.7, backend="triton")
    assert torch.equal(half, first[0][: n // 2])


@pytest.mark.gpu
@pytest.mark.parametrize("shape,mode", [((2048, 512), "token-mean"), ((256, 4096), "seq-mean-token-mean"), ((997, 1031), "seq-mean-token-sum-norm")])
def test_gpu_policy_loss_realistic(seed, shape, mode):
    t = make_tokens(shape, "cuda", torch.float32)
    check_policy_loss(t, mode=mode, kl_type="k3+")


@pytest.mark.gpu
def test_gpu_policy_loss_never_syncs(seed):
    t = make_tokens((512, 1024), "cuda")
    g = upstream((), "cuda")
    rewards = t["adv"][:, 0].contiguous()
    run_policy_loss(t, "triton", g)  # compile and warm up outside the guarded region
    rk.group_advantages(rewards, group_size=8, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_policy_loss(t, "triton", g)
        rk.group_advantages(rewards, group_size=8, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
