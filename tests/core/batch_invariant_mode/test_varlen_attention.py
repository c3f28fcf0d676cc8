"""varlen_attention: accuracy against a dense fp64 formula (``oracles.dense_attention``: causal,
GQA, packed), bitwise equality of prefill vs incremental decode over a KV cache and of a sequence
alone vs packed with others, gradients, bad input; on the reference (``torch``, below) and on
Triton (first), with the backward's determinism and per-sequence independence.

Triton runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` per test) with small shapes and on
CUDA (``gpu`` marker) at Qwen3-0.6B head shapes (16 query / 8 KV heads, head_dim 128; the gradient
tests over 8 sequences of 512-1024 tokens and two short ones). Under the interpreter ``tl.dot`` is
numpy's BLAS matmul, which treats a row by its position in the tile, so the bitwise decode/packing
properties (a query at another tile position) are asserted on CUDA and checked against the
contract on CPU.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract, dispatch
from rl_kernel_core.batch_invariant_mode.api_attention import paged_attention, write_paged_kv
from oracles import dense_attention

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


# ============================================================== Triton (interpreter on CPU, compiled on CUDA)


def _packed(device, lengths, dtype=torch.float32):
    hq, hkv, d = (4, 2, 8) if device.type == "cpu" else (16, 8, 128)
    t = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    make = lambda h: torch.randn(t, h, d, device=device).to(dtype)
    return make(hq), make(hkv), make(hkv), cu


def _lengths(device):
    return [5, 37, 1, 16] if device.type == "cpu" else [5, 700, 1, 129, 64]


def _equal_or_close(device, got, expected, dtype, what):
    if device.type == "cuda":
        assert torch.equal(got, expected), f"{what}: not bitwise equal"
    else:
        tol = contract.tolerance("attention", dtype)
        torch.testing.assert_close(got, expected, atol=tol.atol, rtol=tol.rtol, msg=what)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_formula(seed, device, causal, dtype):
    q, k, v, cu = _packed(device, _lengths(device), dtype)
    out, lse = rk.varlen_attention(q, k, v, cu, causal=causal, return_lse=True, backend="triton")
    assert dispatch.explain("varlen_attention").backend == "triton"
    assert out.dtype == dtype and lse.dtype == torch.float32
    c = cu.tolist()
    expected = dense_attention(q.cpu(), k.cpu(), v.cpu(), c, c, causal)
    tol = contract.tolerance("attention", dtype)
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol.atol, rtol=tol.rtol)
    _, ref_lse = rk.varlen_attention(q, k, v, cu, causal=causal, return_lse=True, backend="torch")
    torch.testing.assert_close(lse, ref_lse, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_packing_equal_prefill(seed, device, dtype):
    lengths = _lengths(device)
    q, k, v, cu = _packed(device, lengths, dtype)
    full = rk.varlen_attention(q, k, v, cu, backend="triton")
    c = cu.tolist()
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    b = 1  # the longest sequence: decode steps cross several KV blocks and tile positions
    for t in range(0, lengths[b], max(1, lengths[b] // 13)):
        i = c[b] + t
        step = rk.varlen_attention(
            q[i : i + 1],
            k[c[b] : i + 1],
            v[c[b] : i + 1],
            one,
            torch.tensor([0, t + 1], dtype=torch.int32, device=device),
            backend="triton",
        )
        _equal_or_close(device, step[0], full[i], dtype, f"decode step {t}")
    for b in range(len(lengths)):
        sl = slice(c[b], c[b + 1])
        alone = rk.varlen_attention(q[sl], k[sl], v[sl], torch.tensor([0, lengths[b]], device=device), backend="triton")
        _equal_or_close(device, alone, full[sl], dtype, f"sequence {b} alone")


def _layout(device, kind):
    """(query lengths, key lengths): ``packed`` self-attention, or ``kv_cache``: Lq <= Lk as in decode
    steps and chunked prefill, with a sequence that has keys and no queries."""
    if kind == "packed":
        lengths = [5, 37, 1, 16] if device.type == "cpu" else [777, 1, 512, 1024, 640, 5, 1000, 513, 900, 700]
        return lengths, lengths
    if device.type == "cpu":
        return [3, 1, 20, 0], [9, 40, 33, 5]
    return [1, 64, 300, 0, 1], [700, 129, 512, 64, 1024]


def _inputs(device, kind, dtype):
    """q, k, v, offsets and an output-gradient weight (representable in dtype) for ``_layout``."""
    lq, lk = _layout(device, kind)
    q, _, _, cu_q = _packed(device, lq, dtype)
    _, k, v, cu_k = _packed(device, lk, dtype)
    return q, k, v, cu_q, cu_k, torch.randn(q.shape, device=device).to(dtype).float()


def _grads(q, k, v, cu_q, cu_k, causal, w):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = rk.varlen_attention(*leaves, cu_q, cu_k, causal=causal, backend="triton")
    return torch.autograd.grad((out.float() * w).sum(), leaves)


def _dense_grads(q, k, v, cu_q, cu_k, causal, w):
    """What ``_grads`` should give: the same weighted sum through the dense formula in fp64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    out = dense_attention(q64, k64, v64, cu_q.tolist(), cu_k.tolist(), causal)
    return torch.autograd.grad((out * w.double()).sum(), leaves)


