"""Span-aware scoring: ``loss_spans=`` on linear_logprob, policy_loss and fused_linear_policy_loss
equals the dense-mask path (values bitwise where rows are independent, else within the contract),
only the scored rows reach the LM head, and gradients reach exactly those rows. Every backend
that serves the op on this machine: torch, and Triton (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss.api import LOSS_AGG_MODES
from rl_kernel_core.loss.opdef import FusedLossInputs
from rl_kernel_core.spans import LossSpans
from oracles import upstream

ONE_NUMBER: Any = (1,)  # not a (start, length) pair

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


@pytest.fixture(params=["torch", "triton", pytest.param("native", marks=pytest.mark.gpu)])
def backend(request):
    return request.param


@pytest.fixture
def device(backend, triton_device):
    """Triton runs interpreted on CPU (``TRITON_INTERPRET=1``), compiled on CUDA; torch runs on
    either; native (CUDA only) on CUDA."""
    if backend == "native" and triton_device.type == "cpu":
        pytest.skip("the native backend runs on CUDA only")
    return triton_device


def served(backend: str, op: str) -> None:
    if not dispatch.serves(backend, op):
        pytest.skip(f"the {backend} backend does not serve {op}")


def random_spans(b: int, t: int, device) -> LossSpans:
    """Random spans: an image-text layout's answer runs (some sequences with two, one with none)."""
    pairs: list[list[tuple[int, int]]] = []
    for s in range(b):
        if s == 1:
            pairs.append([])
            continue
        start = random.randrange(1, t // 2)
        first = (start, random.randrange(1, t // 4))
        second_start = first[0] + first[1] + random.randrange(1, 3)
        pairs.append(
            [first, (second_start, random.randrange(1, t - second_start + 1))] if second_start < t else [first]
        )
    return LossSpans.from_pairs(pairs, t, device=device)


def inputs(device, dtype, b=3, t=13, d=24, v=67):
    hidden = torch.randn(b, t, d, dtype=dtype, device=device)
    weight = (torch.randn(v, d, dtype=dtype, device=device) * 0.3).to(dtype)
    targets = torch.randint(0, v, (b, t), device=device)
    return hidden, weight, targets


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def spy(monkeypatch, op):
    """Record the row count of ``hidden`` each time ``op``'s implementation runs."""
    rows: list[int] = []
    select = dispatch.select

    def recording(name, *args, **kwargs):
        impl = select(name, *args, **kwargs)
        if name != op:
            return impl

        def run(first, *rest, **kw):
            hidden = first.hidden if isinstance(first, FusedLossInputs) else first
            rows.append(hidden.shape[:-1].numel())
            return impl(first, *rest, **kw)

        return run

    monkeypatch.setattr(dispatch, "select", recording)
    return rows


def test_spans_from_pairs_and_cu_offsets_agree(seed):
    a = LossSpans.from_pairs([[(2, 3)], [], [(0, 4)]], 6)
    b = LossSpans.from_cu_offsets(torch.tensor([2, 5, 0]), torch.tensor([0, 3, 3, 7]), 6)
    assert torch.equal(a.index, b.index) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    assert a.index.tolist() == [2, 3, 4, 12, 13, 14, 15] and a.cu_seqlens.tolist() == [0, 3, 3, 7]
    assert a.max_seqlen == 4 and a.total == 7
    assert a.dense_mask().tolist() == [[False, False, True, True, True, False], [False] * 6, [True] * 4 + [False] * 2]


def test_gather_scatter_move_values_and_gradients_to_the_scored_rows_only(seed):
    spans = random_spans(4, 11, "cpu")
    x = torch.randn(4, 11, 5, dtype=torch.float64, requires_grad=True)
    mask = spans.dense_mask()
    compact = spans.gather(x)
    assert torch.equal(compact, x.detach()[mask])
    dense = spans.scatter(compact * 2)
    assert torch.equal(dense[mask], 2 * x.detach()[mask]) and not dense[~mask].any()
    padded, valid = spans.gather_padded(x)
    assert (
        padded.shape == (4, spans.max_seqlen, 5)
        and torch.equal(padded[valid], x.detach()[mask])
        and not padded[~valid].any()
    )
    g = upstream(dense.shape, "cpu")
    (grad,) = torch.autograd.grad((dense * g).sum() + (padded * padded).sum(), x)
    expected = torch.where(mask[..., None], 2 * g + 2 * x.detach(), 0.0)
    assert torch.equal(grad, expected)
    torch.autograd.gradcheck(lambda y: spans.scatter(spans.gather(y) * 3), (x,))
    torch.autograd.gradcheck(lambda y: spans.gather_padded(y)[0], (x,))


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            lambda: LossSpans.from_pairs([[(2, 3), (4, 1)]], 8),
            r"pairs\[0\]\[1\]: span \(start 4, length 1\) must have length >= 1 and lie in \[5, 8\)",
        ),
        (lambda: LossSpans.from_pairs([[(6, 3)]], 8), r"pairs\[0\]\[0\]: span \(start 6, length 3\)"),
        (lambda: LossSpans.from_pairs([[(1, 0)]], 8), r"pairs\[0\]\[0\]: span \(start 1, length 0\)"),
        (
            lambda: LossSpans.from_pairs([[ONE_NUMBER]], 8),
            r"pairs\[0\]\[0\] must be a \(start, length\) pair, got \(1,\)",
        ),
        (lambda: LossSpans.from_pairs([[(1, 2)]], -1), r"seq_len must be an int >= 0, got -1"),
        (
            lambda: LossSpans.from_cu_offsets([1, 2], [0, 3], 8),
            r"cu_offsets must hold len\(starts\) \+ 1 = 3 entries starting at 0",
        ),
        (
            lambda: LossSpans.from_cu_offsets([1, 2], [0, 3, 2], 8),
            r"cu_offsets must be non-decreasing, got 3 then 2 at 1",
        ),
    ],
)
def test_bad_spans_are_refused_naming_the_entry(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_float_offsets_are_refused():
    with pytest.raises(
        TypeError, match=r"starts must be a 1-D integer tensor or a list of ints, got a torch.float32 tensor"
    ):
        LossSpans.from_cu_offsets(torch.ones(2), [0, 1, 2], 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_logprob_on_spans_equals_the_dense_mask(seed, backend, device, dtype, monkeypatch):
    served(backend, "linear_logprob")
    hidden, weight, targets = inputs(device, dtype)
    spans = random_spans(3, 13, device)
    mask = spans.dense_mask()
    dense_targets = targets.masked_fill(~mask, -100)
    targets_elsewhere = targets.masked_fill(~mask, 10**6)  # outside the spans targets are never read
    rows = spy(monkeypatch, "linear_logprob")
    h1, w1 = leaves(hidden, weight)
    lp, ent = rk.linear_logprob(h1, w1, targets_elsewhere, loss_spans=spans, return_entropy=True, backend=backend)
    assert rows == [spans.total]
    h2, w2 = leaves(hidden, weight)
    lp_dense, ent_dense = rk.linear_logprob(h2, w2, dense_targets, return_entropy=True, backend=backend)
    g1, g2 = upstream(lp.shape, device).float(), upstream(lp.shape, device).float()
    grads = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), (h1, w1))
    want = torch.autograd.grad((lp_dense * g1).sum() + (ent_dense * g2).sum(), (h2, w2))
    assert not grads[0][~mask].any()
    # the torch backend's matmuls pick kernels by row count (cuBLAS and MKL do); under the Triton
    # interpreter tl.dot is numpy's matmul, and some CPUs' OpenBLAS kernels give a row other bits
    # at another place in a block: a row's bits depend on that row alone on CUDA only
    if backend == "torch" or device.type != "cuda":
        assert_close(lp, lp_dense, "logprob", dtype, "logprob")
        assert_close(ent, ent_dense, "logprob", dtype, "entropy")
        assert_close(grads[0], want[0], "gradient", dtype, "dhidden")
    else:  # a row's values and gradient depend on that row alone
        assert torch.equal(lp, lp_dense) and torch.equal(ent, ent_dense)
        assert torch.equal(grads[0], want[0])
    assert_close(grads[1], want[1], "gradient", dtype, "dweight")


