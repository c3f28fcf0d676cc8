"""Vocab-parallel linear_logprob: 2 gloo processes on CPU against the single-process result.

The parent draws the inputs and saves them; each rank loads them, keeps its contiguous vocab
shard of ``weight``/``bias``, runs forward and backward (log-prob and entropy terms, non-uniform
upstream gradients, ignored rows, a chunk small enough to split the rows) and saves its outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close

WORLD = 2

_WORKER = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import rl_kernel_core as rk
    from rl_kernel_core.reference import logprob as reference

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
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()
    """
)


def _case(dtype, n=13, d=16, v=40, chunk_rows=3, masked_shard=False):
    """``masked_shard``: a -inf bias over the last rank's whole shard (and a few entries of the
    first), every target in the first shard."""
    hidden = torch.randn(n, d).to(dtype)
    weight = (torch.randn(v, d) * (3.0 / d**0.5)).to(dtype)
    bias = torch.randn(v).to(dtype)
    targets = torch.randint(0, v, (n,))
    targets[:2] = torch.tensor([3, v - 2])  # one target in each shard, at least
    if masked_shard:
        bias[v - v // WORLD :] = float("-inf")
        bias[5:9] = float("-inf")
        targets = torch.randint(9, v - v // WORLD, (n,))
    targets[5] = -100
    g_lp = torch.rand(n) + 0.5
    g_ent = -(torch.rand(n) + 0.5)
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, g_lp=g_lp, g_ent=g_ent,
                temperature=0.7, chunk_elements=(v // WORLD) * chunk_rows)


def _single_process(case):
    h, w, b = (case[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    lp, ent = rk.linear_logprob(h, w, case["targets"], bias=b, temperature=case["temperature"], return_entropy=True, backend="torch")
    ((lp * case["g_lp"]).sum() + (ent * case["g_ent"]).sum()).backward()
    return dict(lp=lp.detach(), ent=ent.detach(), dh=h.grad, dw=w.grad, db=b.grad)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_vocab_parallel_matches_single_process(seed, tmp_path):
    cases = [_case(torch.float32), _case(torch.bfloat16), _case(torch.float32, masked_shard=True)]
    torch.save(cases, tmp_path / "inputs.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(r), str(WORLD), str(tmp_path / "store"), str(tmp_path / "inputs.pt"), str(tmp_path / f"out{r}.pt")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for r in range(WORLD)
    ]
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
    ranks = [torch.load(tmp_path / f"out{r}.pt") for r in range(WORLD)]

    for case, *per_rank in zip(cases, *ranks):
        dtype = case["hidden"].dtype
        want = _single_process(case)
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