@pytest.mark.parametrize("kind", ["packed", "kv_cache"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_dense_formula(seed, device, kind, causal, dtype):
    q, k, v, cu_q, cu_k, w = _inputs(device, kind, dtype)
    got = _grads(q, k, v, cu_q, cu_k, causal, w)
    expected = _dense_grads(q, k, v, cu_q, cu_k, causal, w)
    for name, g, e in zip("qkv", got, expected):
        assert g.dtype == dtype
        contract.assert_close(g, e, "gradient", dtype, name=f"d{name}")


def test_gradients_at_other_head_dims_and_groups(seed, device):
    """Head dims that are not a power of two or not 128 (masked and larger ``BLOCK_D``), and a GQA
    group of 4 query heads per KV head, in bf16 against the dense fp64 formula."""
    hq, hkv, lengths, dims = (
        (4, 1, [5, 37, 1, 16], (12,)) if device.type == "cpu" else (8, 2, [300, 1, 129, 64], (64, 96, 256))
    )
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    for d in dims:
        q, k, v = (torch.randn(sum(lengths), h, d, device=device).to(torch.bfloat16) for h in (hq, hkv, hkv))
        w = torch.randn(q.shape, device=device).to(torch.bfloat16).float()
        got = _grads(q, k, v, cu, cu, True, w)
        expected = _dense_grads(q, k, v, cu, cu, True, w)
        for name, g, e in zip("qkv", got, expected):
            contract.assert_close(g, e, "gradient", torch.bfloat16, name=f"D={d} d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_deterministic_and_per_sequence(seed, device, dtype):
    """Bitwise equal gradients run to run, and a sequence's gradients alone bitwise equal to its
    gradients inside the pack: its rows sit at the same tile positions either way (tiles count from
    the sequence's start), so this holds under the interpreter too. Both layouts on CUDA, the
    KV-cache one (every kind of sequence) under the interpreter."""
    for kind in ("packed", "kv_cache") if device.type == "cuda" else ("kv_cache",):
        q, k, v, cu_q, cu_k, w = _inputs(device, kind, dtype)
        first = _grads(q, k, v, cu_q, cu_k, True, w)
        again = _grads(q, k, v, cu_q, cu_k, True, w)
        for name, a, b in zip("qkv", first, again):
            assert torch.equal(a, b), f"{kind}: d{name} changed between two identical calls"
        cq, ck = cu_q.tolist(), cu_k.tolist()
        one = lambda n: torch.tensor([0, n], dtype=torch.int32, device=device)  # noqa: E731
        for b in range(len(cq) - 1):
            sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            alone = _grads(q[sq], k[sk], v[sk], one(cq[b + 1] - cq[b]), one(ck[b + 1] - ck[b]), True, w[sq])
            for name, g, packed, rows in zip("qkv", alone, first, (sq, sk, sk)):
                assert torch.equal(g, packed[rows]), (
                    f"{kind}: sequence {b}'s d{name} alone differs from inside the pack"
                )


def test_fp64_is_left_to_the_torch_backend(device):
    q, k, v, cu = _packed(device, [4], torch.float64)
    with pytest.raises(rk.BackendUnavailableError, match="fp64"):
        rk.varlen_attention(q, k, v, cu, backend="triton")


def test_layout_tables_are_copied_once_per_layout(seed, device):
    """A layout's device tables are built once and reused by later calls (the layers of one forward,
    a CUDA graph captured after a call); another layout builds its own; results do not change."""
    from rl_kernel_core.batch_invariant_mode import triton_attention as triton_attention

    q, k, v, cu = _packed(device, _lengths(device))
    triton_attention._tables.cache_clear()
    first = rk.varlen_attention(q, k, v, cu, backend="triton")
    again = rk.varlen_attention(q, k, v, cu, backend="triton")
    info = triton_attention._tables.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert torch.equal(first, again)
    q2, k2, v2, cu2 = _packed(device, [3, 4])
    rk.varlen_attention(q2, k2, v2, cu2, backend="triton")
    assert triton_attention._tables.cache_info().misses == 2


# ---------------------------------------------------------- paged_attention / write_paged_kv (Triton)


def _paged_cache(device, k, v, cu_k, block_size, spare_rows=2):
    """A paged cache ``[num_blocks, Hkv, block_size, 2*D]`` holding the packed keys/values of ``cu_k``'s
    sequences in shuffled blocks (block 0 unused, as vLLM's null block), written by
    ``write_paged_kv`` with ``spare_rows`` padding slots (-1) after the tokens: ``(cache, block
    table [B, max_blocks] int32, seq_lens [B] int32)``."""
    c = cu_k.tolist()
    lengths = [b - a for a, b in zip(c, c[1:])]
    counts = [-(-n // block_size) for n in lengths]
    num_blocks = sum(counts) + 3
    cache = torch.full((num_blocks, k.shape[1], block_size, 2 * k.shape[2]), float("nan"), device=device).to(k.dtype)
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(len(lengths), max(1, max(counts)), dtype=torch.int32)
    slots = []
    for b, n in enumerate(lengths):
        blocks, order = order[: counts[b]], order[counts[b] :]
        table[b, : counts[b]] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    pad = lambda t: torch.cat([t, torch.randn(spare_rows, *t.shape[1:], device=device).to(t.dtype)])  # noqa: E731
    slot_mapping = torch.tensor(slots + [-1] * spare_rows, dtype=torch.int64, device=device)
    write_paged_kv(cache, pad(k), pad(v), slot_mapping)
    return cache, table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_has_varlen_bits(seed, device, dtype):
    """A whole-sequence prefill over the paged cache bitwise equals ``varlen_attention`` over the
    packed keys (the same tiles; under the interpreter too); decode steps (one query per sequence,
    the cache holding positions up to it) and a prefill chunk (the last queries of a sequence) equal
    the whole-sequence prefill at those queries: bitwise on CUDA, to the contract under the
    interpreter (see the module docstring). Cache block sizes that are and are not a multiple of
    the key tile."""
    lengths = _lengths(device)
    q, k, v, cu = _packed(device, lengths, dtype)
    full = rk.varlen_attention(q, k, v, cu, backend="triton")
    c = cu.tolist()
    for block_size in (16, 48):
        cache, table, seq_lens = _paged_cache(device, k, v, cu, block_size)
        whole = paged_attention(q, cache, table, cu, seq_lens, max(lengths))
        assert torch.equal(whole, full), f"block size {block_size}: paged prefill differs from varlen_attention"
        for t in range(0, max(lengths), max(1, max(lengths) // 9)):
            live = [b for b, n in enumerate(lengths) if n > t]  # each such sequence decodes its query t
            rows = torch.tensor([c[b] + t for b in live], device=device)
            cu_one = torch.arange(len(live) + 1, dtype=torch.int32, device=device)
            step = paged_attention(
                q[rows],
                cache,
                table[live],
                cu_one,
                torch.full((len(live),), t + 1, dtype=torch.int32, device=device),
                1,
            )
            _equal_or_close(device, step, full[rows], dtype, f"block size {block_size}: decode of query {t}")
        b, tail = 1, lengths[1] // 3  # the last `tail` queries of sequence 1, a prefill chunk
        chunk = paged_attention(
            q[c[b + 1] - tail : c[b + 1]],
            cache,
            table[b : b + 1],
            torch.tensor([0, tail], dtype=torch.int32, device=device),
            seq_lens[b : b + 1],
            tail,
        )
        _equal_or_close(
            device, chunk, full[c[b + 1] - tail : c[b + 1]], dtype, f"block size {block_size}: prefill chunk"
        )


def test_paged_attention_strided_rows_padding_and_untouched_rows(seed, device):
    """Queries and output as strided views (an engine's fused projection), padded sequences (``Lq =
    0``, as a CUDA graph's padded batch) and a larger ``max_query_len``: the real sequences' rows
    have the same bits, the rows outside the offsets are left as they were, padded slots write
    nothing."""
    lengths = [3, 9] if device.type == "cpu" else [70, 129]
    q, k, v, cu = _packed(device, lengths)
    cache, table, seq_lens = _paged_cache(device, k, v, cu, 16)
    plain = paged_attention(q, cache, table, cu, seq_lens, max(lengths))
    hq, d = q.shape[1], q.shape[2]
    fused = torch.randn(q.shape[0] + 2, hq + 3, d, device=device)
    fused[: q.shape[0], :hq] = q
    out_store = torch.full((q.shape[0] + 2, hq + 1, d), 7.0, device=device)
    padded_table = torch.cat([table, torch.zeros(2, table.shape[1], dtype=table.dtype, device=device)])
    padded_lens = torch.cat([seq_lens, torch.zeros(2, dtype=seq_lens.dtype, device=device)])
    padded_cu = torch.cat([cu, cu[-1:].repeat(2)])
    got = paged_attention(
        fused[:, :hq], cache, padded_table, padded_cu, padded_lens, max(lengths) + 5, out=out_store[:, :hq]
    )
    assert got.data_ptr() == out_store.data_ptr()
    assert torch.equal(out_store[: q.shape[0], :hq], plain)
    assert torch.all(out_store[q.shape[0] :] == 7.0) and torch.all(out_store[:, hq:] == 7.0)


def _mixed_step(gen, lengths, cu, slots, max_rows):
    """A random engine step over the packed sequences of ``cu``: up to ``slots`` of them, each with
    ``Lq`` queries, the last of its first ``Lk`` positions (a prefill, a chunk or a decode), their
    queries at most ``max_rows`` in all, the other slots padding (``Lq = Lk = 0``): ``(the
    sequences, Lq per slot, Lk per slot, the packed rows of the step's queries)``."""
    order = torch.randperm(len(lengths), generator=gen).tolist()[
        : int(torch.randint(1, slots + 1, (1,), generator=gen))
    ]
    lq, lk, rows, used = [], [], [], 0
    for b in order:
        k_count = int(torch.randint(1, lengths[b] + 1, (1,), generator=gen))
        q_count = min(k_count, max_rows - used, int(torch.randint(1, k_count + 1, (1,), generator=gen)))
        q_count = q_count if torch.rand(1, generator=gen) < 0.5 else min(1, q_count)
        lq.append(q_count)
        lk.append(k_count if q_count else 0)
        rows += [cu[b] + p for p in range(k_count - q_count, k_count)]
        used += q_count
    pad = slots - len(order)
    return order, lq + [0] * pad, lk + [0] * pad, rows


def test_paged_attention_launch_size_does_not_change_the_bits(seed, device):
    """Random mixed steps (prefills, chunks, decodes, padded slots): the launch sized by
    ``max_query_len``, by a larger bound and by none (a program per possible tile of T rows) give
    the same bits, and each query the whole-sequence prefill's (bitwise on CUDA, to the contract
    under the interpreter)."""
    lengths = _lengths(device)
    q, k, v, cu = _packed(device, lengths, torch.bfloat16)
    full = rk.varlen_attention(q, k, v, cu, backend="triton")
    cache, table, _ = _paged_cache(device, k, v, cu, 16)
    gen = torch.Generator().manual_seed(seed)
    c = cu.tolist()
    for _ in range(4):
        order, lq, lk, rows = _mixed_step(gen, lengths, c, len(lengths) + 2, sum(lengths))
        step_q = torch.randn(len(rows) + 3, q.shape[1], q.shape[2], device=device).to(q.dtype)
        step_q[: len(rows)] = q[torch.tensor(rows, device=device)]
        step_table = torch.cat(
            [table[order], torch.zeros(len(lq) - len(order), table.shape[1], dtype=table.dtype, device=device)]
        )
        cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lk, dtype=torch.int32, device=device)
        outs = [
            paged_attention(step_q, cache, step_table, cu_q, seq_lens, bound)
            for bound in (max(lq), max(lq) + int(torch.randint(1, 90, (1,), generator=gen)), None)
        ]
        what = f"seed={seed} step Lq={lq} Lk={lk}"
        assert torch.equal(outs[0][: len(rows)], outs[1][: len(rows)]), f"{what}: a larger bound changed the bits"
        assert torch.equal(outs[0][: len(rows)], outs[2][: len(rows)]), f"{what}: no bound changed the bits"
        _equal_or_close(device, outs[2][: len(rows)], full[torch.tensor(rows, device=device)], torch.bfloat16, what)


@pytest.mark.parametrize("hq, hkv", [(3, 3), (6, 2), (7, 1), (8, 1)])
def test_paged_attention_packs_any_gqa_group(seed, device, hq, hkv):
    """Query heads per KV head 1, 3, 7 (not a divisor of the tile's rows) and 8 share a tile per KV
    head: a whole-sequence prefill and decode steps over the paged cache give every query
    ``varlen_attention``'s bits (bitwise on CUDA, to the contract under the interpreter)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 40 if device.type == "cpu" else 400, (3,), generator=gen)]
    d = 8 if device.type == "cpu" else 64
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    q, k, v = (torch.randn(sum(lengths), h, d, device=device).to(torch.bfloat16) for h in (hq, hkv, hkv))
    full = rk.varlen_attention(q, k, v, cu, backend="triton")
    cache, table, seq_lens = _paged_cache(device, k, v, cu, 16)
    what = f"seed={seed} Hq={hq} Hkv={hkv} lengths={lengths}"
    _equal_or_close(device, paged_attention(q, cache, table, cu, seq_lens), full, torch.bfloat16, what)
    c = cu.tolist()
    t = min(lengths) - 1  # every sequence decodes its query t
    rows = torch.tensor([c[b] + t for b in range(len(lengths))], device=device)
    step = paged_attention(
        q[rows],
        cache,
        table,
        torch.arange(len(lengths) + 1, dtype=torch.int32, device=device),
        torch.full((len(lengths),), t + 1, dtype=torch.int32, device=device),
        1,
    )
    _equal_or_close(device, step, full[rows], torch.bfloat16, f"{what}: decode of query {t}")


def test_write_paged_kv_copies_exactly_and_skips_padding(seed, device):
    k, v = (torch.randn(6, 2, 8, device=device).to(torch.bfloat16) for _ in range(2))
    cache = torch.zeros(3, 2, 4, 16, device=device, dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 11, -1], device=device)  # 5 slots for 6 rows: the last row is ignored
    write_paged_kv(cache, k, v, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(cache[slot // 4, :, slot % 4, :8], k[i]) and torch.equal(
                cache[slot // 4, :, slot % 4, 8:], v[i]
            )
    assert int((cache != 0).any(-1).sum()) == 3 * 2  # three tokens x two heads, nothing else written


@pytest.mark.gpu
def test_paged_attention_replays_in_a_cuda_graph_with_new_offsets(seed):
    """Captured once, replayed after the block table, offsets and lengths were overwritten in place
    (as an engine's persistent buffers): the eager call's bits for the new layout."""
    device = torch.device("cuda")
    lengths = [300, 45, 129, 1]
    q, k, v, cu = _packed(device, lengths, torch.bfloat16)
    cache, table, seq_lens = _paged_cache(device, k, v, cu, 16)
    n = len(lengths)
    rows = torch.tensor([c - 1 for c in cu.tolist()[1:]], device=device)
    q_buf, out_buf = q[rows].clone(), torch.empty(n, q.shape[1], q.shape[2], device=device, dtype=q.dtype)
    cu_buf, lens_buf, table_buf = torch.arange(n + 1, dtype=torch.int32, device=device), seq_lens.clone(), table.clone()
    run = lambda: paged_attention(q_buf, cache, table_buf, cu_buf, lens_buf, 1, out=out_buf)  # noqa: E731
    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for t in (0, 17, 44):  # decode query t of every sequence longer than t; the rest padded (Lq = 0)
        lens_buf.copy_(torch.tensor([min(t + 1, n_) for n_ in lengths], dtype=torch.int32, device=device))
        live = torch.tensor([n_ > t for n_ in lengths], device=device)
        cu_buf.copy_(torch.cat([torch.zeros(1, dtype=torch.int32, device=device), live.int().cumsum(0).int()]))
        picks = torch.tensor([c + t for c, n_ in zip(cu.tolist(), lengths) if n_ > t], device=device)
        q_buf.zero_()
        q_buf[: len(picks)] = q[picks]
        table_buf.copy_(torch.cat([table[live], table[~live]]))
        lens_buf.copy_(torch.cat([lens_buf[live], torch.zeros(int((~live).sum()), dtype=torch.int32, device=device)]))
        graph.replay()
        eager = paged_attention(q_buf, cache, table_buf, cu_buf, lens_buf, 1)
        assert torch.equal(out_buf[: len(picks)], eager[: len(picks)]), f"replay differs from eager at t={t}"
        full = rk.varlen_attention(q, k, v, cu, backend="triton")
        assert torch.equal(out_buf[: len(picks)], full[picks]), f"replay differs from the prefill at t={t}"


def test_paged_attention_bad_input_names_the_argument(device, monkeypatch):
    q, k, v, cu = _packed(device, [4, 4])
    cache, table, lens = _paged_cache(device, k, v, cu, 16)
    with pytest.raises(ValueError, match=r"kv_cache must have shape \[num_blocks, Hkv, block_size, 2\*D="):
        paged_attention(q, cache[..., :-1], table, cu, lens, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q must have seq_lens' length \\+ 1 = 3 entries, got 2"):
        paged_attention(q, cache, table, cu[:2], lens, 4)
    with pytest.raises(ValueError, match="seq_lens: at most 4095 sequences a call, got 4096"):
        big = torch.zeros(4096, dtype=torch.int32, device=device)
        paged_attention(q, cache, table, torch.zeros(4097, dtype=torch.int32, device=device), big, 4)
    with pytest.raises(ValueError, match="block_table must have a row per sequence"):
        paged_attention(q, cache, table[:1], cu, lens, 4)
    with pytest.raises(ValueError, match="max_query_len must be None or an int >= 0, got -1"):
        paged_attention(q, cache, table, cu, lens, -1)
    with pytest.raises(TypeError, match="kv_cache"):
        paged_attention(q, cache.double(), table, cu, lens, 4)
    with pytest.raises(ValueError, match="slot_mapping has 9 slots for 8 key rows"):
        write_paged_kv(cache, k, v, torch.zeros(9, dtype=torch.int64, device=device))
    if device.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="expected CUDA tensors"):
            paged_attention(q, cache, table, cu, lens, 4)


# ============================================================== the reference (torch) on CPU


def _packed_cpu(lengths, hq=4, hkv=2, d=8, dtype=torch.float32):
    t = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return (
        torch.randn(t, hq, d, dtype=dtype),
        torch.randn(t, hkv, d, dtype=dtype),
        torch.randn(t, hkv, d, dtype=dtype),
        cu,
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_dense_formula(seed, causal, dtype):
    q, k, v, cu = _packed_cpu([5, 37, 1, 16], dtype=dtype)
    out, lse = rk.varlen_attention(q, k, v, cu, causal=causal, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    expected = dense_attention(q, k, v, cu.tolist(), cu.tolist(), causal)
    tol = contract.tolerance("attention", dtype)
    torch.testing.assert_close(out.double(), expected, atol=tol.atol, rtol=tol.rtol)


def test_decode_over_kv_cache_equals_prefill_bitwise(seed):
    q, k, v, cu = _packed_cpu([45])
    full = rk.varlen_attention(q, k, v, cu)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for t in range(45):
        cache = torch.tensor([0, t + 1], dtype=torch.int32)
        step = rk.varlen_attention(q[t : t + 1], k[: t + 1], v[: t + 1], one, cache)
        assert torch.equal(step[0], full[t]), f"decode step {t} differs from the prefill"


def test_chunked_prefill_equals_full_prefill_bitwise(seed):
    q, k, v, cu = _packed_cpu([40])
    full = rk.varlen_attention(q, k, v, cu)
    tail = rk.varlen_attention(q[23:], k, v, torch.tensor([0, 17], dtype=torch.int32), cu)
    assert torch.equal(tail, full[23:])


def test_sequence_alone_equals_packed_bitwise(seed):
    lengths = [7, 33, 2, 20]
    q, k, v, cu = _packed_cpu(lengths)
    packed = rk.varlen_attention(q, k, v, cu)
    c = cu.tolist()
    for b in range(len(lengths)):
        sl = slice(c[b], c[b + 1])
        alone = rk.varlen_attention(q[sl], k[sl], v[sl], torch.tensor([0, lengths[b]]))
        assert torch.equal(alone, packed[sl]), f"sequence {b} changed when packed"


def test_mode_on_keeps_decode_prefill_equality(seed):
    q, k, v, cu = _packed_cpu([20])
    with rk.batch_invariant():
        full = rk.varlen_attention(q, k, v, cu)
        step = rk.varlen_attention(q[19:], k, v, torch.tensor([0, 1]), cu)
    assert torch.equal(step[0], full[19])


def test_reference_gradients_match_dense_formula(seed):
    q, k, v, cu = _packed_cpu([9, 18])
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    w = torch.randn(q.shape, dtype=torch.float64)
    got = torch.autograd.grad((rk.varlen_attention(q, k, v, cu) * w).sum(), (q, k, v))
    expected = torch.autograd.grad((dense_attention(q, k, v, cu.tolist(), cu.tolist(), True) * w).sum(), (q, k, v))
    tol = contract.tolerance("gradient", torch.float64)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=tol.atol, rtol=tol.rtol)


def test_bad_input_names_the_argument():
    q, k, v, cu = _packed_cpu([4, 4])
    with pytest.raises(ValueError, match="Hq=4.*Hkv=3"):
        rk.varlen_attention(q, torch.randn(8, 3, 8), torch.randn(8, 3, 8), cu)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        rk.varlen_attention(q, k, v, torch.tensor([0, 3, 7]))
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        rk.varlen_attention(q, k, v, cu.float())
    with pytest.raises(ValueError, match="Lq <= Lk"):
        rk.varlen_attention(q, k[:4], v[:4], cu, torch.tensor([0, 2, 4]))
    with pytest.raises(TypeError, match="k"):
        rk.varlen_attention(q, k.double(), v, cu)
    with pytest.raises(ValueError, match="cu_seqlens_k.*sequence 1 has Lq=4, Lk=0"):
        rk.varlen_attention(q, k[:4], v[:4], cu, torch.tensor([0, 4, 4]), causal=False)
    with pytest.raises(ValueError, match=r"q must have a head dim D >= 1, got shape \(8, 4, 0\)"):
        rk.varlen_attention(q[..., :0], k[..., :0], v[..., :0], cu)
    with pytest.raises(TypeError, match="return_lse must be a bool, got str"):
        rk.varlen_attention(q, k, v, cu, return_lse="yes")


def test_sequence_without_queries_may_have_no_keys(seed):
    q, k, v, cu = _packed_cpu([4, 4])
    cu_q = torch.tensor([0, 4, 4, 8])
    cu_k = torch.tensor([0, 4, 4, 8])
    out = rk.varlen_attention(q, k, v, cu_q, cu_k, causal=False)
    torch.testing.assert_close(out, rk.varlen_attention(q, k, v, cu, causal=False), atol=0, rtol=0)


@pytest.mark.gpu
def test_paged_attention_replays_mixed_steps_in_one_cuda_graph(seed):
    """Captured once without ``max_query_len`` over buffers of T rows and B slots (as an engine's
    full CUDA graph for mixed batches), replayed after random mixed steps (prefills, chunks,
    decodes, padded slots) were written into the buffers: every query gets the whole-sequence
    prefill's bits."""
    device = torch.device("cuda")
    lengths = [300, 45, 129, 1, 700, 64]
    q, k, v, cu = _packed(device, lengths, torch.bfloat16)
    full = rk.varlen_attention(q, k, v, cu, backend="triton")
    cache, table, _ = _paged_cache(device, k, v, cu, 16)
    rows_cap, slots = 512, len(lengths) + 2
    q_buf = torch.zeros(rows_cap, q.shape[1], q.shape[2], device=device, dtype=q.dtype)
    out_buf = torch.empty_like(q_buf)
    table_buf = torch.zeros(slots, table.shape[1], dtype=table.dtype, device=device)
    cu_buf = torch.zeros(slots + 1, dtype=torch.int32, device=device)
    lens_buf = torch.zeros(slots, dtype=torch.int32, device=device)
    run = lambda: paged_attention(q_buf, cache, table_buf, cu_buf, lens_buf, None, out=out_buf)  # noqa: E731
    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator().manual_seed(seed)
    c = cu.tolist()
    for _ in range(6):
        order, lq, lk, rows = _mixed_step(gen, lengths, c, slots, rows_cap)
        q_buf.zero_()
        q_buf[: len(rows)] = q[torch.tensor(rows, device=device)]
        table_buf.zero_()
        table_buf[: len(order)] = table[order]
        cu_buf.copy_(torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32))
        lens_buf.copy_(torch.tensor(lk, dtype=torch.int32))
        graph.replay()
        expected = full[torch.tensor(rows, device=device)]
        assert torch.equal(out_buf[: len(rows)], expected), (
            f"seed={seed}: replay of Lq={lq} Lk={lk} differs from the prefill"
        )
