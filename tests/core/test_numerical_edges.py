"""Edge cases of the ops on every backend: masked (-inf) logits, one logits route per row, double backward.

Each case runs on CPU (the torch backend, and the Triton kernels under the interpreter:
``TRITON_INTERPRET=1`` is set per test, the kernels pick interpreted execution at launch time)
and, marked ``gpu``, on CUDA for the triton, native and torch backends.

* ``-inf`` logits (a ``-inf`` bias entry for ``linear_logprob``) carry probability 0: finite
  log-probs and entropies, gradient 0 at the masked entries, no NaN anywhere; a row whose only
  finite logit is the target has log-prob 0 and entropy 0; a ``-inf`` target has log-prob
  ``-inf`` and a finite gradient. Values against fp64 formulas written here over the finite
  entries, tolerances from ``rl_kernel_core.contract``.
* A row's log-prob has the same bits with and without entropy, with and without grad, and inside
  ``fused_linear_policy_loss`` (asserted with ``torch.equal``).
* A backward asked for ``create_graph=True`` through an op whose backward is not differentiable
  raises at once, naming the op.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss import reference as reference_loss

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes

INF = float("inf")
CASES = [
    pytest.param(("cpu", "torch", None), id="cpu-torch"),
    pytest.param(("cpu", "triton", "gemm"), id="cpu-triton-gemm"),
    pytest.param(("cpu", "triton", "chunked"), id="cpu-triton-chunked"),
    pytest.param(("cuda", "torch", None), id="cuda-torch", marks=pytest.mark.gpu),
    pytest.param(("cuda", "triton", "gemm"), id="cuda-triton-gemm", marks=pytest.mark.gpu),
    pytest.param(("cuda", "triton", "chunked"), id="cuda-triton-chunked", marks=pytest.mark.gpu),
    pytest.param(("cuda", "native", None), id="cuda-native", marks=pytest.mark.gpu),
]


@pytest.fixture(params=CASES)
def where(request, monkeypatch, tune):
    """``(device, backend)``; CPU Triton runs in the interpreter, on the Triton linear route named."""
    device, backend, route = request.param
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if route is not None:
        tune(route=route)
    return torch.device(device), backend


def masked_row_oracle(z: torch.Tensor, target: int, g_lp: float, g_ent: float):
    """fp64 ``(logprob, entropy, d/dz)`` of one row of scaled logits ``z [V]`` that may hold -inf.

    The softmax is taken over the finite entries only (autograd on that sub-vector); -inf
    entries get gradient 0, except a -inf target, whose log-prob ``z_t - lse`` is -inf with
    derivative 1 in ``z_t`` and ``-p`` in the others.
    """
    finite = torch.isfinite(z)
    sub = z[finite].double().detach().requires_grad_()
    logp = torch.log_softmax(sub, dim=0)
    ent = -(logp.exp() * logp).sum()
    grad = torch.zeros(z.shape, dtype=torch.float64)
    if bool(finite[target]):
        pos = int(finite[:target].sum())
        lp = logp[pos]
        (g,) = torch.autograd.grad(g_lp * lp + g_ent * ent, sub)
        grad[finite] = g
        return lp.detach(), ent.detach(), grad
    (g,) = torch.autograd.grad(g_ent * ent - g_lp * torch.logsumexp(sub, dim=0), sub)
    grad[finite] = g
    grad[target] = g_lp
    return torch.tensor(-INF, dtype=torch.float64), ent.detach(), grad


def oracle(z: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor):
    """Rows of :func:`masked_row_oracle` stacked: ``(logprob [N], entropy [N], d/dz [N, V])``, fp64 on CPU."""
    rows = [masked_row_oracle(z[i].cpu(), int(targets[i]), float(g_lp[i]), float(g_ent[i])) for i in range(z.shape[0])]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows])


def check_logprob(lp, ent, lp64, ent64, dtype):
    """-inf where the oracle is -inf, else within the contract; no NaN."""
    assert not lp.isnan().any() and not ent.isnan().any()
    lp, ent = lp.detach().cpu(), ent.detach().cpu()
    neg = torch.isinf(lp64)
    assert torch.equal(torch.isinf(lp) & (lp < 0), neg)
    assert_close(lp[~neg], lp64[~neg], "logprob", dtype, "logprob")
    assert_close(ent, ent64, "logprob", dtype, "entropy")


def masked_logits(device, dtype):
    """Rows of scaled-logit magnitude ~3 over V = 4200 (two 4096-wide blocks of the Triton
    ``logprob_from_logits``), with -inf entries: scattered; the whole first block; everything
    but the target; and at the target itself."""
    n, v = 5, 4200
    logits = torch.randn(n, v) * 3
    targets = torch.randint(0, v, (n,))
    logits[0, torch.rand(v) < 0.3] = -INF
    targets[0] = int(torch.isfinite(logits[0]).nonzero()[0])
    logits[1, :4096] = -INF
    targets[1] = 4100
    logits[2] = -INF
    logits[2, 7] = 1.5
    targets[2] = 7
    logits[3, targets[3]] = -INF
    logits[4, 4096:] = -INF
    targets[4] = 10
    return logits.to(dtype).to(device), targets.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_from_logits_masked_entries(seed, where, dtype):
    device, backend = where
    logits, targets = masked_logits(device, dtype)
    x = logits.clone().requires_grad_()
    lp, ent = rk.logprob_from_logits(x, targets, temperature=0.7, return_entropy=True, backend=backend)
    g_lp, g_ent = torch.rand(5, device=device) + 0.5, -(torch.rand(5, device=device) + 0.5)
    (grad,) = torch.autograd.grad([lp, ent], [x], [g_lp, g_ent])
    lp64, ent64, dz64 = oracle(logits.double() / 0.7, targets, g_lp.double(), g_ent.double())
    check_logprob(lp, ent, lp64, ent64, dtype)
    assert not grad.isnan().any()
    masked = ~torch.isfinite(logits.cpu()) & (torch.arange(4200) != targets.cpu()[:, None])
    assert (grad.cpu()[masked] == 0).all()
    assert_close(grad, dz64 / 0.7, "gradient", dtype, "d logits")


def linear_inputs(device, dtype, only_target: bool):
    """hidden/weight/targets and a bias with -inf entries: over whole vocab tiles and scattered
    (``only_target``: -inf everywhere but the one column every row targets)."""
    n, d, v = 7, 40, 300
    hidden = torch.randn(n, d)
    weight = torch.randn(v, d) / d**0.5 * 3
    bias = torch.randn(v)
    targets = torch.randint(0, v, (n,))
    if only_target:
        bias.fill_(-INF)
        bias[211] = 0.5
        targets.fill_(211)
    else:
        bias[:140] = -INF
        bias[200:230:3] = -INF
        targets[:5] = torch.tensor([150, 299, 3, 203, 141])  # rows 2 and 3: a -inf target
    return [t.to(dtype).to(device) for t in (hidden, weight, bias)] + [targets.to(device)]


@pytest.mark.parametrize("only_target", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_logprob_masked_bias(seed, where, dtype, only_target):
    device, backend = where
    hidden, weight, bias, targets = linear_inputs(device, dtype, only_target)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, return_entropy=True, backend=backend)
    n = targets.shape[0]
    g_lp, g_ent = torch.rand(n, device=device) + 0.5, -(torch.rand(n, device=device) + 0.5)
    grads = torch.autograd.grad([lp, ent], [h, w, b], [g_lp, g_ent])
    h64, w64, b64 = (t.double().cpu() for t in (hidden, weight, bias))
    lp64, ent64, dz64 = oracle((h64 @ w64.T + b64) / 0.7, targets.cpu(), g_lp.double(), g_ent.double())
    check_logprob(lp, ent, lp64, ent64, dtype)
    dl64 = dz64 / 0.7
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, (dl64 @ w64, dl64.T @ h64, dl64.sum(0))):
        assert not got.isnan().any(), name
        assert_close(got, ref, "gradient", dtype, f"d{name}")


def test_fused_linear_policy_loss_masked_bias(seed, where):
    device, backend = where
    if backend == "native":
        pytest.skip("fused_linear_policy_loss has no native backend")
    hidden, weight, bias, targets = linear_inputs(device, torch.float32, only_target=False)
    shape = (1, targets.shape[0])
    old = torch.randn(shape, device=device) - 3
    adv = torch.randn(shape, device=device)
    mask = torch.ones(shape, dtype=torch.bool, device=device)

    def loss_and_grads(be):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        loss, _ = rk.fused_linear_policy_loss(
            h[None], w, targets[None], old, adv, mask, bias=b, entropy_coef=0.01, backend=be
        )
        return loss, torch.autograd.grad(loss, [h, w, b])

    loss, grads = loss_and_grads(backend)
    ref_loss, ref_grads = loss_and_grads("torch")
    assert torch.isfinite(loss)
    assert_close(loss, ref_loss, "reduction", torch.float32, "loss")
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert not got.isnan().any(), name
        assert_close(got, ref.double(), "gradient", torch.float32, f"d{name}")


# ------------------------------------------------------------------ one logits route per row


LARGE_LOGIT_MIN_GAP = 100.0
"""The least gap between a row's two largest logits in :func:`large_logit_inputs`. At |z| ~ 1e4 an
fp32 logit is off by ~1e-3 whatever computes it, and a softmax over two logits a few units apart
passes that error to the gradient almost whole (0.02 at a gap of 7): a near tie is outside what
any fp32 implementation can meet the contract on, so the draw excludes it."""


def large_logit_inputs(device, v):
    """fp32 hidden/weight with logits of magnitude ~1e4 over a vocab of ``v``, every row's two
    largest at least :data:`LARGE_LOGIT_MIN_GAP` apart (rows redrawn until they are); targets on
    the argmax (log-prob 0 up to exp(-gap)) in even rows, elsewhere in odd rows."""
    n, d = 9, 64
    hidden = torch.randn(n, d) * 100
    weight = torch.randn(v, d) * (100 / d**0.5)
    z = hidden.double() @ weight.double().T
    while v > 1:
        top2 = z.topk(2, dim=1).values
        near = top2[:, 0] - top2[:, 1] < LARGE_LOGIT_MIN_GAP
        if not near.any():
            break
        hidden[near] = torch.randn(int(near.sum()), d) * 100
        z = hidden.double() @ weight.double().T
    targets = z.argmax(1)
    targets[1::2] = (targets[1::2] + 1) % v
    return hidden.to(device), weight.to(device), targets.to(device)


def test_one_token_vocab_has_zero_gradient(seed, where):
    """V = 1: log-prob 0, entropy 0 and every gradient exactly 0, at logits of magnitude ~1e4."""
    device, backend = where
    hidden, weight, targets = large_logit_inputs(device, 1)
    bias = torch.randn(1, device=device) * 100
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, return_entropy=True, backend=backend)
    grads = torch.autograd.grad([lp, ent], [h, w, b], [torch.rand_like(lp) + 0.5, torch.rand_like(ent) + 0.5])
    assert torch.equal(lp, torch.zeros_like(lp)) and torch.equal(ent, torch.zeros_like(ent))
    for name, g in zip(("hidden", "weight", "bias"), grads):
        assert torch.equal(g, torch.zeros_like(g)), f"d{name} is not exactly 0: max |g| = {g.abs().max().item()}"


@pytest.mark.parametrize("return_entropy", [False, True])
def test_large_logits_tiny_vocab_within_contract(seed, where, return_entropy):
    """|z| ~ 1e4 over V = 3: log-prob (with and without entropy) and gradients against fp64."""
    device, backend = where
    hidden, weight, targets = large_logit_inputs(device, 3)
    h, w = (t.clone().requires_grad_() for t in (hidden, weight))
    out = rk.linear_logprob(h, w, targets, return_entropy=return_entropy, backend=backend)
    lp, ent = out if return_entropy else (out, None)
    g_lp = torch.rand_like(lp) + 0.5
    grads = torch.autograd.grad(lp, [h, w], g_lp)
    h64, w64 = hidden.double().cpu().requires_grad_(), weight.double().cpu().requires_grad_()
    logp64 = torch.log_softmax(h64 @ w64.T, dim=-1)
    lp64 = logp64.gather(1, targets.cpu()[:, None]).squeeze(1)
    grads64 = torch.autograd.grad(lp64, [h64, w64], g_lp.double().cpu())
    assert_close(lp, lp64, "logprob", torch.float32, "logprob")
    if return_entropy:
        assert ent is not None
        assert_close(ent, -(logp64.exp() * logp64).sum(-1), "logprob", torch.float32, "entropy")
    for name, got, ref in zip(("hidden", "weight"), grads, grads64):
        assert_close(got, ref, "gradient", torch.float32, f"d{name}")


def _capture_loss_inputs(monkeypatch) -> list:
    """Record the ``(logprob, entropy)`` every reference ``policy_loss`` call receives (the fused
    op hands its log-probs to it on every backend)."""
    seen = []
    original = reference_loss.policy_loss

    def capture(logprob, *args, **kwargs):
        seen.append((logprob.detach().clone(), args[4].detach().clone()))
        return original(logprob, *args, **kwargs)

    monkeypatch.setattr(reference_loss, "policy_loss", capture)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_logprob_bits_same_in_every_pass(seed, where, monkeypatch, dtype):
    """A row's log-prob: the same bits with and without entropy, with and without grad, and
    inside fused_linear_policy_loss (with and without grad); its entropy likewise."""
    device, backend = where
    hidden, weight, _, targets = linear_inputs(device, dtype, only_target=False)
    bias = torch.randn(weight.shape[0], device=device).to(dtype)
    kw = dict(bias=bias, temperature=0.7, backend=backend)
    with torch.no_grad():
        lp_plain = rk.linear_logprob(hidden, weight, targets, **kw)
        lp_ent, ent = rk.linear_logprob(hidden, weight, targets, return_entropy=True, **kw)
    h = hidden.clone().requires_grad_()
    lp_grad = rk.linear_logprob(h, weight, targets, **kw)
    lp_grad_ent, ent_grad = rk.linear_logprob(h, weight, targets, return_entropy=True, **kw)
    for name, got in (("entropy", lp_ent), ("grad", lp_grad), ("grad and entropy", lp_grad_ent)):
        assert torch.equal(got.detach(), lp_plain), f"log-prob bits differ with {name}"
    assert torch.equal(ent_grad.detach(), ent)
    if backend == "native":
        return  # fused_linear_policy_loss has no native backend
    seen = _capture_loss_inputs(monkeypatch)
    shape = (1, targets.shape[0])
    old, adv = torch.randn(shape, device=device), torch.randn(shape, device=device)
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    args = (targets[None], old, adv, mask)
    fkw = dict(bias=bias, temperature=0.7, entropy_coef=0.01, backend=backend)
    with torch.no_grad():
        rk.fused_linear_policy_loss(hidden[None], weight, *args, **fkw)
    rk.fused_linear_policy_loss(h[None], weight, *args, **fkw)[0].backward()
    assert len(seen) == 2
    for i, (lp_fused, ent_fused) in enumerate(seen):
        assert torch.equal(lp_fused.reshape(-1), lp_plain), f"fused log-prob bits differ (call {i})"
        assert torch.equal(ent_fused.reshape(-1), ent), f"fused entropy bits differ (call {i})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_from_logits_bits_same_in_every_pass(seed, where, dtype):
    device, backend = where
    logits = (torch.randn(7, 5000, device=device) * 4).to(dtype)
    targets = torch.randint(0, 5000, (7,), device=device)
    with torch.no_grad():
        lp_plain = rk.logprob_from_logits(logits, targets, temperature=0.7, backend=backend)
        lp_ent, ent = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend=backend)
    x = logits.clone().requires_grad_()
    lp_grad = rk.logprob_from_logits(x, targets, temperature=0.7, backend=backend)
    lp_grad_ent, ent_grad = rk.logprob_from_logits(x, targets, temperature=0.7, return_entropy=True, backend=backend)
    for name, got in (("entropy", lp_ent), ("grad", lp_grad), ("grad and entropy", lp_grad_ent)):
        assert torch.equal(got.detach(), lp_plain), f"log-prob bits differ with {name}"
    assert torch.equal(ent_grad.detach(), ent)


# ------------------------------------------------------------------ double backward


def test_double_backward_raises_naming_the_op(seed, where):
    device, backend = where
    targets = torch.tensor([1, 4, 0], device=device)
    x = torch.randn(3, 7, device=device, requires_grad=True)
    lp = rk.logprob_from_logits(x, targets, backend=backend)
    with pytest.raises(RuntimeError, match="logprob_from_logits.* no double backward.*create_graph"):
        torch.autograd.grad(lp.sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(rk.logprob_from_logits(x, targets, backend=backend).sum(), x)
    assert not g.requires_grad

    h = torch.randn(3, 8, device=device, requires_grad=True)
    w = torch.randn(7, 8, device=device)
    with pytest.raises(RuntimeError, match="linear_logprob .* no double backward"):
        torch.autograd.grad(rk.linear_logprob(h, w, targets, backend=backend).sum(), h, create_graph=True)
    if backend != "native":
        ones = torch.ones(1, 3, device=device)
        loss, _ = rk.fused_linear_policy_loss(h[None], w, targets[None], ones, ones, ones.bool(), backend=backend)
        with pytest.raises(RuntimeError, match="linear_logprob|fused_linear_policy_loss"):
            torch.autograd.grad(loss, h, create_graph=True)

    lp = torch.randn(2, 5, device=device, requires_grad=True)
    old, adv = torch.randn(2, 5, device=device), torch.randn(2, 5, device=device)
    mask = torch.ones(2, 5, dtype=torch.bool, device=device)
    loss, _ = rk.policy_loss(lp, old, adv, mask, backend=backend)
    if backend == "torch":  # plain autograd: the gradient is itself differentiable
        (g,) = torch.autograd.grad(loss, lp, create_graph=True)
        assert g.requires_grad
    else:
        with pytest.raises(RuntimeError, match="policy_loss has no double backward"):
            torch.autograd.grad(loss, lp, create_graph=True)