def test_linear_logprob_spans_keep_leading_dims_and_empty_spans(seed):
    hidden, weight, targets = inputs("cpu", torch.float32, b=4, t=6)
    spans = LossSpans.from_pairs([[(1, 2)], [], [(0, 6)], [(5, 1)]], 6)
    lp = rk.linear_logprob(hidden.view(2, 2, 6, -1), weight, targets.view(2, 2, 6), loss_spans=spans)
    assert lp.shape == (2, 2, 6)
    assert_close(
        lp.view(4, 6),
        rk.linear_logprob(hidden, weight, targets.masked_fill(~spans.dense_mask(), -100)),
        "logprob",
        torch.float32,
        "spans vs dense mask",
    )  # torch backend: rows not independent (MKL)
    none = LossSpans.from_pairs([[] for _ in range(4)], 6)
    h = hidden.clone().requires_grad_(True)
    out = rk.linear_logprob(h, weight, targets, loss_spans=none)
    out.sum().backward()
    assert not out.any() and h.grad is not None and not h.grad.any()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_on_spans_equals_the_dense_mask(seed, mode):
    spans = random_spans(4, 9, "cpu")
    logprob = (torch.randn(4, 9) - 2).requires_grad_(True)
    old, adv, ref = torch.randn(4, 9) - 2, torch.randn(4, 9), torch.randn(4, 9) - 2
    knobs = dict(ref_logprob=ref, kl_coef=0.1, clip_ratio_c=3.0, loss_agg_mode=mode)
    loss, metrics = rk.policy_loss(logprob, old, adv, loss_spans=spans, **knobs)
    want, want_metrics = rk.policy_loss(logprob, old, adv, spans.dense_mask(), **knobs)
    assert torch.equal(loss, want) and all(torch.equal(metrics[k], want_metrics[k]) for k in want_metrics)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fused_loss_on_spans_equals_the_dense_mask(seed, backend, device, mode, monkeypatch):
    served(backend, "fused_linear_policy_loss")
    dtype = torch.bfloat16 if mode == "seq-mean-token-mean" else torch.float32
    hidden, weight, targets = inputs(device, dtype, b=3, t=11)
    spans = random_spans(3, 11, device)
    mask = spans.dense_mask()
    old = torch.randn(3, 11, device=device) - 3
    adv, ref = torch.randn(3, 11, device=device), torch.randn(3, 11, device=device) - 3
    rw = torch.rand(3, 11, device=device) + 0.5
    knobs = dict(
        ref_logprob=ref,
        rollout_is_weights=rw,
        kl_coef=0.05,
        entropy_coef=0.01,
        clip_ratio_c=3.0,
        temperature=0.8,
        loss_agg_mode=mode,
        backend=backend,
    )
    rows = spy(monkeypatch, "fused_linear_policy_loss")
    h1, w1 = leaves(hidden, weight)
    loss, metrics = rk.fused_linear_policy_loss(h1, w1, targets, old, adv, loss_spans=spans, **knobs)
    expected_rows = spans.total if mode in ("token-mean", "token-sum") else 3 * spans.max_seqlen
    assert rows == [expected_rows] and expected_rows < 3 * 11
    h2, w2 = leaves(hidden, weight)
    want, want_metrics = rk.fused_linear_policy_loss(h2, w2, targets, old, adv, mask, **knobs)
    assert_close(loss, want, "reduction", dtype, "loss")
    for name in want_metrics:
        assert_close(metrics[name], want_metrics[name], "reduction", dtype, name)
    grads = torch.autograd.grad(loss * 1.5, (h1, w1))
    want_grads = torch.autograd.grad(want * 1.5, (h2, w2))
    assert not grads[0][~mask].any()
    assert_close(grads[0], want_grads[0], "gradient", dtype, "dhidden")
    assert_close(grads[1], want_grads[1], "gradient", dtype, "dweight")


