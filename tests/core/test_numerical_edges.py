"""Edge cases of the log-prob ops on every backend: masked (-inf) logits, one logits route per row.

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
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes

INF = float("inf")
CASES = [
    pytest.param(("cpu", "torch"), id="cpu-torch"),
    pytest.param(("cpu", "triton"), id="cpu-triton"),
    pytest.param(("cuda", "torch"), id="cuda-torch", marks=pytest.mark.gpu),
    pytest.param(("cuda", "triton"), id="cuda-triton", marks=pytest.mark.gpu),
    pytest.param(("cuda", "native"), id="cuda-native", marks=pytest.mark.gpu),
]


@pytest.fixture(params=CASES)
def where(request, monkeypatch):
    """``(device, backend)``; CPU Triton runs in the interpreter."""
    device, backend = request.param
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
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
    assert lp[2].item() == 0.0 and ent[2].item() == 0.0
    assert not grad.isnan().any()
    assert torch.equal(grad.cpu()[~torch.isfinite(logits.cpu()) & (torch.arange(4200) != targets.cpu()[:, None])].float().abs().max(), torch.tensor(0.0))
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
    if only_target:
        assert torch.equal(lp, torch.zeros_like(lp)) and torch.equal(ent, torch.zeros_like(ent))


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
        loss, _ = rk.fused_linear_policy_loss(h[None], w, targets[None], old, adv, mask, bias=b, entropy_coef=0.01, backend=be)
        return loss, torch.autograd.grad(loss, [h, w, b])

    loss, grads = loss_and_grads(backend)
    ref_loss, ref_grads = loss_and_grads("torch")
    assert torch.isfinite(loss)
    assert_close(loss, ref_loss, "reduction", torch.float32, "loss")
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert not got.isnan().any(), name
        assert_close(got, ref.double(), "gradient", torch.float32, f"d{name}")
