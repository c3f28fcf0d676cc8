"""Compilation: torch.compile(fullgraph=True) over a small RL loss step, and the Triton kernels
compiled for an H100 (sm_90) by Triton's own compiler, here on CPU.

``fullgraph=True`` turns any graph break into an error, so these tests fail if an op (its
argument checks, the dispatch, the backend call) cannot be traced. The step chains
``group_advantages`` -> ``logprob_from_logits`` -> ``ratio_kl`` -> ``policy_loss`` and is checked
against the same step run_step eagerly (values, metrics and the logits gradient, within the contract).

On CPU the step runs the reference (``torch``) backend under the ``aot_eager`` compiler (Dynamo
and AOTAutograd, without Inductor's slow C++ build), and the Triton custom ops under the
interpreter. On a GPU it runs the Triton and the native custom ops under Inductor.

``test_triton_kernels_compile_for_sm90`` runs Triton's full pipeline (TTIR, TTGIR, LLVM IR, PTX,
cubin through the ``ptxas`` shipped with Triton) for every loss kernel and every compile-time
branch, and for the ``linear_logprob`` tile and merge kernels (pointer loads), so a kernel that only the interpreter accepts fails on the CPU machine, not first on the
GPU; and for the ``varlen_attention`` forward and both backward passes. It needs Triton's jit
library compiled, not interpreted: in a process where Triton was imported under
``TRITON_INTERPRET=1`` it runs in a child process without it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss.api import METRIC_NAMES
from op_backends import Backend, on_backends
from oracles import check_compiled_equals_eager, make_logits, make_tokens


def test_compiled_loss_step_fullgraph_reference_cpu(seed):
    torch._dynamo.reset()
    check_compiled_equals_eager("torch", "aot_eager", "cpu", torch.float32)


def test_compiled_step_checks_target_ids_on_device(seed):
    """Under compile the target-id check is a device-side assert: no graph break, still an error."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x, t: rk.logprob_from_logits(x, t, backend="torch"), fullgraph=True, backend="aot_eager")
    logits = torch.randn(4, 10)
    assert_close(
        fn(logits, torch.tensor([1, 2, 3, -100])),
        rk.logprob_from_logits(logits, torch.tensor([1, 2, 3, -100]), backend="torch").double(),
        "logprob",
        torch.float32,
    )
    with pytest.raises(RuntimeError, match=r"targets ids must be in \[0, 10\)"):
        fn(logits, torch.tensor([1, 2, 30, 4]))


