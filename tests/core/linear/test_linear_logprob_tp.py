"""Vocab-parallel ``linear_logprob`` (``tp_group``) on CPU processes joined by gloo.

The reference (``torch``): 2 processes against the single-process result; each rank loads the
inputs, keeps its contiguous vocab shard of ``weight``/``bias``, runs forward and backward
(log-prob and entropy terms, non-uniform upstream gradients, ignored rows, a chunk small enough to
split the rows, a shard whose logits are all ``-inf``) and saves its outputs.

Triton: gloo worlds of 2 and 4 CPU processes under the Triton interpreter.

The parent draws the inputs and saves them. The ranks of a world of 2 processes form groups of
TP = 1 (each rank alone) and TP = 2; those of a world of 4, groups of TP = 2 (rank pairs) and
TP = 4. In each group a rank keeps its contiguous vocab shard of ``weight``/``bias`` and runs
forward, backward (log-prob and entropy terms, non-uniform upstream gradients) and a no-grad
forward.
The parent then asserts, for every rank and TP size:

* log-prob and entropy bitwise equal to the single-process (``tp_group=None``) forward on its
  default gemm route (the route of every vocab-parallel pass), hence across TP sizes and ranks;
* the no-grad forward bitwise equal to the forward with grad;
* ``dh`` (replicated), the ``dW``/``db`` shards within the contract of the fp64 result.

The cases cross chunk boundaries in the forward (statistics) and the backward, hold targets at
the shard boundaries and ignored rows, and one uses an ``ignore_index`` that is a valid local id
on other shards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from rl_kernel_core.linear.chunks import tuned, tuning
from rl_kernel_core.linear.triton_tile import tiles
from rl_kernel_core.linear import triton_vocab_parallel as VP

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),  # the interpreter's masked lanes
]

# N prime and above the interpreter's BLOCK_M (32), D not a multiple of BLOCK_K (32), V = 8 tiles
# of the interpreter's BLOCK_N (64): 2 tiles per shard at TP = 4
N, D, V = 37, 40, 512
STATS_BYTES = 16 * 12 * (V // 64)  # 16 rows per forward chunk
CHUNK_BYTES = 16 * (V // 4) * 4  # 16 to 32 rows per backward chunk, whatever the TP size

_WORKER = textwrap.dedent(
    """
    import os
    import sys
    import torch
    import torch.distributed as dist
    import rl_kernel_core as rk
    from rl_kernel_core.linear.chunks import tuned

    rank, world, store, inputs, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    sizes = [int(s) for s in sys.argv[6].split(",")]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    groups = {}
    for size in sizes:
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))  # every rank creates every group
            if start <= rank < start + size:
                groups[size] = group
    results = []
    for case in torch.load(inputs):
        per_size = {}
        with tuned(stats_bytes=case["stats_bytes"], chunk_bytes=case["chunk_bytes"]):
            for size, group in groups.items():
                vl = case["weight"].shape[0] // size
                shard = slice(dist.get_rank(group) * vl, (dist.get_rank(group) + 1) * vl)
                bias = None if case["bias"] is None else case["bias"][shard].clone().requires_grad_()
                h = case["hidden"].clone().requires_grad_()
                w = case["weight"][shard].clone().requires_grad_()
                kw = dict(bias=bias, temperature=case["temperature"], ignore_index=case["ignore_index"],
                          return_entropy=case["entropy"], tp_group=group, backend="triton")
                res = rk.linear_logprob(h, w, case["targets"], **kw)
                lp, ent = res if case["entropy"] else (res, None)
                loss = (lp * case["g_lp"]).sum()
                if ent is not None:
                    loss = loss + (ent * case["g_ent"]).sum()
                loss.backward()
                with torch.no_grad():
                    kw["bias"] = None if bias is None else bias.detach()
                    res = rk.linear_logprob(h.detach(), w.detach(), case["targets"], **kw)
                    ng_lp, ng_ent = res if case["entropy"] else (res, None)
                per_size[size] = dict(
                    shard=(shard.start, shard.stop), lp=lp.detach(), ent=None if ent is None else ent.detach(),
                    ng_lp=ng_lp, ng_ent=ng_ent, dh=h.grad, dw=w.grad, db=None if bias is None else bias.grad,
                )
        results.append(per_size)
    torch.save(results, out)
    """
)


def _targets(ignore_index: int) -> torch.Tensor:
    """Random ids, the ids on both sides of every shard boundary at TP = 2 and 4, ignored rows."""
    t = torch.randint(0, V, (N,))
    edges = [e + d for e in range(V // 4, V, V // 4) for d in (-1, 0)] + [0, V - 1]
    t[2 : 2 + len(edges)] = torch.tensor(edges)
    t[0] = t[N - 3] = ignore_index
    return t


def _case(dtype, *, bias, entropy, temperature, ignore_index):
    hidden = torch.randn(N, D).to(dtype)
    weight = (torch.randn(V, D) * (3.0 / D**0.5)).to(dtype)
    targets = _targets(ignore_index)
    if ignore_index >= 0:  # a valid id on other shards that equals ignore_index as a local id
        targets[N - 5], targets[N - 6] = V // 4 + ignore_index, V // 2 + ignore_index
    sign = torch.where(torch.rand(N) < 0.5, -1.0, 1.0)
    return dict(
        hidden=hidden,
        weight=weight,
        bias=torch.randn(V).to(dtype) if bias else None,
        targets=targets,
        g_lp=(torch.rand(N) + 0.5) * sign,
        g_ent=-(torch.rand(N) + 0.5),
        temperature=temperature,
        entropy=entropy,
        ignore_index=ignore_index,
        stats_bytes=STATS_BYTES,
        chunk_bytes=CHUNK_BYTES,
    )


def _single_process(case):
    """tp_group=None on the default route (interpreted), forward values only."""
    with torch.no_grad(), tuned(stats_bytes=case["stats_bytes"]):
        res = rk.linear_logprob(
            case["hidden"],
            case["weight"],
            case["targets"],
            bias=case["bias"],
            temperature=case["temperature"],
            ignore_index=case["ignore_index"],
            return_entropy=case["entropy"],
            backend="triton",
        )
    return res if case["entropy"] else (res, None)


def _fp64(case):
    """fp64 values and gradients of the same inputs, single process (the torch reference)."""
    h, w = (case[k].double().requires_grad_() for k in ("hidden", "weight"))
    b = None if case["bias"] is None else case["bias"].double().requires_grad_()
    lp, ent = rk.linear_logprob(
        h,
        w,
        case["targets"],
        bias=b,
        temperature=case["temperature"],
        ignore_index=case["ignore_index"],
        return_entropy=True,
        backend="torch",
    )
    loss = (lp * case["g_lp"].double()).sum() + ((ent * case["g_ent"].double()).sum() if case["entropy"] else 0.0)
    loss.backward()
    return dict(lp=lp.detach(), ent=ent.detach(), dh=h.grad, dw=w.grad, db=None if b is None else b.grad)


_RANK_EXIT = textwrap.dedent(
    """
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a rank once aborted (std::terminate) after its work: interpreter teardown is skipped
    """
)
"""How every worker's rank ends, after saving its results (the worker imports os, sys and torch.distributed as dist)."""


