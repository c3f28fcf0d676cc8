"""logprob_from_logits: the shared cases on every backend, the reference's own properties, bad input.

The shared cases run on each backend serving the op (``op_backends.on_backends``): ``torch`` on CPU,
``triton`` under the interpreter on CPU and compiled on CUDA, ``native`` on CUDA. Each is checked
against fp64 formulas written independently of the package (log-softmax of the upcast logits,
in ``oracles``), with tolerances from rl_kernel_core.contract, on fresh random inputs (never
zeros): odd sizes (V not a multiple of the vector width or of a block), several vocab blocks,
logits of magnitude 100, all-equal logits, ``-inf`` entries, temperature 0.7, ignore_index rows.
Determinism and row independence are asserted bitwise.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from rl_kernel_core.logprob import reference as reference
from op_backends import Backend, on_backends
from oracles import check_logprob, logprob_oracle, make_logits, upstream
from peak_memory import measure_peak, skip_without_proc

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
on_every_backend = on_backends("logprob_from_logits")
on_fast_backends = on_backends("logprob_from_logits", exclude=("torch",))
on_gpu_backends = on_backends("logprob_from_logits", exclude=("torch", "triton-interpret"))


# ============================================================== shared cases, every backend


@on_every_backend
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [301, 2048])  # rows not 16-byte aligned (element loads), and aligned (vector path)
def test_logprob_values_and_gradients(seed, backend: Backend, dtype, temperature, vocab):
    logits, targets = make_logits(7, vocab, dtype, backend.device)
    check_logprob(logits, targets, temperature, backend=backend.name)


@on_every_backend
@pytest.mark.parametrize("vocab", [4096 + 37, 32000])
def test_logprob_long_rows(seed, backend: Backend, vocab):
    # V > 4096: the online log-sum-exp crosses blocks, many loads per thread, a partial last
    # block or scalar tail (4133) or none (32000)
    logits, targets = make_logits(5, vocab, torch.bfloat16, backend.device)
    check_logprob(logits, targets, 0.7, backend=backend.name)


@on_every_backend
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 257), (torch.bfloat16, 256)])
def test_logprob_large_magnitude_and_all_equal_logits(seed, backend: Backend, with_entropy, dtype, vocab):
    logits, targets = make_logits(5, vocab, torch.float32, backend.device, ignore_frac=0.0)
    logits[0] = torch.where(torch.rand(vocab, device=backend.device) < 0.5, -100.0, 100.0)
    logits[1] = 100.0 * torch.rand(vocab, device=backend.device)
    logits[2] = -100.0
    logits[3] = 3.25
    check_logprob(logits.to(dtype), targets, 0.7, with_entropy, backend=backend.name)


def _masked_oracle(logits, targets, temperature, ignore_index):
    """fp64 log p(target) and entropy where -inf entries have probability 0, add 0 to the entropy
    and get a zero gradient (``p * log p`` is formed from a log p that is 0 there, not -inf)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    keep = targets != ignore_index
    lp = logp.gather(-1, torch.where(keep, targets, 0).long().unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


@on_every_backend
def test_logprob_masked_entries_get_zero_probability_and_gradient(seed, backend: Backend):
    logits, targets = make_logits(6, 1000, torch.float32, backend.device, ignore_frac=0.0)
    masked = torch.rand(6, 1000, device=backend.device) < 0.3
    masked[torch.arange(6), targets] = False
    logits[masked] = float("-inf")
    _, _, grad = check_logprob(logits, targets, 0.7, oracle=_masked_oracle, backend=backend.name)
    assert torch.equal(grad[masked], torch.zeros_like(grad[masked]))


@on_every_backend
def test_logprob_gradient_through_entropy_only_and_logprob_only(seed, backend: Backend):
    logits, targets = make_logits(4, 129, torch.float32, backend.device)
    x = logits.clone().requires_grad_()
    x64 = logits.double().requires_grad_()
    _, ent = rk.logprob_from_logits(x, targets, return_entropy=True, backend=backend.name)
    ent.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[1].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via entropy")
    x.grad, x64.grad = None, None
    lp, _ = rk.logprob_from_logits(x, targets, return_entropy=True, backend=backend.name)
    lp.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[0].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via logprob")


@on_every_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_ignored_rows_are_zero_with_zero_gradient(seed, backend: Backend, dtype):
    logits, targets = make_logits(5, 64, dtype, backend.device, ignore_frac=0.0)
    targets[1:3] = 7  # a custom ignore id that is also a valid vocabulary id elsewhere
    lp, ent, grad = check_logprob(logits, targets, 1.0, True, ignore_index=7, backend=backend.name)
    zeros = torch.zeros(2, device=backend.device)
    assert torch.equal(lp[1:3], zeros) and torch.equal(ent[1:3], zeros)
    assert torch.equal(grad[1:3], torch.zeros_like(grad[1:3]))


@on_every_backend
@pytest.mark.parametrize(
    "dtype,row,offset,vocab",
    [(torch.float32, 90, 5, 80), (torch.bfloat16, 112, 5, 96), (torch.bfloat16, 112, 8, 96)],
    ids=["fp32", "bf16-unaligned", "bf16-aligned"],  # bf16 rows 16-byte aligned or not
)
def test_logprob_row_strided_logits_and_leading_dims(seed, backend: Backend, dtype, row, offset, vocab):
    base = (torch.randn(2, 3, row) * 3).to(dtype).to(backend.device)
    logits = base[..., offset : offset + vocab]  # unit stride along V, rows strided: passed without a copy
    targets = torch.randint(0, vocab, (2, 3), device=backend.device)
    x = logits.detach().clone().requires_grad_()
    lp_strided = rk.logprob_from_logits(logits, targets, backend=backend.name)
    lp_contig = rk.logprob_from_logits(x, targets, backend=backend.name)
    assert lp_strided.shape == (2, 3)
    assert torch.equal(lp_strided, lp_contig)  # alignment never changes the bits
    assert_close(lp_strided, logprob_oracle(logits, targets, 1.0, -100)[0], "logprob", dtype, "strided logprob")


@on_every_backend
def test_logprob_deterministic_and_row_independent(seed, backend: Backend):
    device = backend.device
    logits, targets = make_logits(11, 4096 + 100, torch.bfloat16, device)
    g_lp, g_ent = upstream(11, device).float(), upstream(11, device).float()

    def run(x, t, rows=slice(None)):
        x = x.detach().clone().requires_grad_()
        lp, ent = rk.logprob_from_logits(x, t, temperature=0.7, return_entropy=True, backend=backend.name)
        ((lp * g_lp[rows]).sum() + (ent * g_ent[rows]).sum()).backward()
        return lp, ent, x.grad

    first, second = run(logits, targets), run(logits, targets)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    # the old/ref passes skip the entropy and the gradient: the same log-prob bits (ratio exactly 1)
    with torch.no_grad():
        assert torch.equal(rk.logprob_from_logits(logits, targets, temperature=0.7, backend=backend.name), first[0])
    # a row's bits do not depend on N or on the other rows
    sub = run(logits[3:5].flip(0), targets[3:5].flip(0), torch.tensor([4, 3], device=device))
    for a, b in zip(sub, first):
        assert torch.equal(a, b[3:5].flip(0))


@on_every_backend
def test_logprob_no_grad_builds_no_graph(seed, backend: Backend):
    logits, targets = make_logits(4, 50, torch.float32, backend.device)
    logits.requires_grad_()
    with torch.no_grad():
        lp, ent = rk.logprob_from_logits(logits, targets, return_entropy=True, backend=backend.name)
    assert lp.grad_fn is None and ent.grad_fn is None


# ============================================================== shared cases, the fast backends


@on_fast_backends
def test_logprob_matches_the_other_backends(seed, backend: Backend):
    logits, targets = make_logits(7, 333, torch.bfloat16, backend.device)
    ours = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend=backend.name)
    for other in ("torch", "triton"):
        if other == backend.name:
            continue
        theirs = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend=other)
        for a, b, name in zip(ours, theirs, ("logprob", "entropy")):
            assert_close(a, b.double(), "logprob", torch.bfloat16, f"{name} vs {other}")


