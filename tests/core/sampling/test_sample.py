"""``sample``: log-probs, filters, greedy, seeded batch invariance, distribution, bad input, on the
reference (``torch``), then the Triton backend (under the interpreter on CPU, compiled on CUDA).

Expected values come from formulas written here independently (fp64 numpy for the allowed sets and
the filtered distributions, a pure-Python SplitMix64 for the hash); tolerances come from
rl_kernel_core.contract. Statistical checks use fixed sampler seeds and a bound of mean + 6 standard
deviations of the statistic under the correct sampler, so they are deterministic for given logits
and fail only for a real error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract
from rl_kernel_core.dispatch import BackendUnavailableError, explain
from rl_kernel_core.sampling import reference as ref
from rl_kernel_core.sampling import triton as triton_sampling
from op_backends import Backend, on_backends
from oracles import (
    CHI_SQUARE_CASES,
    SAMPLING_GPU_SHAPE,
    SIGMAS,
    TAIL_FLOOR,
    allowed_tokens,
    chi_square_check,
    chi_square_tail,
    random_seeds,
    row_params,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


def _splitmix_uniform(seed: int, position: int, i: int) -> float:
    """Pure-Python SplitMix64 (uint64 arithmetic), the spec of ref.uniforms."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    start = mix((seed + 0xD1B54A32D192ED03) & mask)  # the seed, then the position, absorbed in turn
    state = mix((start + (position & mask) * 0xDB4F0B9175AE2165) & mask)
    z = mix((state + (i + 1) * 0x9E3779B97F4A7C15) & mask)
    return ((z >> 41) + 0.5) / 2.0**23


def _row_value(value, i: int):
    if value is None:
        return None
    return value[i].item() if isinstance(value, torch.Tensor) else value


def test_registered_and_dispatched_to_torch(seed):
    logits = torch.randn(3, 11)
    rk.sample(logits, seeds=random_seeds(3), backend="torch")
    assert explain("sample").backend == "torch"
    with pytest.raises(BackendUnavailableError, match="sample"):
        rk.sample(logits, seeds=random_seeds(3), backend="triton")


def test_hash_matches_pure_python_splitmix(seed):
    seeds = torch.cat([random_seeds(6), torch.tensor([0, -1, 2**63 - 1, -(2**63)])])
    positions = torch.cat([torch.randint(0, 1 << 20, (6,)), torch.tensor([0, -1, 2**63 - 1, 5])])
    u = ref.uniforms(seeds, positions, 37)
    assert u.dtype == torch.float32
    for b, (s, pos) in enumerate(zip(seeds.tolist(), positions.tolist())):
        expected = torch.tensor([_splitmix_uniform(s, pos, i) for i in range(37)], dtype=torch.float64)
        assert torch.equal(u[b].double(), expected)
    assert bool(((u > 0) & (u < 1)).all())