def test_mask_and_spans_are_exclusive_and_checked(seed):
    hidden, weight, targets = inputs("cpu", torch.float32, b=2, t=5)
    spans = LossSpans.from_pairs([[(1, 2)], [(0, 5)]], 5)
    lp, old, adv = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask = spans.dense_mask()
    with pytest.raises(ValueError, match="exactly one of mask and loss_spans must be given, got both"):
        rk.policy_loss(lp, old, adv, mask, loss_spans=spans)
    with pytest.raises(ValueError, match="exactly one of mask and loss_spans must be given, got neither"):
        rk.fused_linear_policy_loss(hidden, weight, targets, old, adv)
    with pytest.raises(
        ValueError,
        match=r"logprob must have leading shape \[\.\.\., T\] with B = 2 sequences of T = 5 \(loss_spans' layout\), got \(2, 4\)",
    ):
        rk.policy_loss(lp[:, :4], old[:, :4], adv[:, :4], loss_spans=spans)
    with pytest.raises(ValueError, match=r"targets must have leading shape \[\.\.\., T\] with B = 2"):
        rk.linear_logprob(hidden[:1], weight, targets[:1], loss_spans=spans)
    with pytest.raises(TypeError, match="loss_spans must be a rl_kernel_core.spans.LossSpans or None, got Tensor"):
        rk.linear_logprob(hidden, weight, targets, loss_spans=mask)
    with pytest.raises(ValueError, match=r"targets ids must be in \[0, 67\)"):
        rk.fused_linear_policy_loss(hidden, weight, targets.masked_fill(mask, 10**6), old, adv, loss_spans=spans)