@on_fast_backends
def test_logprob_fast_backends_refuse_fp64_by_name(seed, backend: Backend):
    logits, targets = make_logits(3, 20, torch.float64, backend.device)
    with pytest.raises(rk.BackendUnavailableError, match="logits is float64"):
        rk.logprob_from_logits(logits, targets, backend=backend.name)


@on_fast_backends
def test_logprob_custom_op_passes_opcheck(seed, backend: Backend):
    """The fake impl, schema and autograd registration agree with the real kernels."""
    logits, targets = make_logits(4, 40, torch.float32, backend.device)
    op = getattr(torch.ops.rl_kernel, f"{backend.name}_logprob_from_logits")
    torch.library.opcheck(op, (logits.requires_grad_(), targets, 0.8, -100, True))


@on_gpu_backends
@pytest.mark.parametrize("n,v", [(1021, 151936), (2048, 128256), (1000, 32000)])
def test_logprob_realistic(seed, backend: Backend, n, v):
    logits, targets = make_logits(n, v, torch.bfloat16, "cuda", scale=3.0)
    logits[:7] = logits[:7] * 30  # logits of magnitude ~100
    check_logprob(logits, targets, 0.7, backend=backend.name)
    first = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend=backend.name)
    again = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend=backend.name)
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    half = rk.logprob_from_logits(logits[: n // 2], targets[: n // 2], temperature=0.7, backend=backend.name)
    assert torch.equal(half, first[0][: n // 2])


# ============================================================== the reference (torch) on CPU


def _targets(lead, v, ignore_index=-100):
    """Random ids in [0, v) with about a fifth ignored (at least one ignored and one kept)."""
    targets = torch.randint(0, v, lead)
    if targets.numel() >= 2:
        flat = targets.view(-1)
        drop = torch.rand(flat.shape) < 0.2
        drop[0], drop[1] = True, False
        flat[drop] = ignore_index
    return targets


def oracle(logits64, targets, temperature, ignore_index):
    """fp64 log p(target) and entropy of softmax(logits / T); ignored rows are 0."""
    logp = torch.log_softmax(logits64 / temperature, dim=-1)
    keep = targets != ignore_index
    lp = logp.gather(-1, torch.where(keep, targets, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = torch.special.entr(logp.exp()).sum(-1)  # -p log p, 0 where p = 0
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_logprob_from_logits_values_and_gradients(seed, dtype):
    targets = _targets((3, 7), 200)
    logits = (torch.randn(3, 7, 200) * 3).to(dtype).requires_grad_()
    lp, ent = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True)
    ref_lp, ref_ent = oracle(logits.detach().double(), targets, 0.7, -100)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    assert_close(lp, ref_lp, "logprob", dtype, "logprob")
    assert_close(ent, ref_ent, "logprob", dtype, "entropy")
    g_lp, g_ent = upstream(targets.shape, "cpu"), upstream(targets.shape, "cpu")
    ((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum()).backward()
    x = logits.detach().double().requires_grad_()
    r_lp, r_ent = oracle(x, targets, 0.7, -100)
    (want,) = torch.autograd.grad((r_lp * g_lp).sum() + (r_ent * g_ent).sum(), x)
    assert logits.grad is not None and logits.grad.dtype == dtype
    assert_close(logits.grad, want, "gradient", dtype, "dlogits")
    assert torch.all(logits.grad[targets == -100] == 0)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_masked_logits_stay_finite(seed, with_entropy):
    """-inf logits (vocab masked by the framework) carry zero probability, not nan."""
    targets = _targets((4, 5), 60)
    logits = torch.randn(4, 5, 60) * 3
    masked = torch.rand(logits.shape) < 0.3
    masked.scatter_(-1, torch.where(targets == -100, 0, targets).unsqueeze(-1), False)
    logits = logits.masked_fill(masked, float("-inf")).requires_grad_()
    lp, ent = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True)
    ref_lp, ref_ent = oracle(logits.detach().double(), targets, 0.9, -100)
    assert_close(lp, ref_lp, "logprob", torch.float32, "logprob")
    assert_close(ent, ref_ent, "logprob", torch.float32, "entropy")
    (lp.sum() + (ent.sum() if with_entropy else 0.0)).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert torch.all(logits.grad[masked] == 0)


def test_logprob_from_logits_strided_and_chunked(seed, monkeypatch):
    """Strided logits (a sliced [B, T-1, V] view; rows of a wider buffer) give the bits of their
    contiguous copy, for any chunk size: each row is reduced on its own."""
    full = (torch.randn(3, 10, 40) * 3).to(torch.bfloat16)
    wide = (torch.randn(27, 64) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 40, (3, 9))
    targets[0, 0] = -100
    for view, t in ((full[:, :-1], targets), (wide[:, 5:45], targets.reshape(-1))):
        assert not view.is_contiguous()
        ref = rk.logprob_from_logits(view.contiguous(), t, temperature=0.8, return_entropy=True)
        for chunk in (40 * 4, 1, reference.CHUNK_ELEMENTS):
            monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk)
            got = rk.logprob_from_logits(view, t, temperature=0.8, return_entropy=True)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), chunk
            monkeypatch.undo()


def test_logprob_from_logits_agrees_with_linear_logprob(seed):
    hidden = torch.randn(3, 7, 32, dtype=torch.float64)
    weight = torch.randn(200, 32, dtype=torch.float64) * (3.0 / 32**0.5)
    bias = torch.randn(200, dtype=torch.float64)
    targets = _targets((3, 7), 200)
    a = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=0.6, return_entropy=True)
    b = rk.logprob_from_logits(hidden @ weight.T + bias, targets, temperature=0.6, return_entropy=True)
    for x, y in zip(a, b):
        assert_close(x, y, "logprob", torch.float64)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprob_from_logits_gradcheck(seed, with_entropy):
    targets = _targets((2, 3), 7)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)

    def fn(x):
        return rk.logprob_from_logits(x, targets, temperature=1.3, return_entropy=with_entropy, backend="torch")

    assert torch.autograd.gradcheck(fn, (logits,))


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_logprob_from_logits_empty_input_returns_empty(lead):
    logits = torch.randn(*lead, 30, requires_grad=True)
    lp = rk.logprob_from_logits(logits, torch.randint(0, 30, lead))
    assert lp.shape == lead
    lp.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


def test_smallest_temperature_is_served(seed):
    """The smallest temperature taken gives finite log-probs: 0 at the argmax, (z - max z) / T elsewhere."""
    logits = torch.tensor([[0.5, 2.0, 1.0]])
    tiny = torch.finfo(torch.float32).tiny
    lp = rk.logprob_from_logits(logits.expand(3, 3), torch.tensor([0, 1, 2]), temperature=tiny)
    assert torch.isfinite(lp).all() and lp[1].item() == 0.0
    assert_close(lp, (logits[0].double() - 2.0) / tiny, "logprob", torch.float32, "logprob")


@skip_without_proc
def test_logprob_from_logits_makes_no_fp32_copy():
    """bf16 logits: the forward stays well under one fp32 copy of the logits; forward+backward
    holds the bf16 gradient (one logits-sized bf16 tensor) plus chunks, never an fp32 copy."""
    n, v = 4096, 32000
    got = measure_peak("from_logits", n, v, 0)
    fp32_copy = n * v * 4
    bf16_grad = n * v * 2
    assert got["forward_extra"] < fp32_copy / 4, got
    assert got["extra"] < bf16_grad + fp32_copy / 4, got


# ============================================================== bad input


@pytest.mark.parametrize(
    "logits,targets,kwargs,error,name",
    [
        ("not a tensor", torch.zeros(2, dtype=torch.long), {}, TypeError, "logits"),
        (torch.randint(0, 3, (2, 5)), torch.ones(2, dtype=torch.long), {}, TypeError, "logits"),
        (torch.randn(2, 5), torch.ones(2), {}, TypeError, "targets"),
        (torch.randn(2, 5), torch.ones(3, dtype=torch.long), {}, ValueError, "targets"),
        (torch.randn(2, 5), torch.tensor([1, 5]), {}, ValueError, "targets"),
        (torch.randn(2, 0), torch.ones(2, dtype=torch.long), {}, ValueError, "logits"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long, device="meta"), {}, ValueError, "targets"),
        (
            torch.randn(2, 5, device="meta"),
            torch.ones(2, dtype=torch.long, device="meta"),
            {},
            ValueError,
            "targets must hold data .*got a meta tensor",
        ),
        (
            torch.randn(2, 5).to_sparse(),
            torch.ones(2, dtype=torch.long),
            {},
            TypeError,
            "logits must be a dense .*sparse_coo",
        ),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long).to_sparse(), {}, TypeError, "targets must be a dense"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long), {"temperature": 0}, ValueError, "temperature"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long), {"temperature": 1e-45}, ValueError, "temperature"),
        (
            torch.randn(2, 5),
            torch.ones(2, dtype=torch.long),
            {"temperature": 10**400},
            ValueError,
            "temperature must be a finite number > 0, got an int of",
        ),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.int32), {"ignore_index": -(2**70)}, ValueError, "ignore_index"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long), {"return_entropy": "yes"}, TypeError, "return_entropy"),
        (
            torch.randn(2, 5),
            torch.ones(2, dtype=torch.long),
            {"id_check": "never"},
            ValueError,
            "id_check must be one of",
        ),
    ],
)
def test_logprob_from_logits_rejects_bad_input(logits, targets, kwargs, error, name):
    with pytest.raises(error, match=name):
        rk.logprob_from_logits(logits, targets, **kwargs)


def test_device_id_check_gives_the_same_values_without_a_host_read(seed, device):
    """``id_check="device"`` (an engine's sampler loop): the same bits as the default; a bad id is
    still caught, by a device-side assert (on CPU it raises at once)."""
    logits = torch.randn(37, 301, device=device)
    targets = torch.randint(0, 301, (37,), device=device)
    want = rk.logprob_from_logits(logits, targets, temperature=0.7)
    assert torch.equal(rk.logprob_from_logits(logits, targets, temperature=0.7, id_check="device"), want)
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="targets ids must be in"):
            rk.logprob_from_logits(logits, torch.full_like(targets, 301), id_check="device")