def _seed_position_pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random ``(seed, position)`` pairs with seed != position: half of small values (either
    sign for the seed), half of random int64 seeds and positions up to 2**40."""
    small = n // 2
    seeds = torch.cat([torch.randint(-16, 64, (small,)), random_seeds(n - small)])
    positions = torch.cat([torch.randint(0, 64, (small,)), torch.randint(0, 1 << 40, (n - small,))])
    same = seeds == positions
    positions[same] += 1
    return seeds, positions


def test_hash_is_not_symmetric_in_seed_and_position(seed):
    """Swapping a row's seed and position gives another state and other uniforms: small seeds and
    positions (request seeds with successive positions) do not alias."""
    seeds, positions = _seed_position_pairs(512)
    state, swapped = ref.row_state(seeds, positions), ref.row_state(positions, seeds)
    same = (state == swapped).nonzero().flatten().tolist()
    assert not same, (
        f"(seed, position) and (position, seed) share a state: {[(seeds[i].item(), positions[i].item()) for i in same[:5]]}"
    )
    u, u_swapped = ref.uniforms(seeds, positions, 16), ref.uniforms(positions, seeds, 16)
    assert not bool((u == u_swapped).all(dim=1).any())


def test_distinct_small_seeds_and_positions_give_distinct_states(seed):
    """Every (seed, position) of a grid of small values (seeds of either sign, including 0) and of a
    random sample of pairs gets its own state and its own uniforms."""
    grid_s, grid_p = torch.meshgrid(torch.arange(-32, 64), torch.arange(0, 96), indexing="ij")
    pairs = torch.stack([grid_s.flatten(), grid_p.flatten()], dim=1)
    drawn = torch.stack(_seed_position_pairs(1024), dim=1)
    pairs = torch.unique(torch.cat([pairs, drawn]), dim=0)
    states = ref.row_state(pairs[:, 0], pairs[:, 1])
    assert torch.unique(states).numel() == len(pairs), (
        f"{len(pairs) - torch.unique(states).numel()} pairs share a state"
    )
    first = ref.uniforms(pairs[:, 0], pairs[:, 1], 4)
    assert torch.unique(first, dim=0).shape[0] == len(pairs)


@on_backends("sample")
def test_swapped_seed_and_position_draw_independent_tokens(seed, backend: Backend):
    """A row drawn at ``(seed=s, position=p)`` and at ``(seed=p, position=s)`` agrees no more often
    than two independent draws do."""
    n, v = (256, 64) if backend.name == "torch" else (48, 64)
    seeds, positions = _seed_position_pairs(n)
    logits = torch.randn(n, v) * 0.5  # flat: independent draws rarely agree
    run = dict(backend=backend.name, top_k=40)
    dev = backend.device
    drawn, _ = rk.sample(logits.to(dev), seeds=seeds.to(dev), positions=positions.to(dev), **run)
    swapped, _ = rk.sample(logits.to(dev), seeds=positions.to(dev), positions=seeds.to(dev), **run)
    # two independent draws of a row agree with probability sum_i q_i^2 over its top-40 distribution q
    collide = torch.tensor(
        [float((allowed_tokens(row.numpy(), 1.0, 40, None, None)[1] ** 2).sum()) for row in logits], dtype=torch.float64
    )
    bound = collide.sum() + SIGMAS * (collide * (1 - collide)).sum().sqrt()
    agree = (drawn.cpu() == swapped.cpu()).sum().item()
    assert agree <= bound.item(), (
        f"{agree} of {n} rows draw the same token with seed and position swapped (bound {bound.item():.1f})"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_full_tempered_log_softmax_at_the_token(seed, dtype):
    b, v = 96, 1000
    logits = (torch.randn(b, v) * 3).to(dtype)
    temperature = torch.rand(b) * 1.5 + 0.3
    temperature[::7] = 0.0  # greedy rows: log-prob at temperature 1
    tokens, logprobs = rk.sample(
        logits, temperature=temperature, top_k=50, top_p=0.9, min_p=0.01, seeds=random_seeds(b)
    )
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    t64 = torch.where(temperature == 0, 1.0, temperature).double()
    full = torch.log_softmax(logits.double() / t64[:, None], dim=-1)
    contract.assert_close(logprobs, full.gather(1, tokens[:, None]).squeeze(1), "logprob", dtype, name="logprobs")


@on_backends("sample")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_bitwise_logprob_from_logits(seed, backend: Backend, dtype):
    """A sampled token's log-prob has the bits of logprob_from_logits on the same backend, at scalar
    and per-row temperatures (greedy rows at temperature 1), with filters and -inf logits."""
    if backend.name == "torch":
        b, v = 37, 3000
    else:
        b, v = _shape(torch.device(backend.device), (6, 5000))  # V above one 4096 block: the online recurrence runs
    logits = (torch.randn(b, v) * 3).to(dtype).to(backend.device)
    logits[4 % b, ::5] = float("-inf")
    seeds = random_seeds(b).to(backend.device)
    for temperature in (1.0, 0.7, 1.3):
        tokens, logprobs = rk.sample(
            logits, temperature=temperature, top_k=50, top_p=0.9, seeds=seeds, backend=backend.name
        )
        expected = rk.logprob_from_logits(logits, tokens, temperature=temperature, backend=backend.name)
        assert torch.equal(logprobs, expected), f"temperature {temperature}"
    # per-row temperatures (greedy rows at temperature 1): each row as logprob_from_logits at its own T
    temps = torch.rand(b, dtype=torch.float64) + 0.4
    temps[::3] = 0.0
    tokens, logprobs = rk.sample(
        logits, temperature=temps.to(backend.device), min_p=0.05, seeds=seeds, backend=backend.name
    )
    for r in range(0, b, 1 if b <= 64 else b // 8):
        t = float(temps[r]) or 1.0
        expected = rk.logprob_from_logits(logits[r : r + 1], tokens[r : r + 1], temperature=t, backend=backend.name)
        assert torch.equal(logprobs[r : r + 1], expected), f"row {r} at temperature {t}"


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p", "all", "scalars"])
def test_filters_never_sample_outside_the_allowed_set(seed, kind):
    rows, draws, v = 192, 16, 48
    logits = torch.randn(rows, v) * 2
    params = row_params(rows, kind, v)
    rep = {k: (x.repeat_interleave(draws) if isinstance(x, torch.Tensor) else x) for k, x in params.items()}
    tokens, _ = rk.sample(logits.repeat_interleave(draws, dim=0), seeds=random_seeds(rows * draws), **rep)
    tokens = tokens.view(rows, draws)
    filtered_rows = 0
    for r in range(rows):
        t = _row_value(params["temperature"], r)
        allowed, _ = allowed_tokens(
            logits[r].numpy(),
            t,
            _row_value(params.get("top_k"), r),
            _row_value(params.get("top_p"), r),
            _row_value(params.get("min_p"), r),
        )
        filtered_rows += allowed.size < v
        drawn = set(tokens[r].tolist())
        assert drawn <= set(allowed.tolist()), (
            f"row {r}: drew {sorted(drawn - set(allowed.tolist()))} outside the allowed set"
        )
    assert filtered_rows > rows // 2, "the filters removed tokens in too few rows for the test to mean anything"


def test_greedy_rows_are_argmax(seed):
    b, v = 64, 500
    logits = torch.randn(b, v)
    logits[5, [3, 400]] = logits[5].max() + 1.0  # a tie: the first index wins
    tokens, _ = rk.sample(logits, temperature=0.0, top_k=3, top_p=0.5)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[5].item() == 3
    temperature = torch.rand(b) + 0.5
    temperature[::3] = 0.0
    tokens, _ = rk.sample(logits, temperature=temperature, seeds=random_seeds(b))
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits.argmax(dim=-1)[greedy])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_row_does_not_depend_on_batch_size_or_position(seed, dtype):
    v, small = 2000, 7
    logits = (torch.randn(small, v) * 2).to(dtype)
    params = row_params(small, "all", v)
    seeds = random_seeds(small)
    tokens, logprobs = rk.sample(logits, seeds=seeds, **params)
    for r in range(small):  # each row alone (N = 1)
        t1, lp1 = rk.sample(logits[r : r + 1], seeds=seeds[r : r + 1], **{k: x[r : r + 1] for k, x in params.items()})
        assert t1.item() == tokens[r].item() and torch.equal(lp1[0], logprobs[r]), f"row {r} changed at N=1"
    for n in (64, 300):  # the rows at random positions among other rows with other parameters
        pos = torch.randperm(n)[:small]
        big_logits = (torch.randn(n, v) * 2).to(dtype)
        big_logits[pos] = logits
        big = row_params(n, "all", v)
        for k in big:
            big[k][pos] = params[k]
        big_seeds = random_seeds(n)
        big_seeds[pos] = seeds
        t_big, lp_big = rk.sample(big_logits, seeds=big_seeds, **big)
        assert torch.equal(t_big[pos], tokens), f"tokens changed at N={n}"
        assert torch.equal(lp_big[pos], logprobs), f"logprob bits changed at N={n}"


def test_same_seeds_repeat_and_different_seeds_differ(seed):
    b, v = 256, 1000
    logits = torch.randn(b, v)
    seeds = random_seeds(b)
    first, lp_first = rk.sample(logits, seeds=seeds)
    again, lp_again = rk.sample(logits, seeds=seeds)
    assert torch.equal(first, again) and torch.equal(lp_first, lp_again)
    other, _ = rk.sample(logits, seeds=seeds + 1)
    # Under a correct sampler two independent draws of row b agree with probability sum_i p_bi^2.
    collide = torch.softmax(logits.double(), dim=-1).pow(2).sum(dim=-1)
    bound = collide.sum() + SIGMAS * (collide * (1 - collide)).sum().sqrt()
    assert (first == other).sum().item() <= bound.item()


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"temperature": 0.6, "top_k": 5},
        {"temperature": 1.4, "top_p": 0.8, "min_p": 0.03},
        {"temperature": 0.9, "top_k": 7, "top_p": 0.9, "min_p": 0.02},
    ],
    ids=["plain", "temp-topk", "temp-topp-minp", "all"],
)
@pytest.mark.parametrize("source", ["seeds", "generator"])
def test_draw_frequencies_follow_the_filtered_distribution(seed, params, source):
    v, draws = 12, 6000
    row = torch.randn(v) * 1.5
    logits = row.expand(draws, v)
    if source == "seeds":
        tokens, _ = rk.sample(logits, seeds=torch.arange(draws, dtype=torch.int64), **params)
    else:
        tokens, _ = rk.sample(logits, generator=torch.Generator().manual_seed(1234), **params)
    allowed, q = allowed_tokens(
        row.numpy(), params.get("temperature", 1.0), params.get("top_k"), params.get("top_p"), params.get("min_p")
    )
    counts = torch.bincount(tokens, minlength=v).double().numpy()
    outside = np.setdiff1d(np.nonzero(counts)[0], allowed)
    assert outside.size == 0, f"drew tokens {outside.tolist()} outside the allowed set {allowed.tolist()}"
    dof = allowed.size - 1
    if dof == 0:
        return
    expected = q * draws
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    assert chi_square_tail(chi2, dof) >= TAIL_FLOOR, (
        f"chi-square {chi2:.1f} with {dof} dof: counts {counts[allowed]} vs expected {expected.round(1)}"
    )


def test_scalars_and_per_row_tensors_agree(seed):
    b, v = 40, 300
    logits = torch.randn(b, v)
    seeds = random_seeds(b)
    scalar = rk.sample(logits, temperature=0.7, top_k=20, top_p=0.85, min_p=0.02, seeds=seeds)
    per_row = rk.sample(
        logits,
        temperature=torch.full((b,), 0.7, dtype=torch.float64),  # fp32(0.7) would be another temperature
        top_k=torch.full((b,), 20, dtype=torch.int32),
        top_p=torch.full((b,), 0.85, dtype=torch.float64),
        min_p=torch.full((b,), 0.02),
        seeds=seeds,
    )
    assert torch.equal(scalar[0], per_row[0]) and torch.equal(scalar[1], per_row[1])


def test_positions_key_the_noise(seed):
    b, v = 512, 64
    logits = torch.randn(b, v) * 0.5  # flat: independent draws rarely agree
    seeds = random_seeds(b)
    at0, _ = rk.sample(logits, seeds=seeds)
    assert torch.equal(at0, rk.sample(logits, seeds=seeds, positions=0)[0])
    at7, _ = rk.sample(logits, seeds=seeds, positions=7)
    assert torch.equal(at7, rk.sample(logits, seeds=seeds, positions=torch.full((b,), 7, dtype=torch.int32))[0])
    collide = torch.softmax(logits.double(), dim=-1).pow(2).sum(dim=-1)
    bound = collide.sum() + SIGMAS * (collide * (1 - collide)).sum().sqrt()
    assert (at0 == at7).sum().item() <= bound.item(), "position 7 repeats position 0's draws"
    steps = torch.arange(b)  # one seed, successive positions: as independent as fresh seeds
    one_seed = rk.sample(logits[:1].expand(b, v), seeds=seeds[:1].expand(b).contiguous(), positions=steps)[0]
    assert one_seed.unique().numel() > 1


def test_generator_and_global_rng_are_reproducible(seed):
    b, v = 128, 500
    logits = torch.randn(b, v)
    a = rk.sample(logits, generator=torch.Generator().manual_seed(7))
    c = rk.sample(logits, generator=torch.Generator().manual_seed(7))
    d = rk.sample(logits, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])
    torch.manual_seed(seed)
    e = rk.sample(logits)
    torch.manual_seed(seed)
    f = rk.sample(logits)
    assert torch.equal(e[0], f[0])


def test_empty_batch_and_strided_logits(seed):
    tokens, logprobs = rk.sample(torch.randn(0, 10), top_k=torch.empty(0, dtype=torch.int64))
    assert tokens.shape == (0,) and tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    b, v = 33, 200
    storage = torch.randn(v, b)
    seeds = random_seeds(b)
    strided = rk.sample(storage.t(), temperature=0.9, top_p=0.9, seeds=seeds)
    dense = rk.sample(storage.t().contiguous(), temperature=0.9, top_p=0.9, seeds=seeds)
    assert torch.equal(strided[0], dense[0]) and torch.equal(strided[1], dense[1])


def _rows_without_distribution(v: int) -> torch.Tensor:
    """Rows 1-4 hold no distribution (all -inf, one NaN, all NaN, one +inf); rows 0 and 5 do."""
    logits = torch.randn(6, v) * 3
    logits[1] = float("-inf")
    logits[2, v // 2] = float("nan")
    logits[3] = float("nan")
    logits[4, v - 1] = float("inf")
    logits[5, 1:] = float("-inf")
    return logits


@pytest.mark.parametrize("params", [{}, {"temperature": 0.0}, {"top_k": 3, "top_p": 0.5, "min_p": 0.1}])
def test_rows_without_distribution_give_token_0_and_nan(seed, params):
    logits = _rows_without_distribution(50)
    tokens, logprobs = rk.sample(logits, seeds=random_seeds(6), **params)
    assert tokens[1:5].tolist() == [0] * 4 and bool(logprobs[1:5].isnan().all()), (tokens, logprobs)
    assert tokens[5].item() == 0 and logprobs[5].item() == 0.0
    assert bool(torch.isfinite(logprobs[0])) and bool(torch.isfinite(logits[0, tokens[0]]))


def test_tiny_temperature_overflow_gives_token_0_and_nan(seed):
    logits = torch.randn(4, 30) * 10
    logits[3] = -logits[3].abs()  # l / T overflows only to -inf: still a distribution (its maximum)
    logits[3, 7] = 0.0
    tokens, logprobs = rk.sample(logits, temperature=1.2e-38, seeds=random_seeds(4))
    assert tokens[:3].tolist() == [0] * 3 and bool(logprobs[:3].isnan().all())
    assert tokens[3].item() == 7 and logprobs[3].item() == 0.0


def _bad_cases():
    b, v = 4, 10
    meta = torch.empty(b, device="meta")
    return [
        ("list logits", lambda lg: rk.sample([[0.0]]), TypeError, "logits"),
        ("int logits", lambda lg: rk.sample(lg.long()), TypeError, "logits"),
        ("1-D logits", lambda lg: rk.sample(lg[0]), ValueError, "logits"),
        ("empty vocab", lambda lg: rk.sample(lg[:, :0]), ValueError, "logits"),
        (
            "meta logits",
            lambda lg: rk.sample(lg.to("meta")),
            ValueError,
            r"logits must hold data \(the draw reads its values\), got a meta tensor",
        ),
        (
            "meta logits and temperature",
            lambda lg: rk.sample(lg.to("meta"), temperature=meta),
            ValueError,
            "logits must hold data",
        ),
        ("negative temperature", lambda lg: rk.sample(lg, temperature=-0.5), ValueError, "temperature"),
        ("string temperature", lambda lg: rk.sample(lg, temperature="hot"), TypeError, "temperature"),
        (
            "nan temperature row",
            lambda lg: rk.sample(lg, temperature=torch.tensor([1.0, float("nan"), 1.0, 1.0])),
            ValueError,
            "temperature",
        ),
        ("temperature shape", lambda lg: rk.sample(lg, temperature=torch.ones(b + 1)), ValueError, "temperature"),
        ("temperature device", lambda lg: rk.sample(lg, temperature=meta), ValueError, "temperature"),
        ("top_k zero", lambda lg: rk.sample(lg, top_k=0), ValueError, "top_k"),
        ("top_k float", lambda lg: rk.sample(lg, top_k=2.5), TypeError, "top_k"),
        ("top_k float tensor", lambda lg: rk.sample(lg, top_k=torch.ones(b)), TypeError, "top_k"),
        ("top_k zero row", lambda lg: rk.sample(lg, top_k=torch.tensor([1, 0, 2, 3])), ValueError, "top_k"),
        ("top_p zero", lambda lg: rk.sample(lg, top_p=0.0), ValueError, "top_p"),
        ("top_p above one", lambda lg: rk.sample(lg, top_p=1.5), ValueError, "top_p"),
        ("top_p row", lambda lg: rk.sample(lg, top_p=torch.tensor([0.5, 0.0, 0.5, 0.5])), ValueError, "top_p"),
        ("min_p one", lambda lg: rk.sample(lg, min_p=1.0), ValueError, "min_p"),
        ("min_p negative", lambda lg: rk.sample(lg, min_p=-0.1), ValueError, "min_p"),
        ("seeds int32", lambda lg: rk.sample(lg, seeds=torch.zeros(b, dtype=torch.int32)), TypeError, "seeds"),
        ("seeds shape", lambda lg: rk.sample(lg, seeds=torch.zeros(b + 1, dtype=torch.int64)), ValueError, "seeds"),
        (
            "seeds device",
            lambda lg: rk.sample(lg, seeds=torch.zeros(b, dtype=torch.int64, device="meta")),
            ValueError,
            "seeds",
        ),
        (
            "seeds and generator",
            lambda lg: rk.sample(lg, seeds=torch.zeros(b, dtype=torch.int64), generator=torch.Generator()),
            ValueError,
            "generator",
        ),
        ("generator type", lambda lg: rk.sample(lg, generator=3), TypeError, "generator"),
        ("backend name", lambda lg: rk.sample(lg, backend="cuda"), ValueError, "backend"),
        ("infinite temperature", lambda lg: rk.sample(lg, temperature=float("inf")), ValueError, "temperature"),
        ("nan temperature", lambda lg: rk.sample(lg, temperature=float("nan")), ValueError, "temperature"),
        (
            "subnormal temperature",
            lambda lg: rk.sample(lg, temperature=1e-40),
            ValueError,
            "temperature must be 0 or >=",
        ),
        (
            "subnormal temperature row",
            lambda lg: rk.sample(lg, temperature=torch.tensor([1.0, 1e-40, 0.0, 1.0], dtype=torch.float64)),
            ValueError,
            "temperature must be 0 or >=",
        ),
        ("huge int temperature", lambda lg: rk.sample(lg, temperature=10**400), ValueError, "temperature"),
        (
            "huge temperature",
            lambda lg: rk.sample(lg, temperature=1e46),
            ValueError,
            r"temperature must be 0 or >= 1\.1754944e-38 and <= 8\.5070592e\+37 .*got 1e\+46",
        ),
        (
            "huge temperature row",
            lambda lg: rk.sample(lg, temperature=torch.tensor([1.0, 1e300, 0.0, 1.0], dtype=torch.float64)),
            ValueError,
            r"temperature must be 0 or >= .* and <= .*got a value of 1e\+300",
        ),
        (
            "inf temperature row",
            lambda lg: rk.sample(lg, temperature=torch.tensor([1.0, float("inf"), 1.0, 1.0])),
            ValueError,
            "temperature",
        ),
        (
            "int temperature tensor",
            lambda lg: rk.sample(lg, temperature=torch.ones(b, dtype=torch.int64)),
            TypeError,
            "temperature",
        ),
        ("top_k 2**64", lambda lg: rk.sample(lg, top_k=2**64), ValueError, "top_k"),
        ("top_k negative", lambda lg: rk.sample(lg, top_k=-1), ValueError, "top_k"),
        ("top_k bool", lambda lg: rk.sample(lg, top_k=True), TypeError, "top_k"),
        ("top_k shape", lambda lg: rk.sample(lg, top_k=torch.ones(b, 1, dtype=torch.int64)), ValueError, "top_k"),
        ("top_p nan", lambda lg: rk.sample(lg, top_p=float("nan")), ValueError, "top_p"),
        ("top_p int tensor", lambda lg: rk.sample(lg, top_p=torch.ones(b, dtype=torch.int64)), TypeError, "top_p"),
        ("top_p tensor shape", lambda lg: rk.sample(lg, top_p=torch.full((b - 1,), 0.5)), ValueError, "top_p"),
        (
            "min_p nan row",
            lambda lg: rk.sample(lg, min_p=torch.tensor([0.1, float("nan"), 0.0, 0.2])),
            ValueError,
            "min_p",
        ),
        ("positions float", lambda lg: rk.sample(lg, positions=1.5), TypeError, "positions"),
        ("positions 2**64", lambda lg: rk.sample(lg, positions=2**64), ValueError, "positions"),
        ("positions float tensor", lambda lg: rk.sample(lg, positions=torch.zeros(b)), TypeError, "positions"),
        (
            "positions shape",
            lambda lg: rk.sample(lg, positions=torch.zeros(b + 2, dtype=torch.int64)),
            ValueError,
            "positions",
        ),
    ], (b, v)


_CASES, _SHAPE = _bad_cases()


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_bad_input_names_the_argument(seed, case):
    _, call, error, name = case
    logits = torch.randn(*_SHAPE)
    with pytest.raises(error, match=name):
        call(logits)


@pytest.mark.gpu
def test_cuda_seeded_draws_match_cpu_and_are_batch_invariant(seed):
    b, v = 64, 5000
    logits = torch.randn(b, v) * 2
    params = row_params(b, "all", v)
    seeds = random_seeds(b)
    cpu_tokens, cpu_lp = rk.sample(logits, seeds=seeds, **params)
    cuda = {k: x.cuda() for k, x in params.items()}
    tokens, lp = rk.sample(logits.cuda(), seeds=seeds.cuda(), **cuda)
    assert torch.equal(tokens.cpu(), cpu_tokens)
    contract.assert_close(lp, cpu_lp.double(), "logprob", torch.float32, name="cuda logprobs")
    for n in (1, 7):
        t_n, lp_n = rk.sample(logits[:n].cuda(), seeds=seeds[:n].cuda(), **{k: x[:n] for k, x in cuda.items()})
        assert torch.equal(t_n, tokens[:n]) and torch.equal(lp_n, lp[:n])


@pytest.mark.gpu
def test_cuda_batch_sizes_share_compiled_kernels(seed):
    """A serving engine warms the sampler at one batch size and then samples at others: no batch
    size may compile a kernel again (Triton compiles per argument alignment, so a buffer handed to
    a kernel at an offset that varies with the batch would)."""
    v = 5000
    kernels = [getattr(triton_sampling, name) for name in vars(triton_sampling) if name.endswith("_kernel")]

    def compiled() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.flavour().device_caches.values())

    def draw(b: int) -> None:
        logits = torch.randn(b, v, device="cuda") * 2
        rk.sample(logits, temperature=0.8, seeds=random_seeds(b).cuda(), backend="triton")
        rk.sample(logits, temperature=0.8, top_k=20, top_p=0.9, seeds=random_seeds(b).cuda(), backend="triton")

    draw(8)
    warm = compiled()
    for b in (6, 5, 3, 1, 13):
        draw(b)
        assert compiled() == warm, f"batch size {b} compiled {compiled() - warm} more kernel(s) than batch size 8"


# ============================================================== the Triton backend
#
# Triton backend of ``sample``: the reference's tokens, bitwise log-probs, the exact filtered
# distribution, seeded batch invariance, -inf logits, dispatch and bad input.
#
# Each case runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test: the kernels
# pick interpreted or compiled execution at launch time) at small shapes, and the ``gpu``-marked
# cases compile it at the serving shape (B=128, V=151936). Expected distributions come from the fp64
# spec of the reference cases above; the Triton and torch backends draw the same keyed noise, so
# their tokens are compared exactly (a token could differ only where two noisy scores tie to the
# last bit of a log, which random inputs do not produce). The interpreter runs a row in tens of ms,
# so the CPU distribution checks use a few hundred draws; the GPU ones use 100k.


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


@pytest.mark.parametrize(
    "params", [{"top_k": 40}, {"top_p": 0.5}, {"top_k": 60, "top_p": 0.8, "min_p": 0.01}], ids=["top_k", "top_p", "all"]
)
def test_exact_fallbacks_match_the_reference(seed, interpret, monkeypatch, params):
    # a capacity of 16 candidates: top-k 40 and top-p over 400 tokens take the exact path (searches
    # over keys by count and by mass, ending on a gathered band); the kernel must still draw the
    # reference's tokens
    monkeypatch.setattr(triton_sampling, "CANDIDATES", 16)
    b, v = 10, 400
    _same_tokens_as_reference(
        _logits(b, v, torch.float32, torch.device("cpu")), random_seeds(b), temperature=1.3, **params
    )


@pytest.mark.parametrize(
    "params",
    [{"top_k": 50, "top_p": 0.9}, {"top_p": 0.9}, {"top_k": 2000}],
    ids=["top_k_top_p", "top_p", "top_k_exact"],
)
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


@pytest.mark.parametrize("params", CHI_SQUARE_CASES, ids=["top_k", "top_p", "min_p", "combined"])
def test_triton_draw_frequencies_follow_the_filtered_distribution(seed, interpret, params):
    v, draws = 8, 200
    row = torch.randn(v)
    # a row the filters cut to one token tests no distribution (a peaked draw of 8 can be one)
    while (
        allowed_tokens(
            row.double().numpy(),
            params.get("temperature", 1.0),
            params.get("top_k"),
            params.get("top_p"),
            params.get("min_p"),
        )[0].size
        < 2
    ):
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
    tokens = torch.cat(
        [
            rk.sample(block[: min(chunk, draws - s)], seeds=seeds[s : s + chunk], **params)[0]
            for s in range(0, draws, chunk)
        ]
    )
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
            t1, lp1 = rk.sample(
                logits[r : r + 1],
                seeds=seeds[r : r + 1],
                backend="triton",
                **{k: x[r : r + 1] for k, x in params.items()},
            )
            assert torch.equal(t1, tokens[r : r + 1]) and torch.equal(lp1, logprobs[r : r + 1]), (
                f"row {r} changed alone"
            )
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
    for params in (
        {},
        {"top_k": 3, "top_p": 0.5, "min_p": 0.1},
        {"temperature": 0.0},
        {"top_k": v // 2},
        {"top_p": 0.95},
    ):
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


def test_triton_bad_input_names_the_argument(seed, interpret):
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
