"""linear_logprob / logprob_from_logits: values, gradients, shapes, bad input and backend choice.

The oracle is written here independently of the implementation: fp64 ``log_softmax`` of the
upcast inputs (no chunking, no shift tricks). Tolerances come from rl_kernel_core.contract.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from rl_kernel_core.reference import logprob as reference

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- inputs and the fp64 oracle


def make_inputs(lead=(3, 7), d=32, v=200, dtype=torch.float32, ignore_index=-100, bias=True):
    """Random hidden/weight/bias/targets (logit std about 3); about a fifth of rows ignored."""
    hidden = torch.randn(*lead, d).to(dtype)
    weight = (torch.randn(v, d) * (3.0 / d**0.5)).to(dtype)
    b = torch.randn(v).to(dtype) if bias else None
    targets = torch.randint(0, v, lead)
    if targets.numel() >= 2:
        flat = targets.view(-1)
        drop = torch.rand(flat.shape) < 0.2
        drop[0], drop[1] = True, False  # at least one ignored and one kept row
        flat[drop] = ignore_index
    return hidden, weight, b, targets


def oracle(logits64, targets, temperature, ignore_index):
    """fp64 log p(target) and entropy of softmax(logits / T); ignored rows are 0."""
    logp = torch.log_softmax(logits64 / temperature, dim=-1)
    keep = targets != ignore_index
    lp = logp.gather(-1, torch.where(keep, targets, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = torch.special.entr(logp.exp()).sum(-1)  # -p log p, 0 where p = 0
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


def linear_oracle(hidden, weight, bias, targets, temperature, ignore_index):
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    return oracle(logits, targets, temperature, ignore_index)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def upstream(shape):
    """A non-uniform upstream gradient (never zero)."""
    return (torch.rand(shape, dtype=torch.float64) + 0.5) * torch.where(torch.rand(shape) < 0.5, -1.0, 1.0).double()


# ---------------------------------------------------------------- linear_logprob values


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_linear_logprob_matches_fp64_formula(seed, dtype, temperature, with_bias):
    hidden, weight, bias, targets = make_inputs(dtype=dtype, bias=with_bias)
    lp, ent = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=temperature, return_entropy=True)
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, temperature, -100)
    assert lp.dtype == ent.dtype == torch.float32
    assert lp.shape == ent.shape == targets.shape
    assert_close(lp, ref_lp, "logprob", dtype, "logprob")
    assert_close(ent, ref_ent, "logprob", dtype, "entropy")
    ignored = targets == -100
    assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert torch.all(lp[~ignored] < 0)
    lp_only = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=temperature)
    assert torch.equal(lp_only, lp)


def test_linear_logprob_fp64_in_fp64_out(seed):
    hidden, weight, bias, targets = make_inputs(dtype=torch.float64)
    lp, ent = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=1.3, return_entropy=True)
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, 1.3, -100)
    assert lp.dtype == ent.dtype == torch.float64
    assert_close(lp, ref_lp, "logprob", torch.float64, "logprob")
    assert_close(ent, ref_ent, "logprob", torch.float64, "entropy")


def test_custom_ignore_index_and_int32_targets(seed):
    hidden, weight, bias, targets = make_inputs(ignore_index=7)
    lp64 = rk.linear_logprob(hidden, weight, targets, bias=bias, ignore_index=7)
    lp32 = rk.linear_logprob(hidden, weight, targets.int(), bias=bias, ignore_index=7)
    assert torch.equal(lp64, lp32)
    assert_close(lp64, linear_oracle(hidden, weight, bias, targets, 1.0, 7)[0], "logprob", torch.float32, "logprob")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_boundaries(seed, monkeypatch, dtype):
    """N not a multiple of the chunk, and a chunk smaller than one row: same contract."""
    hidden, weight, bias, targets = make_inputs(lead=(2, 11), v=50, dtype=dtype)
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, 0.7, -100)
    g_lp, g_ent = upstream(targets.shape), upstream(targets.shape)
    for chunk in (50 * 4, 50 * 7, 3):  # 4 rows (22 = 5*4+2), 7 rows, and max(1, 3 // 50) = 1 row
        monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk)
        h, w, b = leaves(hidden, weight, bias)
        lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, return_entropy=True, backend="torch")
        assert_close(lp, ref_lp, "logprob", dtype, f"logprob chunk={chunk}")
        assert_close(ent, ref_ent, "logprob", dtype, f"entropy chunk={chunk}")
        grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w, b))
        for name, got, want in zip(("hidden", "weight", "bias"), grads, formula_grads(hidden, weight, bias, targets, 0.7, g_lp, g_ent)):
            assert_close(got, want, "gradient", dtype, f"d{name} chunk={chunk}")


def test_noncontiguous_inputs_give_identical_results(seed):
    hidden, weight, bias, targets = make_inputs(lead=(4, 9), d=24, v=64)
    # hidden as a [B, T, D] view of a [T, B, 2D] buffer (strided in every dim), targets transposed.
    hid_buf = torch.randn(9, 4, 48)
    hid_buf[:, :, ::2] = hidden.transpose(0, 1)
    hidden_nc = hid_buf[:, :, ::2].transpose(0, 1)
    targets_nc = targets.T.contiguous().T
    weight_nc = weight.T.contiguous().T
    assert not (hidden_nc.is_contiguous() or targets_nc.is_contiguous() or weight_nc.is_contiguous())
    g = upstream(targets.shape).float()
    results = []
    for h, w, t in ((hidden, weight, targets), (hidden_nc, weight_nc, targets_nc)):
        h, w = leaves(h, w)
        lp, ent = rk.linear_logprob(h, w, t, bias=bias, temperature=0.9, return_entropy=True)
        results.append((lp, ent, *torch.autograd.grad((lp * g).sum() + (ent * g).sum(), (h, w))))
    for name, a, b in zip(("logprob", "entropy", "dhidden", "dweight"), *results):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty_input_returns_empty(lead):
    hidden, weight, bias, targets = make_inputs(lead=lead)
    h, w, b = leaves(hidden, weight, bias)
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, return_entropy=True)
    assert lp.shape == ent.shape == targets.shape and lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(h.grad, torch.zeros_like(hidden))
    logits = torch.randn(*lead, 30, requires_grad=True)
    lp = rk.logprob_from_logits(logits, torch.randint(0, 30, lead))
    assert lp.shape == lead
    lp.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


def test_deterministic_run_to_run(seed):
    hidden, weight, bias, targets = make_inputs(lead=(5, 13), d=48, v=300)
    g = upstream(targets.shape).float()
    runs = []
    for _ in range(2):
        h, w, b = leaves(hidden, weight, bias)
        lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.8, return_entropy=True)
        runs.append((lp, ent, *torch.autograd.grad((lp * g).sum() - (ent * g).sum(), (h, w, b))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- linear_logprob gradients


def formula_grads(hidden, weight, bias, targets, temperature, g_lp, g_ent):
    h, w, b = leaves(hidden.double(), weight.double(), None if bias is None else bias.double())
    lp, ent = linear_oracle(h, w, b, targets, temperature, -100)
    loss = (lp * g_lp).sum() + (ent * g_ent).sum()
    return torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_linear_logprob_gradients_match_fp64_autograd(seed, dtype, with_entropy):
    hidden, weight, bias, targets = make_inputs(dtype=dtype)
    g_lp = upstream(targets.shape)
    g_ent = upstream(targets.shape) if with_entropy else torch.zeros_like(g_lp)
    h, w, b = leaves(hidden, weight, bias)
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, return_entropy=True)
    loss = (lp * g_lp.float()).sum() + ((ent * g_ent.float()).sum() if with_entropy else 0.0)
    loss.backward()
    for name, leaf, want in zip(("hidden", "weight", "bias"), (h, w, b), formula_grads(hidden, weight, bias, targets, 0.7, g_lp, g_ent)):
        assert leaf.grad.dtype == dtype, name
        assert_close(leaf.grad, want, "gradient", dtype, f"d{name}")


def test_ignored_rows_get_no_gradient(seed):
    hidden, weight, bias, targets = make_inputs()
    h, = leaves(hidden)
    lp, ent = rk.linear_logprob(h, weight, targets, bias=bias, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    ignored = targets == -100
    assert torch.all(h.grad[ignored] == 0)
    assert torch.all(h.grad[~ignored].abs().sum(-1) > 0)


def test_entropy_only_gradient(seed):
    hidden, weight, bias, targets = make_inputs(dtype=torch.float32)
    g_ent = upstream(targets.shape)
    h, w, b = leaves(hidden, weight, bias)
    _, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=1.5, return_entropy=True)
    (ent * g_ent.float()).sum().backward()
    want = formula_grads(hidden, weight, bias, targets, 1.5, torch.zeros_like(g_ent), g_ent)
    for name, leaf, ref in zip(("hidden", "weight", "bias"), (h, w, b), want):
        assert_close(leaf.grad, ref, "gradient", torch.float32, f"d{name}")


@pytest.mark.parametrize("with_entropy", [False, True])
def test_linear_logprob_gradcheck(seed, with_entropy):
    hidden, weight, bias, targets = make_inputs(lead=(2, 3), d=5, v=7, dtype=torch.float64)

    def fn(h, w, b):
        return rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, return_entropy=with_entropy, backend="torch")

    assert torch.autograd.gradcheck(fn, tuple(leaves(hidden, weight, bias)))


# ---------------------------------------------------------------- logprob_from_logits


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_logprob_from_logits_values_and_gradients(seed, dtype):
    _, _, _, targets = make_inputs(lead=(3, 7))
    logits = (torch.randn(3, 7, 200) * 3).to(dtype).requires_grad_()
    lp, ent = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True)
    ref_lp, ref_ent = oracle(logits.detach().double(), targets, 0.7, -100)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    assert_close(lp, ref_lp, "logprob", dtype, "logprob")
    assert_close(ent, ref_ent, "logprob", dtype, "entropy")
    g_lp, g_ent = upstream(targets.shape), upstream(targets.shape)
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
    _, _, _, targets = make_inputs(lead=(4, 5), v=60)
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
    hidden, weight, bias, targets = make_inputs(dtype=torch.float64)
    a = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=0.6, return_entropy=True)
    b = rk.logprob_from_logits(hidden @ weight.T + bias, targets, temperature=0.6, return_entropy=True)
    for x, y in zip(a, b):
        assert_close(x, y, "logprob", torch.float64)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprob_from_logits_gradcheck(seed, with_entropy):
    _, _, _, targets = make_inputs(lead=(2, 3), v=7)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)

    def fn(x):
        return rk.logprob_from_logits(x, targets, temperature=1.3, return_entropy=with_entropy, backend="torch")

    assert torch.autograd.gradcheck(fn, (logits,))


# ---------------------------------------------------------------- bad input


def _call(**overrides):
    hidden, weight, bias, targets = make_inputs(lead=(2, 3), d=8, v=10)
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, bias=bias)
    kwargs.update(overrides)
    h, w, t = kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets")
    return rk.linear_logprob(h, w, t, **kwargs)


@pytest.mark.parametrize(
    "overrides,error,names",
    [
        (dict(hidden=[[1.0] * 8]), TypeError, "hidden"),
        (dict(weight=torch.randn(10, 8).numpy()), TypeError, "weight"),
        (dict(hidden=torch.randint(0, 5, (2, 3, 8))), TypeError, "hidden"),
        (dict(weight=torch.randn(10, 8, dtype=torch.float64)), TypeError, "weight"),
        (dict(bias=torch.randn(10, dtype=torch.float16)), TypeError, "bias"),
        (dict(targets=torch.rand(2, 3) * 5), TypeError, "targets"),
        (dict(weight=torch.randn(10, 9)), ValueError, "weight"),
        (dict(weight=torch.randn(10)), ValueError, "weight"),
        (dict(weight=torch.randn(0, 8)), ValueError, "weight"),
        (dict(targets=torch.randint(0, 10, (3, 2))), ValueError, "targets"),
        (dict(targets=torch.randint(0, 10, (6,))), ValueError, "targets"),
        (dict(targets=torch.full((2, 3), 10)), ValueError, "targets"),
        (dict(targets=torch.full((2, 3), -1)), ValueError, "targets"),
        (dict(bias=torch.randn(11)), ValueError, "bias"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(temperature=1e-40), ValueError, r"temperature must be >= 1.1754944e-38 .*got 1e-40"),
        (dict(temperature=1e-45), ValueError, "temperature"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(ignore_index=-(2**70)), ValueError, r"ignore_index must be in the int64 range .*got -1180591620717411303424"),
        (dict(ignore_index=2**63), ValueError, "ignore_index"),
        (dict(return_entropy=1), TypeError, "return_entropy"),
        (dict(weight=torch.randn(10, 8, device="meta")), ValueError, "weight"),
        (dict(targets=torch.randint(0, 10, (2, 3), device="meta")), ValueError, "targets"),
        (dict(weight=torch.randn(10, 8).to_sparse()), TypeError, "weight must be a dense"),
        (dict(weight=torch.randn(10, 8).to_sparse_csr()), TypeError, "weight must be a dense .*sparse_csr"),
        (dict(hidden=torch.randn(2, 3, 8, device="meta"), weight=torch.randn(10, 8, device="meta"),
              targets=torch.zeros(2, 3, dtype=torch.long, device="meta"), bias=None), ValueError, "targets must hold data"),
        (dict(tp_group="group"), TypeError, "tp_group"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_linear_logprob_rejects_bad_input(overrides, error, names):
    with pytest.raises(error, match=names):
        _call(**overrides)


def test_smallest_temperature_is_served(seed):
    """The smallest temperature taken gives finite log-probs: 0 at the argmax, (z - max z) / T elsewhere."""
    logits = torch.tensor([[0.5, 2.0, 1.0]])
    tiny = torch.finfo(torch.float32).tiny
    lp = rk.logprob_from_logits(logits.expand(3, 3), torch.tensor([0, 1, 2]), temperature=tiny)
    assert torch.isfinite(lp).all() and lp[1].item() == 0.0
    assert_close(lp, (logits[0].double() - 2.0) / tiny, "logprob", torch.float32, "logprob")


def test_out_of_range_message_names_range():
    with pytest.raises(ValueError, match=r"targets ids must be in \[0, 10\).*got 2 outside it, in \[-3, 12\]"):
        _call(targets=torch.tensor([[0, 12, 3], [-3, 2, -100]]))


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
        (torch.randn(2, 5, device="meta"), torch.ones(2, dtype=torch.long, device="meta"), {}, ValueError, "targets must hold data .*got a meta tensor"),
        (torch.randn(2, 5).to_sparse(), torch.ones(2, dtype=torch.long), {}, TypeError, "logits must be a dense .*sparse_coo"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long).to_sparse(), {}, TypeError, "targets must be a dense"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long), {"temperature": 0}, ValueError, "temperature"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long), {"temperature": 1e-45}, ValueError, "temperature"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long), {"temperature": 10**400}, ValueError, "temperature must be a finite number > 0, got an int of"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.int32), {"ignore_index": -(2**70)}, ValueError, "ignore_index"),
        (torch.randn(2, 5), torch.ones(2, dtype=torch.long), {"return_entropy": "yes"}, TypeError, "return_entropy"),
    ],
)
def test_logprob_from_logits_rejects_bad_input(logits, targets, kwargs, error, name):
    with pytest.raises(error, match=name):
        rk.logprob_from_logits(logits, targets, **kwargs)


# ---------------------------------------------------------------- backend choice


def test_backend_torch_is_recorded(seed, monkeypatch):
    monkeypatch.delenv("RL_KERNEL_BACKEND", raising=False)
    hidden, weight, bias, targets = make_inputs()
    auto = rk.linear_logprob(hidden, weight, targets, bias=bias, backend="auto")
    assert dispatch.explain("linear_logprob").backend == "torch"  # CPU inputs: only torch runs them
    explicit = rk.linear_logprob(hidden, weight, targets, bias=bias, backend="torch")
    decision = dispatch.explain("linear_logprob")
    assert decision.backend == "torch" and decision.requested == "torch"
    assert torch.equal(auto, explicit)
    rk.logprob_from_logits(torch.randn(4, 9), torch.randint(0, 9, (4,)), backend="torch")
    assert dispatch.explain("logprob_from_logits").backend == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_native_backend_on_cpu_says_why():
    hidden, weight, bias, targets = make_inputs()
    with pytest.raises(rk.BackendUnavailableError, match=r"linear_logprob: backend='native' cannot run: .+"):
        rk.linear_logprob(hidden, weight, targets, backend="native")
    with pytest.raises(rk.BackendUnavailableError, match=r"logprob_from_logits: backend='native' cannot run: .+"):
        rk.logprob_from_logits(torch.randn(3, 5), torch.ones(3, dtype=torch.long), backend="native")
