"""Triton backend of ``sample``: the reference's tokens, bitwise log-probs, the exact filtered
distribution, seeded batch invariance, -inf logits, dispatch and bad input.

Each case runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test: the kernels
pick interpreted or compiled execution at launch time) at small shapes, and the ``gpu``-marked
cases compile it at the serving shape (B=128, V=151936). Expected distributions come from the fp64
spec in tests/core/test_sampling.py; the Triton and torch backends draw the same keyed noise, so
their tokens are compared exactly (a token could differ only where two noisy scores tie to the
last bit of a log, which random inputs do not produce). The interpreter runs a row in tens of ms,
so the CPU distribution checks use a few hundred draws; the GPU ones use 100k.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.dispatch import BackendUnavailableError, explain
from rl_kernel_core.triton import sampling as triton_sampling
from oracles import CHI_SQUARE_CASES, SAMPLING_GPU_SHAPE, chi_square_check, random_seeds, row_params


pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


@pytest.fixture
def device(triton_device):
    """``cpu`` runs the kernels in the Triton interpreter; ``cuda`` compiles them."""
    return triton_device


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _shape(device: torch.device, cpu: tuple[int, int]) -> tuple[int, int]:
    return cpu if device.type == "cpu" else SAMPLING_GPU_SHAPE


def _on(params: dict, device: torch.device) -> dict:
    return {k: (x.to(device) if isinstance(x, torch.Tensor) else x) for k, x in params.items()}


def _logits(b: int, v: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (torch.randn(b, v, device=device) * 2).to(dtype)


def _same_tokens_as_reference(logits: torch.Tensor, seeds: torch.Tensor, **params) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, logprobs = rk.sample(logits, seeds=seeds, backend="triton", **params)
    ref_tokens, _ = rk.sample(logits, seeds=seeds, backend="torch", **params)
    assert torch.equal(tokens, ref_tokens), f"{(tokens != ref_tokens).sum().item()} of {tokens.numel()} tokens differ"
    return tokens, logprobs


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p", "all", "scalars"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_match_the_reference(seed, device, kind, dtype):
    b, v = _shape(device, (12, 300))
    logits = _logits(b, v, dtype, device)
    params = _on(row_params(b, kind, v), device)
    params["positions"] = torch.randint(0, 1 << 30, (b,), device=device)
    tokens, logprobs = _same_tokens_as_reference(logits, random_seeds(b).to(device), **params)
    assert bool(torch.isfinite(logprobs).all())


@pytest.mark.parametrize("params", [{"top_k": 40}, {"top_p": 0.5}, {"top_k": 60, "top_p": 0.8, "min_p": 0.01}], ids=["top_k", "top_p", "all"])
def test_exact_fallbacks_match_the_reference(seed, interpret, monkeypatch, params):
    # a capacity of 16 candidates: top-k 40 and top-p over 400 tokens take the exact path (searches
    # over keys by count and by mass, ending on a gathered band); the kernel must still draw the
    # reference's tokens
    monkeypatch.setattr(triton_sampling, "CANDIDATES", 16)
    b, v = 10, 400
    _same_tokens_as_reference(_logits(b, v, torch.float32, torch.device("cpu")), random_seeds(b), temperature=1.3, **params)


@pytest.mark.parametrize("params", [{"top_k": 50, "top_p": 0.9}, {"top_p": 0.9}, {"top_k": 2000}], ids=["top_k_top_p", "top_p", "top_k_exact"])
def test_repeated_calls_are_bitwise_equal(seed, device, params):
    # the gather pass appends candidates in whatever order its programs run; the result must not
    # depend on it
    b, v = _shape(device, (5, 3000))
    logits = _logits(b, v, torch.bfloat16, device)
    seeds = random_seeds(b).to(device)
    first = rk.sample(logits, seeds=seeds, backend="triton", **params)
    for _ in range(3):
        again = rk.sample(logits, seeds=seeds, backend="triton", **params)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_ties_at_the_thresholds_are_kept(seed, device):
    b, v = _shape(device, (16, 200))
    # few distinct values: the top-k and top-p thresholds fall inside groups of equal logits, and
    # groups larger than the candidate capacity take the exact path
    logits = torch.randint(-3, 3, (b, v), device=device).float()
    seeds = random_seeds(b).to(device)
    for params in ({"top_k": 3}, {"top_p": 0.3}, {"top_k": 10, "top_p": 0.6, "min_p": 0.2}):
        _same_tokens_as_reference(logits, seeds, **params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_bitwise_logprob_from_logits(seed, device, dtype):
    b, v = _shape(device, (6, 5000))  # V above one 4096 block: the online recurrence runs
    logits = _logits(b, v, dtype, device)
    seeds = random_seeds(b).to(device)
    for temperature in (1.0, 0.7):
        tokens, logprobs = rk.sample(logits, temperature=temperature, top_k=50, top_p=0.9, seeds=seeds, backend="triton")
        expected = rk.logprob_from_logits(logits, tokens, temperature=temperature, backend="triton")
        assert torch.equal(logprobs, expected), f"temperature {temperature}"
    # per-row temperatures (greedy rows at temperature 1): each row as logprob_from_logits at its own T
    temps = torch.rand(b, dtype=torch.float64) + 0.4
    temps[::3] = 0.0
    tokens, logprobs = rk.sample(logits, temperature=temps.to(device), min_p=0.05, seeds=seeds, backend="triton")
    for r in range(0, b, max(1, b // 8)):
        t = float(temps[r]) or 1.0
        expected = rk.logprob_from_logits(logits[r:r + 1], tokens[r:r + 1], temperature=t, backend="triton")
        assert torch.equal(logprobs[r:r + 1], expected), f"row {r} at temperature {t}"






@pytest.mark.parametrize("params", CHI_SQUARE_CASES, ids=["top_k", "top_p", "min_p", "combined"])
def test_draw_frequencies_follow_the_filtered_distribution(seed, interpret, params):
    v, draws = 8, 200
    row = torch.randn(v)
    tokens, _ = rk.sample(row.expand(draws, v), seeds=random_seeds(draws), backend="triton", **params)
    chi_square_check(row, tokens, params)


@pytest.mark.gpu
@pytest.mark.parametrize("params", CHI_SQUARE_CASES, ids=["top_k", "top_p", "min_p", "combined"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draw_frequencies_at_full_vocab_on_gpu(seed, params, dtype):
    v, draws, chunk = SAMPLING_GPU_SHAPE[1], 100_000, 2048
    # six leaders holding most of the mass above a bulk of 151930 tokens, so every filter keeps a
    # handful of tokens whose frequencies a chi-square test can resolve
    row = torch.randn(v, device="cuda")
    row[torch.randperm(v, device="cuda")[:6]] = torch.tensor([14.0, 13.7, 13.4, 13.1, 12.8, 12.5], device="cuda")
    row = row.to(dtype)
    seeds = random_seeds(draws).cuda()
    block = row.expand(chunk, v).contiguous()
    tokens = torch.cat([rk.sample(block[: min(chunk, draws - s)], seeds=seeds[s:s + chunk], **params)[0] for s in range(0, draws, chunk)])
    assert explain("sample").backend == "triton"
    chi_square_check(row.float(), tokens, params)


def test_row_does_not_depend_on_batch_size_or_position(seed, device):
    b, v = _shape(device, (9, 700))
    small = 4
    for dtype in (torch.float32, torch.bfloat16):
        logits = _logits(small, v, dtype, device)
        params = _on(row_params(small, "all", v), device)
        seeds = random_seeds(small).to(device)
        tokens, logprobs = rk.sample(logits, seeds=seeds, backend="triton", **params)
        for r in range(small):
            t1, lp1 = rk.sample(logits[r:r + 1], seeds=seeds[r:r + 1], backend="triton", **{k: x[r:r + 1] for k, x in params.items()})
            assert torch.equal(t1, tokens[r:r + 1]) and torch.equal(lp1, logprobs[r:r + 1]), f"row {r} changed alone"
        pos = torch.randperm(b)[:small].to(device)
        big_logits = _logits(b, v, dtype, device)
        big_logits[pos] = logits
        big = _on(row_params(b, "all", v), device)
        for k in big:
            big[k][pos] = params[k]
        big_seeds = random_seeds(b).to(device)
        big_seeds[pos] = seeds
        t_big, lp_big = rk.sample(big_logits, seeds=big_seeds, backend="triton", **big)
        assert torch.equal(t_big[pos], tokens), f"tokens changed at B={b} ({dtype})"
        assert torch.equal(lp_big[pos], logprobs), f"log-prob bits changed at B={b} ({dtype})"


def test_neg_inf_logits(seed, device):
    b, v = _shape(device, (6, 300))
    logits = _logits(b, v, torch.float32, device)
    logits[torch.rand(b, v, device=device) < 0.5] = float("-inf")
    lone = torch.randint(0, v, (2,)).tolist()
    logits[0] = float("-inf")
    logits[0, lone[0]] = 1.0  # one finite token: always drawn, log-prob 0
    logits[1] = float("-inf")
    logits[1, lone[1]] = -3.0
    seeds = random_seeds(b).to(device)
    for params in ({}, {"top_k": 3, "top_p": 0.5, "min_p": 0.1}, {"temperature": 0.0}, {"top_k": v // 2}, {"top_p": 0.95}):
        tokens, logprobs = _same_tokens_as_reference(logits, seeds, **params)
        assert tokens[:2].tolist() == lone, params
        assert torch.equal(logprobs[:2], torch.zeros(2, device=device)), params
        assert bool(torch.isfinite(logits.gather(1, tokens[:, None])).all()), f"drew a -inf token with {params}"
        assert bool(torch.isfinite(logprobs).all()), params


def test_rows_without_distribution_match_the_reference(seed, device):
    b, v = _shape(device, (6, 300))
    logits = _logits(b, v, torch.float32, device)
    logits[1] = float("-inf")
    logits[2, v // 2] = float("nan")
    logits[3] = float("nan")
    logits[4, v - 1] = float("inf")
    seeds = random_seeds(b).to(device)
    for params in ({}, {"temperature": 0.0}, {"top_k": 3, "top_p": 0.5, "min_p": 0.1}, {"temperature": 1.2e-38}):
        tokens, logprobs = _same_tokens_as_reference(logits, seeds, **params)
        bad = slice(0, b) if "temperature" in params and params["temperature"] else slice(1, 5)
        assert not bool(tokens[bad].any()) and bool(logprobs[bad].isnan().all()), params


def test_dispatch(seed, device):
    logits = _logits(3, 50, torch.float32, device)
    seeds = random_seeds(3).to(device)
    rk.sample(logits, seeds=seeds, top_k=5, backend="triton")
    assert explain("sample").backend == "triton"
    rk.sample(logits, seeds=seeds, top_k=5)
    decision = explain("sample")
    if device.type == "cuda":
        assert decision.backend == "triton", decision
    else:  # auto never picks the interpreter
        assert decision.backend == "torch" and "triton" in decision.skipped, decision
    with pytest.raises(BackendUnavailableError, match="fp64"):
        rk.sample(logits.double(), seeds=seeds, backend="triton")


def test_named_triton_without_cuda_or_interpreter_says_why(seed, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="triton needs CUDA"):
        rk.sample(torch.randn(2, 10), backend="triton")


def test_bad_input_names_the_argument(seed, interpret):
    logits = torch.randn(4, 10)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"top_k": torch.tensor([1, 0, 2, 3])}, ValueError, "top_k"),
        ({"top_k": 2**64}, ValueError, "top_k"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"min_p": torch.tensor([0.1, 1.0, 0.0, 0.2])}, ValueError, "min_p"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"seeds": torch.zeros(3, dtype=torch.int64)}, ValueError, "seeds"),
        ({"positions": torch.zeros(4)}, TypeError, "positions"),
    ]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            rk.sample(logits, backend="triton", **kwargs)