def _rows_of(pairs: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Each sequence's scored rows, one by one (the per-row oracle)."""
    return [[t for start, length in spans for t in range(start, start + length)] for spans in pairs]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_spans_built_on_the_device_equal_the_per_row_layout(seed, device):
    """Property (seeded draws): the index, counts, padded slots and masks built with vectorised
    ops on the device are those of the per-row definition, for spans given as pairs, as
    cu_offsets and as rows, on any layout (empty sequences, empty layouts, one-row spans)."""
    rng = random.Random(seed)
    for _ in range(200):
        b, t = rng.randrange(0, 7), rng.randrange(0, 30)
        pairs: list[list[tuple[int, int]]] = []
        for _ in range(b):
            spans: list[tuple[int, int]] = []
            low = 0
            while t and low < t and rng.random() < 0.7:
                start = rng.randrange(low, t)
                length = rng.randrange(1, t - start + 1)
                spans.append((start, length))
                low = start + length + rng.randrange(0, 3)
            pairs.append(spans)
        rows = _rows_of(pairs)
        counts = [len(r) for r in rows]
        width = max(counts, default=0)
        index = torch.tensor([s * t + r for s, row in enumerate(rows) for r in row], dtype=torch.int64)
        slots = torch.tensor([s * width + i for s, row in enumerate(rows) for i in range(len(row))], dtype=torch.int64)
        mask = torch.zeros(b, t, dtype=torch.bool)
        for s, row in enumerate(rows):
            mask[s, row] = True
        built = [LossSpans.from_pairs(pairs, t, device=device), LossSpans(rows, t, device=device)]
        if all(len(p) <= 1 for p in pairs):
            starts = [p[0][0] if p else 0 for p in pairs]
            built.append(
                LossSpans.from_cu_offsets(
                    torch.tensor(starts, dtype=torch.long), torch.tensor([0, *counts]).cumsum(0), t, device=device
                )
            )
        for made in built:
            where = f"seed {seed}: pairs {pairs}, T {t}"
            assert made.index.device.type == device and made.index.dtype == torch.int64, where
            assert torch.equal(made.index.cpu(), index) and torch.equal(made._padded_slot.cpu(), slots), where
            assert made.cu_seqlens.device.type == "cpu" and made.cu_seqlens.tolist() == [
                0,
                *torch.tensor(counts, dtype=torch.long).cumsum(0).tolist(),
            ], where
            assert (made.num_seqs, made.seq_len, made.max_seqlen, made.total) == (b, t, width, sum(counts)), where
            assert torch.equal(made.dense_mask().cpu(), mask), where


def test_building_spans_keeps_no_host_list_of_rows():
    """The rows are expanded on the device: building 64 sequences of 4096 scored rows allocates
    a few KB of Python objects (one per span), not a list of 262,144 row ids (tens of MB)."""
    import tracemalloc

    pairs = [[(0, 4096)] for _ in range(64)]
    tracemalloc.start()
    try:
        spans = LossSpans.from_pairs(pairs, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert spans.total == 64 * 4096 and peak < 2**20, peak


def test_huge_spans_are_refused_naming_the_argument(seed):
    """Property (seeded draws): spans covering more than MAX_ROWS rows in all, or a layout whose
    flat row ids pass int64, are refused at once (nothing allocated) with one line naming the span
    or seq_len, where they were a MemoryError after minutes of host lists."""
    from rl_kernel_core.spans import MAX_ROWS

    rng = random.Random(seed)
    for _ in range(100):
        kind = rng.choice(["one", "several", "layout"])
        if kind == "one":
            length = rng.randrange(MAX_ROWS + 1, 2**60)  # 3 sequences of such rows stay within int64
            start = rng.randrange(0, 2**40)
            b = rng.randrange(1, 4)
            pairs: list[list[tuple[int, int]]] = [[] for _ in range(b)]
            at = rng.randrange(b)
            pairs[at] = [(start, length)]
            call, expected = (
                (lambda: LossSpans.from_pairs(pairs, start + length + rng.randrange(0, 9))),
                rf"pairs\[{at}\]\[0\]: span",
            )
        elif kind == "several":
            n = rng.randrange(2, 6)
            length = MAX_ROWS // n + 1 + rng.randrange(0, 2**20)
            pairs = [[(0, length)] for _ in range(n)]
            call, expected = (
                (lambda: LossSpans.from_pairs(pairs, length)),
                r"pairs\[\d+\]\[0\]: span .* brings the scored rows to",
            )
        else:
            b = rng.randrange(2, 9)
            seq_len = 2**63 // b + 1 + rng.randrange(0, 2**40)
            pairs = [[] for _ in range(b)]
            call, expected = (lambda: LossSpans.from_pairs(pairs, seq_len)), r"^seq_len: \d+ sequences of \d+ rows"
        with pytest.raises(ValueError, match=expected) as info:
            call()
        assert "\n" not in str(info.value), (seed, str(info.value))
    with pytest.raises(
        ValueError,
        match=r"pairs\[0\]\[0\]: span \(start 0, length 2147483648\) brings the scored rows to 2147483648, "
        r"more than the 2147483647 a LossSpans holds",
    ):
        LossSpans.from_cu_offsets([0], [0, 2**31], 2**31)