def _run_world(worker, world, cases, tmp_path, *args, interpret=False, timeout=150):
    """Run ``worker`` (argv: rank, world, store, inputs, output, ``args``), then :data:`_RANK_EXIT`, on
    ``world`` processes over the saved ``cases``; each rank's saved results."""
    torch.save(cases, tmp_path / "inputs.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                worker + _RANK_EXIT,
                str(r),
                str(world),
                str(tmp_path / "store"),
                str(tmp_path / "inputs.pt"),
                str(tmp_path / f"out{r}.pt"),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
    return [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world,sizes", [(2, (1, 2)), (4, (2, 4))], ids=["world2", "world4"])
def test_vocab_parallel_bitwise_across_tp_sizes(seed, tmp_path, monkeypatch, world, sizes):
    cases = [
        _case(torch.bfloat16, bias=True, entropy=True, temperature=0.7, ignore_index=-100),
        _case(torch.float32, bias=False, entropy=False, temperature=1.0, ignore_index=5),
    ]
    ranks = _run_world(_WORKER, world, cases, tmp_path, ",".join(map(str, sizes)), interpret=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for i, case in enumerate(cases):
        dtype = case["hidden"].dtype
        # the default single-process route (gemm) is the vocab-parallel route
        assert tuning().route == VP.ROUTE
        want_lp, want_ent = _single_process(case)
        ref = _fp64(case)
        assert_close(want_lp, ref["lp"], "logprob", dtype, "single-process logprob")
        ignored = case["targets"] == case["ignore_index"]
        assert sorted(ranks[0][i]) == list(sizes)
        for size in sizes:
            runs = [r[i][size] for r in ranks]
            for rank, got in enumerate(runs):
                where = f"case {i}, TP={size}, rank {rank}"
                assert torch.equal(got["lp"], want_lp), f"logprob not bitwise, {where}"
                assert torch.equal(got["ng_lp"], want_lp), f"no-grad logprob not bitwise, {where}"
                if case["entropy"]:
                    assert torch.equal(got["ent"], want_ent), f"entropy not bitwise, {where}"
                    assert torch.equal(got["ng_ent"], want_ent), f"no-grad entropy not bitwise, {where}"
                assert torch.all(got["lp"][ignored] == 0)
                assert got["dh"].dtype == got["dw"].dtype == dtype
                assert_close(got["dh"], ref["dh"], "gradient", dtype, f"dhidden, {where}")
                assert torch.all(got["dh"][ignored] == 0)
                lo, hi = got["shard"]
                assert hi - lo == V // size
                assert_close(got["dw"], ref["dw"][lo:hi], "gradient", dtype, f"dweight shard, {where}")
                if case["bias"] is not None:
                    assert_close(got["db"], ref["db"][lo:hi], "gradient", dtype, f"dbias shard, {where}")
            # the ranks of one group hold the same dh bits (replicated)
            for start in range(0, world, size):
                group_runs = runs[start : start + size]
                assert all(torch.equal(group_runs[0]["dh"], r["dh"]) for r in group_runs[1:]), (
                    f"dh differs in a TP={size} group"
                )


def test_shard_not_multiple_of_tile_is_refused(monkeypatch):
    """The triton backend refuses a shard that does not hold whole vocab tiles, naming the numbers."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    block_n = tiles(torch.float32, torch.device("cpu"), from_logits=False).block_n
    v_local = 3 * block_n // 2
    hidden, weight = torch.randn(3, 8), torch.randn(v_local, 8)
    targets = torch.randint(0, v_local, (3,))
    args = (hidden, weight, targets, None, 1.0, -100, False, object())  # supports never calls the group
    reason = dispatch.unavailable_reason("linear_logprob", "triton", hidden.device, *args)
    assert (
        reason is not None
        and "tp_group" in reason
        and f"V_local={v_local}" in reason
        and f"BLOCK_N={block_n}" in reason
    )
    whole = torch.randn(2 * block_n, 8)
    assert (
        dispatch.unavailable_reason(
            "linear_logprob", "triton", hidden.device, hidden, whole, targets, None, 1.0, -100, False, object()
        )
        is None
    )


# ============================================================== the reference (torch)

REFERENCE_WORLD = 2

_REFERENCE_WORKER = textwrap.dedent(
    """
    import os
    import sys
    import torch
    import torch.distributed as dist
    import rl_kernel_core as rk
    from rl_kernel_core.logprob import reference as reference  # CHUNK_ELEMENTS: the row chunk both log-prob references take

    rank, world, store, inputs, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    cases = torch.load(inputs)
    results = []
    for case in cases:
        reference.CHUNK_ELEMENTS = case["chunk_elements"]
        vl = case["weight"].shape[0] // world
        shard = slice(rank * vl, (rank + 1) * vl)
        h = case["hidden"].clone().requires_grad_()
        w = case["weight"][shard].clone().requires_grad_()
        b = case["bias"][shard].clone().requires_grad_()
        lp, ent = rk.linear_logprob(h, w, case["targets"], bias=b, temperature=case["temperature"],
                                    return_entropy=True, tp_group=dist.group.WORLD, backend="torch")
        ((lp * case["g_lp"]).sum() + (ent * case["g_ent"]).sum()).backward()
        results.append(dict(lp=lp.detach(), ent=ent.detach(), dh=h.grad, dw=w.grad, db=b.grad))
    torch.save(results, out)
    """
)


def _reference_case(dtype, n=13, d=16, v=40, chunk_rows=3, masked_shard=False):
    """``masked_shard``: a -inf bias over the last rank's whole shard (and a few entries of the
    first), every target in the first shard."""
    hidden = torch.randn(n, d).to(dtype)
    weight = (torch.randn(v, d) * (3.0 / d**0.5)).to(dtype)
    bias = torch.randn(v).to(dtype)
    targets = torch.randint(0, v, (n,))
    targets[:2] = torch.tensor([3, v - 2])  # one target in each shard, at least
    if masked_shard:
        bias[v - v // REFERENCE_WORLD :] = float("-inf")
        bias[5:9] = float("-inf")
        targets = torch.randint(9, v - v // REFERENCE_WORLD, (n,))
    targets[5] = -100
    g_lp = torch.rand(n) + 0.5
    g_ent = -(torch.rand(n) + 0.5)
    return dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        targets=targets,
        g_lp=g_lp,
        g_ent=g_ent,
        temperature=0.7,
        chunk_elements=(v // REFERENCE_WORLD) * chunk_rows,
    )


def _reference_single_process(case):
    h, w, b = (case[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    lp, ent = rk.linear_logprob(
        h, w, case["targets"], bias=b, temperature=case["temperature"], return_entropy=True, backend="torch"
    )
    ((lp * case["g_lp"]).sum() + (ent * case["g_ent"]).sum()).backward()
    return dict(lp=lp.detach(), ent=ent.detach(), dh=h.grad, dw=w.grad, db=b.grad)


def test_reference_vocab_parallel_matches_single_process(seed, tmp_path):
    cases = [
        _reference_case(torch.float32),
        _reference_case(torch.bfloat16),
        _reference_case(torch.float32, masked_shard=True),
    ]
    ranks = _run_world(_REFERENCE_WORKER, REFERENCE_WORLD, cases, tmp_path, timeout=120)
    for case, *per_rank in zip(cases, *ranks):
        dtype = case["hidden"].dtype
        want = _reference_single_process(case)
        for key in ("lp", "ent", "dh"):  # replicated: every rank holds the same bits
            assert all(torch.equal(per_rank[0][key], r[key]) for r in per_rank[1:]), key
        got = per_rank[0]
        assert not any(r[key].isnan().any() for r in per_rank for key in ("lp", "ent", "dh", "dw", "db"))
        assert_close(got["lp"], want["lp"], "logprob", dtype, "logprob")
        assert_close(got["ent"], want["ent"], "logprob", dtype, "entropy")
        assert torch.all(got["lp"][case["targets"] == -100] == 0)
        assert_close(got["dh"], want["dh"], "gradient", dtype, "dhidden")
        assert_close(torch.cat([r["dw"] for r in per_rank]), want["dw"], "gradient", dtype, "dweight")
        assert_close(torch.cat([r["db"] for r in per_rank]), want["db"], "gradient", dtype, "dbias")
        assert got["dh"].dtype == got["dw"].dtype == dtype
