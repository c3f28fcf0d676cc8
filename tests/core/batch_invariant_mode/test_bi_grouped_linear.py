"""bi_grouped_linear: each expert's rows against an fp64 formula and bitwise equal to that expert's
bi_linear on the same backend; gradients; the Triton tile map; on CUDA no host read (a CUDA graph
captured once replays other routings). Seeded draws of experts, counts (empty experts included)
and widths; the seed is printed.

Runs on CPU (torch; Triton under the interpreter, small shapes) and on CUDA (``gpu`` marker,
a Qwen3-30B-A3B-like expert width)."""

from __future__ import annotations

import random

import pytest
import torch

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode.api import bi_linear
from rl_kernel_core.batch_invariant_mode.api_moe import bi_grouped_linear
from rl_kernel_core.batch_invariant_mode.triton_moe import tile_bound, tile_map
from oracles import assert_no_host_sync, close_in_dtype
import op_backends

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


def _draw(seed: int, device: str, dtype: torch.dtype):
    """Rows sorted by expert, each expert's ``[N, K]`` matrix, and the counts (some experts empty)."""
    rng = random.Random(seed)
    if device == "cpu":
        experts, k, n, most = rng.randint(2, 6), rng.choice([24, 40]), rng.choice([20, 48]), 40
    else:
        experts, k, n, most = rng.choice([16, 64]), 2048, rng.choice([768, 1536]), 700
    counts = [rng.choice([0, rng.randint(1, 3), rng.randint(1, most // experts + 20)]) for _ in range(experts)]
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), k, generator=gen).to(dtype).to(device)
    weight = (torch.randn(experts, n, k, generator=gen) / k**0.5).to(dtype).to(device)
    return rows, weight, torch.tensor(counts, device=device)


def _segments(counts: torch.Tensor):
    start = 0
    for e, count in enumerate(counts.tolist()):
        yield e, start, count
        start += count


@op_backends.on_backends("bi_grouped_linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_experts_rows_match_fp64_and_its_own_bi_linear_bitwise(seed, backend, dtype):
    rows, weight, counts = _draw(seed, backend.device, dtype)
    out = bi_grouped_linear(rows, weight, counts, backend=backend.name)
    assert out.shape == (rows.shape[0], weight.shape[1]) and out.dtype == dtype
    assert dispatch.explain("bi_grouped_linear").backend == backend.name
    for e, start, count in _segments(counts):
        seg = rows[start : start + count]
        expected = seg.double() @ weight[e].double().t()
        close_in_dtype(out[start : start + count], expected, "attention", dtype, f"expert {e} (seed={seed})")
        alone = bi_linear(seg, weight[e], backend=backend.name)
        assert torch.equal(out[start : start + count], alone), f"expert {e}: not its own bi_linear (seed={seed})"


@op_backends.on_backends("bi_grouped_linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_the_per_expert_products(seed, backend, dtype):
    rows, weight, counts = _draw(seed, backend.device, dtype)
    grad = torch.randn(rows.shape[0], weight.shape[1], device=rows.device).to(dtype)
    r1, w1 = rows.clone().requires_grad_(), weight.clone().requires_grad_()
    (bi_grouped_linear(r1, w1, counts, backend=backend.name) * grad).sum().backward()
    r2, w2 = rows.double().requires_grad_(), weight.double().requires_grad_()
    per_expert = [r2[s : s + c] @ w2[e].t() for e, s, c in _segments(counts) if c]
    (torch.cat(per_expert) * grad.double()).sum().backward()
    assert r1.grad is not None and w1.grad is not None and r2.grad is not None and w2.grad is not None
    close_in_dtype(r1.grad, r2.grad, "attention", dtype, f"rows' gradient (seed={seed})")
    close_in_dtype(w1.grad, w2.grad, "attention", dtype, f"weight's gradient (seed={seed})")


def test_the_reference_gradients_pass_gradcheck(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(9, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([4, 0, 5])
    assert torch.autograd.gradcheck(lambda r, w: bi_grouped_linear(r, w, counts, backend="torch"), (rows, weight))


def test_the_tile_map_covers_each_experts_rows_from_its_first_row(seed):
    rng = random.Random(seed)
    experts, block_m = rng.randint(1, 12), rng.choice([16, 64, 128])
    counts = torch.tensor([rng.choice([0, 1, rng.randint(1, 300)]) for _ in range(experts)])
    blocks = tile_bound(int(counts.sum()), experts, block_m)
    expert, first, end = tile_map(counts, block_m, blocks)
    covered: list[int] = []
    for b in range(blocks):
        if first[b] == end[b]:
            continue
        e = int(expert[b])
        seg_first = int(counts[:e].sum())
        assert (int(first[b]) - seg_first) % block_m == 0 and 0 < int(end[b] - first[b]) <= block_m
        assert seg_first <= int(first[b]) and int(end[b]) <= seg_first + int(counts[e]), f"seed={seed} block {b}"
        covered.extend(range(int(first[b]), int(end[b])))
    assert covered == list(range(int(counts.sum()))), f"seed={seed}"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r, w, c: (r.double(), w, c), "weight must have dtype"),
        (lambda r, w, c: (r, w[0], c), "weight must be 3-D"),
        (lambda r, w, c: (r, w[:, :, :-1], c), r"weight must have shape \[E, N, K="),
        (lambda r, w, c: (r, w, c[:-1]), r"counts must have shape \[E="),
        (lambda r, w, c: (r, w, c.int()), "counts must have dtype"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(change, message):
    rows, weight, counts = _draw(0, "cpu", torch.float32)
    with pytest.raises((TypeError, ValueError), match=message):
        bi_grouped_linear(*change(rows, weight, counts))


@pytest.mark.gpu
def test_cuda_reads_nothing_to_the_host_and_replays_in_a_cuda_graph(seed, monkeypatch):
    """The Triton backend builds its tile map on the device: no synchronisation in a forward and
    backward, and a graph captured for one routing replays another (same row count) with the eager bits."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows, weight, counts = _draw(seed, "cuda", torch.bfloat16)
    grad = torch.randn(rows.shape[0], weight.shape[1], device="cuda", dtype=torch.bfloat16)

    def forward_and_backward():
        r, w = rows.clone().requires_grad_(), weight.clone().requires_grad_()
        bi_grouped_linear(r, w, counts, backend="triton").backward(grad)

    assert_no_host_sync(forward_and_backward)
    graph = torch.cuda.CUDAGraph()
    static_counts = counts.clone()
    with torch.cuda.graph(graph):
        out = bi_grouped_linear(rows, weight, static_counts, backend="triton")
    other = counts[torch.randperm(counts.numel(), generator=torch.Generator().manual_seed(seed)).cuda()]
    static_counts.copy_(other)
    graph.replay()
    assert torch.equal(out, bi_grouped_linear(rows, weight, other, backend="triton")), f"seed={seed}"