@on_backends("policy_loss", exclude=("torch", "triton-interpret"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_step_fullgraph_gpu(seed, backend: Backend, dtype):
    torch._dynamo.reset()
    check_compiled_equals_eager(backend.name, "inductor", "cuda", dtype)


@on_backends("policy_loss", exclude=("torch", "native-cuda"))
def test_compiled_loss_step_fullgraph_triton(seed, backend: Backend):
    """logprob_from_logits -> ratio_kl -> policy_loss under torch.compile(fullgraph=True) (a graph break raises)."""
    device = backend.device
    logits, targets = make_logits(2 * 12, 96, torch.float32, device)
    logits, targets = logits.view(2, 12, 96), targets.view(2, 12)
    t = make_tokens((2, 12), device)

    def step(x):
        lp, ent = rk.logprob_from_logits(x, targets, temperature=0.9, return_entropy=True, backend="triton")
        ratio, kl = rk.ratio_kl(lp, t["old"], t["ref"], backend="triton")
        loss, metrics = rk.policy_loss(
            lp,
            t["old"],
            t["adv"],
            t["mask"] & (targets != -100),
            ref_logprob=t["ref"],
            kl_coef=0.1,
            entropy=ent,
            entropy_coef=0.01,
            clip_ratio_c=3.0,
            backend="triton",
        )
        return loss + 0.5 * (ratio * kl).mean(), metrics

    compiler = "inductor" if device == "cuda" else "aot_eager"  # inductor's CPU C++ build is too slow for CI
    compiled = torch.compile(step, fullgraph=True, backend=compiler)
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


# ---------------------------------------------------------------- Triton kernels for sm_90


def _sm90_cases() -> list:
    """(kernel, argument types that are not i32 / *fp32, constexprs, num_warps) covering every branch."""
    from rl_kernel_core.advantages import triton as adv
    from rl_kernel_core.logprob import triton as lpl
    from rl_kernel_core.loss import triton as pl
    from rl_kernel_core.triton import tuning

    f32 = "fp32"
    cases = []
    for entropy in (True, False):
        cases.append(
            (
                lpl._logprob_fwd_kernel,
                dict(logits_ptr="*bf16", targets_ptr="*i64", stride_ln="i64", inv_temp=f32),
                dict(WITH_ENTROPY=entropy, BLOCK_V=4096),
                8,
            )
        )
    for g_lp, g_ent in ((True, False), (False, True)):
        cases.append(
            (
                lpl._logprob_bwd_kernel,
                dict(logits_ptr="*bf16", targets_ptr="*i32", grad_logits_ptr="*bf16", inv_temp=f32),
                dict(WITH_LOGPROB_GRAD=g_lp, WITH_ENTROPY_GRAD=g_ent, BLOCK_V=4096),
                8,
            )
        )
    for backward, kl, plus in [(b, k, False) for b in (False, True) for k in range(4)] + [(True, 3, True)]:
        cases.append(
            (
                pl._ratio_kl_kernel,
                dict(lp_ptr="*bf16"),
                dict(
                    KL=kl,
                    KL_PLUS=plus,
                    BACKWARD=backward,
                    HAS_G_RATIO=True,
                    HAS_G_KL=True,
                    BLOCK=tuning.LOSS_ELEMENTWISE_BLOCK,
                ),
                4,
            )
        )
    knobs = dict(clip_lo=f32, clip_hi=f32, clip_c=f32, kl_coef=f32, entropy_coef=f32, mask_ptr="*u8", lp_ptr="*bf16")
    for backward, agg, dual, kl, plus, add_kl in [
        (False, 0, True, 3, False, True),
        (False, 1, False, 1, False, False),
        (True, 0, True, 3, False, True),
        (True, 1, False, 0, False, True),
        (True, 2, True, 1, False, True),
        (True, 3, True, 3, True, True),
        (True, 4, False, 2, False, False),
    ]:
        cases.append(
            (
                pl._policy_loss_tokens_kernel,
                knobs,
                dict(
                    BACKWARD=backward,
                    AGG=agg,
                    DUAL=dual,
                    KL=kl,
                    KL_PLUS=plus,
                    ADD_KL=add_kl,
                    NEED_REF=(not backward) or add_kl,
                    HAS_ENT=True,
                    HAS_W=True,
                    GRAD_LP=True,
                    GRAD_ENT=True,
                    BLOCK_T=1024,
                ),
                4,
            )
        )
    for agg, block_s, block_nb in [(0, 1024, 1), (1, 128, 8), (2, 128, 8), (3, 1, 128), (4, 1024, 1)]:
        cases.append(
            (
                pl._policy_loss_finish_kernel,
                dict(kl_coef=f32, entropy_coef=f32),
                dict(AGG=agg, ADD_KL=True, ADD_ENT=True, BLOCK_S=block_s, BLOCK_NB=block_nb),
                4,
            )
        )
    from rl_kernel_core.linear import triton_grad, triton_stats

    linear = dict(
        x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", tgt_ptr="*i64", inv_temp=f32, ignore_index="i64", dl_ptr="*bf16"
    )
    tiles = dict(
        BLOCK_M=128,
        BLOCK_N=256,
        BLOCK_K=64,
        GROUP_M=16,
        HAS_BIAS=True,
        EVEN_K=True,
        IEEE=False,
        UPCAST_DOT=False,
        TMA=False,
        FLATTEN=False,
    )
    for from_logits, want_ent in [(False, True), (False, False), (True, True)]:
        types = dict(linear, x_ptr="*fp32") if from_logits else linear
        cases.append((triton_stats._stats_kernel, types, dict(FROM_LOGITS=from_logits, WANT_ENT=want_ent, **tiles), 8))
    for from_logits, in_place in [(False, False), (True, True)]:
        types = dict(linear, x_ptr="*fp32") if from_logits else linear
        cases.append(
            (
                triton_grad._grad_kernel,
                types,
                dict(FROM_LOGITS=from_logits, HAS_GENT=True, IN_PLACE=in_place, **tiles),
                8,
            )
        )
    for want_ent in (True, False):
        cases.append(
            (
                triton_stats._merge_kernel,
                dict(tgt_ptr="*i64", ignore_index="i64"),
                dict(WANT_ENT=want_ent, BLOCK_R=tuning.MERGE_BLOCK_R, BLOCK_T=tuning.MERGE_BLOCK_T),
                4,
            )
        )
    for by_index, estimator, norm in [(False, 0, True), (True, 0, True), (True, 1, False), (False, 2, True)]:
        cases.append(
            (
                adv._group_advantages_kernel,
                dict(order_ptr="*i64", starts_ptr="*i64", ends_ptr="*i64", group_size="i64", eps_ptr="*fp64"),
                dict(BY_INDEX=by_index, ESTIMATOR=estimator, NORM_BY_STD=norm, BLOCK=tuning.ADVANTAGES_MAX_BLOCK),
                4,
            )
        )
    from rl_kernel_core.batch_invariant_mode import triton_attention as attn

    tables = dict(cu_q_ptr="*i32", cu_k_ptr="*i32", tile_seq_ptr="*i32", tile_start_ptr="*i32", scale=f32)
    bm, bn, warps, _ = tuning.TILES[torch.bfloat16]
    cases.append(
        (
            attn._attention_fwd_kernel,
            dict(tables, **{f"{n}_ptr": "*bf16" for n in "qkvo"}),
            dict(HQ=16, GROUP=2, D=128, BLOCK_D=128, CAUSAL=True, IEEE=False, UPCAST_DOT=False, BLOCK_M=bm, BLOCK_N=bn),
            warps,
        )
    )
    for dtype, name, d, causal in [(torch.bfloat16, "bf16", 128, True), (torch.float32, "fp32", 64, False)]:
        types = dict(tables, **{f"{n}_ptr": f"*{name}" for n in ("q", "k", "v", "o", "do", "dq", "dk", "dv")})
        for dkdv, (bm, bn, warps, _) in zip((False, True), tuning.BWD_TILES[dtype]):
            cases.append(
                (
                    attn._attention_bwd_kernel,
                    types,
                    dict(
                        HQ=16,
                        GROUP=2,
                        D=d,
                        BLOCK_D=d,
                        CAUSAL=causal,
                        IEEE=dtype == torch.float32,
                        UPCAST_DOT=False,
                        BLOCK_M=bm,
                        BLOCK_N=bn,
                        DKDV=dkdv,
                    ),
                    warps,
                )
            )
    return cases


def compile_for_sm90() -> list[str]:
    """Compile every case to a cubin for sm_90; return the failures (empty when all compile)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    failures = []
    for kernel, types, constexprs, num_warps in _sm90_cases():
        fn = kernel.flavour()
        signature = {
            name: "constexpr" if name in constexprs else types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
            for name in fn.arg_names
        }
        try:
            out = triton_compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": num_warps},
            )
            if not out.asm.get("cubin"):
                failures.append(f"{kernel.__name__} {constexprs}: no cubin")
        except Exception as exc:
            failures.append(f"{kernel.__name__} {constexprs}: {type(exc).__name__}: {exc}")
    return failures


def _triton_interpreted_here() -> bool:
    if "triton.language" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton.language"].sum, InterpretedFunction)


def test_triton_kernels_compile_for_sm90():
    if not _triton_interpreted_here():
        failures = compile_for_sm90()
    else:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = "import test_compile as t; import sys; f = t.compile_for_sm90(); print('\\n'.join(f)); sys.exit(1 if f else 0)"
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=os.path.dirname(__file__),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        failures = [] if proc.returncode == 0 else [proc.stdout[-6000:] + proc.stderr[-3000:]]
    assert not failures, "\n".join(failures)
