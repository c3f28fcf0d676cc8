"""The ``flashinfer`` backend of ``sample``: what it refuses and why (``explain``), that ``auto``
never takes it unasked, the clear error without FlashInfer, and on a GPU with FlashInfer: tokens
inside the reference's filtered set, log-probs bitwise ``logprob_from_logits``, and a chi-square
test of the draws against the exact truncated distribution at the serving vocabulary.

The CPU tests need no FlashInfer: :func:`rl_kernel_core.sampling.flashinfer_supports.supports` imports without it,
and the dispatch test puts a stand-in implementation behind the real predicate. The ``gpu`` tests
skip without CUDA or without FlashInfer.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.dispatch import BackendUnavailableError, explain
from rl_kernel_core.sampling.flashinfer_supports import supports
from rl_kernel_core.sampling import reference as ref
from oracles import CHI_SQUARE_CASES, SAMPLING_GPU_SHAPE, chi_square_check, random_seeds


HAVE_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _refusal(b: int = 4, v: int = 64, dtype: torch.dtype = torch.float32, **kwargs):
    """``supports`` on a call as ``sample`` passes it to dispatch (seeds None when not given)."""
    args: dict[str, Any] = {
        "temperature": 1.0,
        "seeds": None,
        "positions": None,
        "top_k": None,
        "top_p": None,
        "min_p": None,
    }
    args.update(kwargs)
    return supports(
        torch.randn(b, v).to(dtype),
        args["temperature"],
        args["seeds"],
        args["positions"],
        args["top_k"],
        args["top_p"],
        args["min_p"],
    )


REFUSED = [
    ("per-row seeds", {"seeds": random_seeds(4)}, "seeds given"),
    ("one seed for every row", {"seeds": torch.full((4,), 7, dtype=torch.int64)}, "seeds given"),
    ("fp64 logits", {"dtype": torch.float64}, "fp64"),
    ("per-row temperature", {"temperature": torch.full((4,), 0.7, dtype=torch.float64)}, "temperature as a"),
    ("greedy", {"temperature": 0.0}, "greedy"),
    ("min-p and top-k", {"min_p": 0.1, "top_k": 5}, "min_p together"),
    (
        "min-p and top-p rows",
        {"min_p": torch.full((4,), 0.1), "top_p": torch.full((4,), 0.9, dtype=torch.float64)},
        "min_p together",
    ),
]

SERVED = [
    ("no filter", {}),
    ("top-k", {"top_k": 5}),
    ("top-p", {"top_p": 0.9}),
    ("top-k and top-p", {"top_k": 50, "top_p": 0.9, "temperature": 0.7}),
    ("min-p", {"min_p": 0.05}),
    (
        "per-row filters",
        {"top_k": torch.randint(1, 64, (4,)), "top_p": torch.rand(4, dtype=torch.float64) * 0.9 + 0.05},
    ),
    ("per-row min-p", {"min_p": torch.rand(4) * 0.5}),
    ("min-p 0 keeps everything", {"min_p": 0.0, "top_k": 5}),
    ("top-k = V keeps everything", {"min_p": 0.1, "top_k": 64, "top_p": 1.0}),
    ("bf16 logits, positions", {"dtype": torch.bfloat16, "positions": 3}),
]


@pytest.mark.parametrize("kwargs, reason", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_supports_refuses_what_flashinfer_cannot_serve_exactly(kwargs, reason):
    refusal = _refusal(**kwargs)
    assert refusal is not None and reason in refusal, refusal


@pytest.mark.parametrize("kwargs", [c[1] for c in SERVED], ids=[c[0] for c in SERVED])
def test_supports_accepts_the_rest(kwargs):
    assert _refusal(**kwargs) is None


@pytest.fixture
def stand_in():
    """A stand-in ``flashinfer`` implementation behind the real predicate, first in ``auto``'s order
    (by preference), runnable on CPU: it records the seeds it receives and returns zeros."""
    received = []

    def impl(logits, temperature, seeds, positions, top_k, top_p, min_p):
        received.append(seeds)
        return torch.zeros(logits.shape[0], dtype=torch.int64), torch.zeros(logits.shape[0])

    with dispatch.override("sample", "flashinfer", impl, supports=supports, any_device=True):
        dispatch.set_preference("sample", ("flashinfer", "triton", "torch"))
        yield received


def test_explain_names_the_refusal_and_unseeded_calls_get_drawn_seeds(seed, stand_in):
    logits = torch.randn(5, 40)
    rk.sample(logits, seeds=random_seeds(5), top_k=3)
    decision = explain("sample")
    assert decision.backend == "torch" and "seeds given" in decision.skipped["flashinfer"], decision
    rk.sample(logits, temperature=torch.rand(5) + 0.5)
    assert "temperature as a" in explain("sample").skipped["flashinfer"]
    # without seeds the predicate sees None and the implementation the seeds drawn from the generator
    tokens, _ = rk.sample(logits, top_k=3, generator=torch.Generator().manual_seed(seed))
    assert explain("sample").backend == "flashinfer" and stand_in
    info = torch.iinfo(torch.int64)
    expected = torch.randint(info.min, info.max, (5,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    assert torch.equal(stand_in[-1], expected)
    with pytest.raises(BackendUnavailableError, match="seeds given"):
        rk.sample(logits, seeds=random_seeds(5), backend="flashinfer")


def test_auto_never_imports_or_considers_flashinfer(seed, monkeypatch):
    loaded = []
    load = dispatch._ensure_loaded

    def recording_load(backend, op):
        loaded.append(backend)
        return load(backend, op)

    monkeypatch.setattr(dispatch, "_ensure_loaded", recording_load)
    rk.sample(torch.randn(3, 30), top_k=5)
    assert "flashinfer" not in loaded and "flashinfer" not in explain("sample").skipped


def test_env_preference_applies_to_sample_only(seed, monkeypatch):
    monkeypatch.setenv("RL_KERNEL_BACKEND", "flashinfer")
    rk.logprob_from_logits(torch.randn(3, 30), torch.randint(0, 30, (3,)))
    assert "RL_KERNEL_BACKEND=flashinfer" in explain("logprob_from_logits").skipped["flashinfer"]
    with pytest.raises(BackendUnavailableError, match="flashinfer"):  # CPU tensors, or FlashInfer missing
        rk.sample(torch.randn(3, 30))


@pytest.mark.skipif(HAVE_FLASHINFER, reason="FlashInfer is installed")
def test_named_backend_without_flashinfer_raises_the_import_error(seed):
    with pytest.raises(
        BackendUnavailableError,
        match=r"backend='flashinfer' cannot run: flashinfer backend failed to import: .*flashinfer",
    ):
        rk.sample(torch.randn(2, 10), backend="flashinfer")
    assert dispatch.backend_report()["flashinfer"].startswith("unavailable: flashinfer backend failed to import")


def test_device_reason_names_cuda():
    assert dispatch._device_reason("flashinfer", torch.device("cpu"), True) == "flashinfer needs CUDA tensors (got cpu)"


# ---------------------------------------------------------------- on a GPU with FlashInfer


@pytest.fixture
def on_gpu():
    if not HAVE_FLASHINFER:
        pytest.skip("FlashInfer is not installed")
    return torch.device("cuda")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _rows(value, b: int, dtype: torch.dtype):
    return (
        None
        if value is None
        else (value if isinstance(value, torch.Tensor) else torch.full((b,), value, dtype=dtype, device="cuda"))
    )


FILTERS = [
    {},
    {"top_k": 50},
    {"top_p": 0.9},
    {"top_k": 50, "top_p": 0.9, "temperature": 0.7},
    {"top_k": 20, "top_p": 0.6, "temperature": 1.3},
    {"min_p": 0.05, "temperature": 0.8},
    "per-row top-k/top-p",
    "per-row min-p",
]


def _filters(case, b: int) -> dict:
    if case == "per-row top-k/top-p":
        return {
            "top_k": torch.randint(1, 400, (b,), device="cuda"),
            "top_p": torch.rand(b, dtype=torch.float64, device="cuda") * 0.9 + 0.05,
        }
    if case == "per-row min-p":
        return {"min_p": torch.rand(b, device="cuda") * 0.3}
    return dict(case)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", FILTERS, ids=lambda c: c if isinstance(c, str) else ",".join(f"{k}={v}" for k, v in c.items()) or "none"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_lie_in_the_reference_filtered_set(seed, on_gpu, case, dtype):
    b, v = SAMPLING_GPU_SHAPE
    logits = (torch.randn(b, v, device="cuda") * 2).to(dtype)
    params = _filters(case, b)
    temperature = params.pop("temperature", 1.0)
    filtered = 0
    for draw in range(4):
        tokens, _ = rk.sample(
            logits, temperature=temperature, generator=_generator(seed + draw), backend="flashinfer", **params
        )
        assert explain("sample").backend == "flashinfer"
        x = logits.float() * (1.0 / temperature)
        keep = ref._keep_mask(
            x,
            _rows(params.get("top_k"), b, torch.int64),
            _rows(params.get("top_p"), b, torch.float64),
            _rows(params.get("min_p"), b, torch.float32),
        )
        if keep is None:
            keep = torch.isfinite(x)
        inside = keep.gather(1, tokens[:, None])[:, 0]
        assert bool(inside.all()), (
            f"rows {torch.nonzero(~inside)[:, 0].tolist()} drew tokens outside the reference's set"
        )
        filtered += int((keep.sum(dim=1) < v).sum())
    assert not params or filtered > 0, "the filters removed nothing: the test would not test them"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_bitwise_logprob_from_logits(seed, on_gpu, dtype):
    b, v = SAMPLING_GPU_SHAPE
    logits = (torch.randn(b, v, device="cuda") * 2).to(dtype)
    for temperature, params in ((1.0, {"top_k": 50, "top_p": 0.9}), (0.7, {"min_p": 0.05}), (1.3, {})):
        tokens, logprobs = rk.sample(
            logits, temperature=temperature, generator=_generator(seed), backend="flashinfer", **params
        )
        expected = rk.logprob_from_logits(logits, tokens, temperature=temperature, backend="triton")
        assert torch.equal(logprobs, expected), f"temperature {temperature}, {params}"


FLASHINFER_CHI_SQUARE_CASES = [c for c in CHI_SQUARE_CASES if "min_p" not in c or not ("top_k" in c or "top_p" in c)]
FLASHINFER_CHI_SQUARE_CASES.append({"temperature": 0.9, "top_k": 5, "top_p": 0.85})  # the top-k mask, then top-p


@pytest.mark.gpu
@pytest.mark.parametrize(
    "params", FLASHINFER_CHI_SQUARE_CASES, ids=lambda p: ",".join(k for k in p if k != "temperature")
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draw_frequencies_at_full_vocab(seed, on_gpu, params, dtype):
    v, draws, chunk = SAMPLING_GPU_SHAPE[1], 100_000, 2048
    # seven leaders holding most of the mass above a bulk of ordinary logits, so each filter keeps
    # a handful of tokens whose frequencies a chi-square test can resolve
    row = torch.randn(v, device="cuda")
    row[torch.randperm(v, device="cuda")[:7]] = torch.tensor([14.0, 13.8, 13.5, 13.3, 13.0, 12.7, 12.5], device="cuda")
    row = row.to(dtype)
    block = row.expand(chunk, v).contiguous()
    generator = _generator(seed)
    tokens = torch.cat(
        [
            rk.sample(block[: min(chunk, draws - s)], generator=generator, backend="flashinfer", **params)[0]
            for s in range(0, draws, chunk)
        ]
    )
    chi_square_check(row.float(), tokens, params)


@pytest.mark.gpu
def test_generator_state_decides_the_draw(seed, on_gpu):
    b, v = SAMPLING_GPU_SHAPE
    logits = torch.randn(b, v, device="cuda")
    first, _ = rk.sample(logits, top_k=50, top_p=0.9, generator=_generator(seed), backend="flashinfer")
    again, _ = rk.sample(logits, top_k=50, top_p=0.9, generator=_generator(seed), backend="flashinfer")
    other, _ = rk.sample(logits, top_k=50, top_p=0.9, generator=_generator(seed + 1), backend="flashinfer")
    assert torch.equal(first, again)
    # two independent draws of row r agree with probability sum_i q_ri^2 over its kept set
    x = logits.double()
    keep = ref._keep_mask(logits, _rows(50, b, torch.int64), _rows(0.9, b, torch.float64), None)
    assert keep is not None
    q = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    collide = q.pow(2).sum(dim=-1)
    bound = collide.sum() + 6 * (collide * (1 - collide)).sum().sqrt()
    assert (first == other).sum().item() <= bound.item()


@pytest.mark.gpu
def test_neg_inf_logits(seed, on_gpu):
    b, v = 8, 5000
    logits = torch.randn(b, v, device="cuda")
    logits[torch.rand(b, v, device="cuda") < 0.5] = float("-inf")
    lone = torch.randint(0, v, (2,)).tolist()
    logits[0] = float("-inf")
    logits[0, lone[0]] = 1.0  # one finite token: always drawn, log-prob 0
    logits[1] = float("-inf")
    logits[1, lone[1]] = -3.0
    for params in ({}, {"top_k": 3, "top_p": 0.5}, {"min_p": 0.1}, {"top_k": v // 2}, {"top_p": 0.95}):
        tokens, logprobs = rk.sample(logits, generator=_generator(seed), backend="flashinfer", **params)
        assert tokens[:2].tolist() == lone, params
        assert torch.equal(logprobs[:2], torch.zeros(2, device="cuda")), params
        assert bool(torch.isfinite(logits.gather(1, tokens[:, None])).all()), f"drew a -inf token with {params}"


@pytest.mark.gpu
def test_dispatch_on_gpu(seed, on_gpu, monkeypatch):
    logits = torch.randn(4, 1000, device="cuda")
    seeds = random_seeds(4).cuda()
    with pytest.raises(BackendUnavailableError, match="seeds given"):
        rk.sample(logits, seeds=seeds, backend="flashinfer")
    rk.sample(logits, seeds=seeds, top_k=5)
    decision = explain("sample")
    assert decision.backend == "triton" and "flashinfer" not in decision.skipped, decision
    monkeypatch.setenv("RL_KERNEL_BACKEND", "flashinfer")
    rk.sample(logits, top_k=5)
    assert explain("sample").backend == "flashinfer"
    assert dispatch.backend_report()["flashinfer"].startswith("installed")
