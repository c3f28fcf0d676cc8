"""The trainer's own log-prob code gets the rollout's bits under batch-invariant mode.

Under ``rk.batch_invariant()``, on the same logits, every formulation a trainer writes by hand gives
a token the bits of ``rk.logprob_from_logits(logits, t, temperature=T)`` (the definition the vLLM
hook returns): ``log_softmax(z).gather``, ``z.gather - logsumexp(z)`` (verl's and TRL's
selective log-softmax, batched or one row at a time), ``-cross_entropy(z, t, reduction="none")``
and ``logprob_from_logits(z, t)``, with ``z = logits.float() / T`` (the caller's division, or
``.div_(T)`` on the fp32 copy), for fp32/bf16/fp16 logits, eagerly and inside ``torch.compile``.
Each draw is seeded; the seed is printed.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import rl_kernel_core as rk

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _formulations(logits: torch.Tensor, t: torch.Tensor, temperature: float) -> dict[str, torch.Tensor]:
    """Each formulation's log-probs ``[N]`` (fp32) of ``t [N]`` from ``logits [N, V]``."""
    z = logits.float() / temperature
    z_inplace = logits.float()
    z_inplace.div_(temperature)
    idx = t[:, None]
    out = {
        "log_softmax.gather": torch.log_softmax(z, -1).gather(-1, idx).squeeze(-1),
        "F.log_softmax(div_).gather": F.log_softmax(z_inplace, dim=-1).gather(-1, idx).squeeze(-1),
        "gather - logsumexp": z.gather(-1, idx).squeeze(-1) - torch.logsumexp(z, -1),
        "gather - logsumexp per row": z.gather(-1, idx).squeeze(-1) - torch.stack([torch.logsumexp(r, -1) for r in z]),
        "-cross_entropy": -F.cross_entropy(z, t, reduction="none"),
        "logprob_from_logits(z)": rk.logprob_from_logits(z, t),
    }
    if temperature == 1.0:
        out["log_softmax(dtype=fp32)"] = torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, idx).squeeze(-1)
    return out


def _draw(rng: random.Random, device: str):
    dtype = rng.choice(DTYPES)
    n, v = rng.randint(1, 48), rng.choice([rng.randint(2, 300), rng.randint(1000, 5000)])
    temperature = rng.choice([1.0, 0.7, 1.3, rng.uniform(0.05, 3.0)])
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    logits = (torch.randn(n, v, generator=g) * rng.choice([0.5, 3.0, 20.0])).to(dtype).to(device)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    return logits, t, temperature


def _check_draws(device: str, draws: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(draws):
        logits, t, temperature = _draw(rng, device)
        with rk.batch_invariant():
            want = rk.logprob_from_logits(logits, t, temperature=temperature)
            got = _formulations(logits, t, temperature)
        for name, value in got.items():
            assert torch.equal(value, want), (
                f"seed={seed} draw {i}: {name} differs from logprob_from_logits "
                f"({logits.dtype}, {tuple(logits.shape)}, T={temperature}) by "
                f"{(value - want).abs().max().item():.3g}"
            )


@pytest.mark.parametrize("draw_seed", range(3))
def test_formulations_equal_logprob_from_logits_under_the_mode_cpu(seed, draw_seed):
    _check_draws("cpu", 12, seed + draw_seed)


@pytest.mark.gpu
@pytest.mark.parametrize("draw_seed", range(3))
def test_formulations_equal_logprob_from_logits_under_the_mode_cuda(seed, draw_seed):
    _check_draws("cuda", 16, seed + draw_seed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_formulations_inside_torch_compile(seed, device):
    """A compiled trainer function runs eagerly under the mode, so it gets the same bits."""
    rng = random.Random(seed)

    @torch.compile(backend="eager" if device == "cpu" else "inductor")
    def trainer(logits, t, temperature: float):
        z = logits.float() / temperature
        return z.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(z, -1), -F.cross_entropy(z, t, reduction="none")

    for i in range(4):
        logits, t, temperature = _draw(rng, device)
        with rk.batch_invariant():
            want = rk.logprob_from_logits(logits, t, temperature=temperature)
            for value in trainer(logits, t, temperature):
                assert torch.equal(value, want), f"seed={seed} draw {i}: compiled formulation differs"


def test_3d_logits_and_ignore_index(seed):
    """Leading dims flatten and ignored rows give 0, as outside the mode; the rest keep the bits."""
    logits = torch.randn(3, 5, 77).to(torch.bfloat16)
    t = torch.randint(0, 77, (3, 5))
    t[1, 2] = -100
    with rk.batch_invariant():
        lp = rk.logprob_from_logits(logits, t, temperature=0.9)
        lp_with_entropy, entropy = rk.logprob_from_logits(logits, t, temperature=0.9, return_entropy=True)
    assert torch.equal(lp_with_entropy, lp) and entropy.shape == lp.shape and bool(torch.isfinite(entropy).all())
    with rk.batch_invariant():
        ref = torch.log_softmax(logits.float() / 0.9, -1).gather(-1, t.clamp_min(0)[..., None]).squeeze(-1)
    assert lp[1, 2] == 0.0
    keep = t != -100
    assert torch.equal(lp[keep], ref[keep])


def test_mode_logprob_gradient_matches_the_formulation(seed):
    logits = torch.randn(9, 50, requires_grad=True)
    t = torch.randint(0, 50, (9,))
    with rk.batch_invariant():
        rk.logprob_from_logits(logits, t, temperature=0.8).sum().backward()
        assert logits.grad is not None
        g_ours = logits.grad.clone()
        logits.grad = None
        torch.log_softmax(logits / 0.8, -1).gather(-1, t[:, None]).sum().backward()
    assert logits.grad is not None and torch.allclose(g_ours, logits.grad, atol=1e-6, rtol=1e-5)


def test_sample_under_the_mode_returns_the_mode_logprobs(seed):
    """The sampler's log-probs under the mode are what a trainer's formulation gives, per-row temperatures too."""
    logits = torch.randn(12, 300) * 3
    temps = torch.tensor([0.7, 1.0, 0.0, 1.3] * 3, dtype=torch.float64)
    with rk.batch_invariant():
        tokens, lp = rk.sample(logits, temperature=temps, seeds=torch.arange(12))
        for i in range(12):
            t = float(temps[i]) or 1.0
            want = torch.log_softmax(logits[i : i + 1].float() / t, -1)[0, tokens[i]]
            assert torch.equal(lp[i], want), f"seed={seed} row {i}"
        tokens, lp = rk.sample(logits, temperature=0.8, seeds=torch.arange(12))
        assert torch.equal(lp, rk.logprob_from_logits(logits, tokens, temperature=0.8))
