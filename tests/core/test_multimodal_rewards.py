"""Reward-to-token scatter against an fp64 formula written here as loops: sequence, step and
region rewards, group-normalised (GRPO, Dr.GRPO, RLOO), and a cost kept apart."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from rl_kernel_core.advantages.api_rewards import Regions, Signal, Steps, token_advantages

B, G, T = 6, 3, 14


def normalise(values: list[float], estimator: str, norm_by_std: bool, eps: float) -> list[float]:
    """One group's advantages (verl's GRPO / Dr.GRPO / RLOO), as plain floats."""
    n = len(values)
    if n == 1:
        return [values[0] / (1 + eps)] if estimator == "grpo" and norm_by_std else [values[0]]
    mean = sum(values) / n
    if estimator == "rloo":
        return [v - (sum(values) - v) / (n - 1) for v in values]
    if estimator == "dr_grpo" or not norm_by_std:
        return [v - mean for v in values]
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return [(v - mean) / (std + eps) if std + eps else 0.0 for v in values]


def oracle(mask, signal, estimator, norm_by_std, eps):
    out = [[0.0] * T for _ in range(B)]
    for g in range(B // G):
        rows = range(g * G, (g + 1) * G)
        if signal.sequence is not None:
            adv = normalise([float(signal.sequence[b]) for b in rows], estimator, norm_by_std, eps)
            for b, a in zip(rows, adv):
                for t in range(T):
                    out[b][t] += a
        if signal.steps is not None:
            items = [
                (b, int(e), float(v))
                for b in rows
                for e, v in zip(signal.steps.ends[b], signal.steps.values[b])
                if e >= 0
            ]
            if items:
                for (b, end, _), a in zip(items, normalise([v for *_, v in items], estimator, norm_by_std, eps)):
                    for t in range(end + 1):
                        out[b][t] += a
        if signal.regions is not None:
            r = signal.regions
            regions = [
                (b, int(s), int(n), float(v))
                for b in rows
                for s, n, v in zip(r.starts[b], r.lengths[b], r.values[b])
                if n > 0
            ]
            if regions:
                for (b, start, length, _), a in zip(
                    regions, normalise([v for *_, v in regions], estimator, norm_by_std, eps)
                ):
                    for t in range(start, start + length):
                        out[b][t] += a
    return torch.tensor(out, dtype=torch.float64) * mask.double()


def random_signal(scale=1.0, k=4, r=3) -> Any:  # a Signal with every level set
    ends = torch.randint(0, T, (B, k)).sort(dim=1).values
    ends[torch.rand(B, k) < 0.3] = -1
    starts = torch.randint(0, T - 2, (B, r))
    lengths = torch.minimum(torch.randint(0, 5, (B, r)), T - starts)
    return Signal(
        sequence=torch.randn(B) * scale,
        steps=Steps(ends, torch.randn(B, k) * scale),
        regions=Regions(starts, lengths, torch.rand(B, r) * scale),
    )


@pytest.mark.parametrize("estimator, norm_by_std", [("grpo", True), ("grpo", False), ("dr_grpo", True), ("rloo", True)])
def test_reward_and_cost_match_the_fp64_formula(seed, estimator, norm_by_std):
    mask = torch.rand(B, T) < 0.8
    reward, cost = random_signal(), random_signal(scale=3.0)
    out = token_advantages(mask, reward, cost, group_size=G, estimator=estimator, norm_by_std=norm_by_std, eps=1e-6)
    assert out.rewards.dtype == torch.float32 and out.costs is not None and out.costs.dtype == torch.float32
    assert_close(
        out.rewards, oracle(mask, reward, estimator, norm_by_std, 1e-6), "elementwise", torch.float32, "rewards"
    )
    assert_close(out.costs, oracle(mask, cost, estimator, norm_by_std, 1e-6), "elementwise", torch.float32, "costs")
    assert not out.rewards[~mask].any() and not out.costs[~mask].any()


@pytest.mark.parametrize("level", ["sequence", "steps", "regions"])
def test_each_level_alone_and_reward_and_cost_never_mix(seed, level):
    mask = torch.rand(B, T) < 0.9
    full = random_signal()
    reward = Signal(**{level: getattr(full, level)})
    alone = token_advantages(mask, reward, group_size=G)
    assert alone.costs is None
    assert_close(alone.rewards, oracle(mask, reward, "grpo", True, 1e-6), "elementwise", torch.float32, level)
    with_cost = token_advantages(mask, reward, random_signal(scale=5.0), group_size=G)
    assert torch.equal(with_cost.rewards, alone.rewards)


def test_sequence_level_is_group_advantages_broadcast(seed):
    rewards = torch.randn(B)
    mask = torch.ones(B, T, dtype=torch.bool)
    out = token_advantages(mask, Signal(sequence=rewards), group_size=G, estimator="rloo")
    assert torch.equal(out.rewards, rk.group_advantages(rewards, group_size=G, estimator="rloo")[:, None].expand(B, T))


def test_step_statistics_are_group_advantages_over_the_valid_steps(seed):
    """The masked statistics equal rk.group_advantages over each group's valid steps."""
    signal = random_signal()
    assert signal.steps is not None
    got = token_advantages(torch.ones(B, T, dtype=torch.bool), Signal(steps=signal.steps), group_size=G).rewards
    want = torch.zeros(B, T, dtype=torch.float64)
    for g in range(B // G):
        items = [
            (b, int(e), float(v))
            for b in range(g * G, (g + 1) * G)
            for e, v in zip(signal.steps.ends[b], signal.steps.values[b])
            if e >= 0
        ]
        if not items:
            continue
        adv = rk.group_advantages(torch.tensor([v for *_, v in items], dtype=torch.float64), group_size=len(items))
        for (b, end, _), a in zip(items, adv.tolist()):
            want[b, : end + 1] += a
    assert_close(got, want, "elementwise", torch.float32, "step advantages")


def test_equal_rewards_give_exact_zeros_and_runs_are_bitwise_equal(seed):
    mask = torch.ones(B, T, dtype=torch.bool)
    same = Signal(
        sequence=torch.full((B,), 0.1),
        steps=Steps(torch.full((B, 2), 5), torch.full((B, 2), 0.3)),
        regions=Regions(torch.zeros(B, 1, dtype=torch.long), torch.full((B, 1), 3), torch.full((B, 1), 0.7)),
    )
    assert not token_advantages(mask, same, group_size=G, eps=0.0).rewards.any()
    signal = random_signal()
    runs = [token_advantages(mask, signal, signal, group_size=G) for _ in range(2)]
    assert runs[0].costs is not None
    assert torch.equal(runs[0].rewards, runs[1].rewards) and torch.equal(runs[0].rewards, runs[0].costs)


def test_group_of_one_entry_and_no_entries(seed):
    mask = torch.ones(B, T, dtype=torch.bool)
    ends = torch.full((B, 2), -1)
    ends[0, 0] = 4  # the first group's only step
    values = torch.randn(B, 2)
    out = token_advantages(mask, Signal(steps=Steps(ends, values)), group_size=G, estimator="rloo").rewards
    assert torch.equal(out[0, :5], values[0, 0].expand(5)) and not out[0, 5:].any() and not out[1:].any()
    empty = token_advantages(
        mask, Signal(steps=Steps(torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, 0))), group_size=G
    )
    assert not empty.rewards.any()


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (dict(group_size=4), ValueError, r"group_size must be a positive divisor of B = mask.shape\[0\] = 6, got 4"),
        (
            dict(reward=Signal(sequence=torch.randn(B + 1))),
            ValueError,
            r"reward.sequence must have shape \[B\] = \(6,\)",
        ),
        (
            dict(cost=Signal(steps=Steps(torch.full((B, 2), T), torch.randn(B, 2)))),
            ValueError,
            r"cost.steps.ends\[0\]\[0\]: a step's last token must lie in \[0, 14\)",
        ),
        (
            dict(reward=Signal(regions=Regions(torch.full((B, 1), 12), torch.full((B, 1), 3), torch.randn(B, 1)))),
            ValueError,
            r"reward.regions\[0\]\[0\]: a region must lie in \[0, 14\) \(mask's T\), got \[12, 15\)",
        ),
        (
            dict(reward=Signal(steps=Steps(torch.zeros(B, 2), torch.randn(B, 2)))),
            TypeError,
            r"reward.steps.ends must have dtype in \(int64, int32\)",
        ),
        (
            dict(reward=Signal(steps=Steps(torch.zeros(B, 2, dtype=torch.long), torch.randn(B, 3)))),
            ValueError,
            r"reward.steps.ends must have the shape of reward.steps.values \(6, 3\), got \(6, 2\)",
        ),
        (
            dict(reward=torch.randn(B)),
            TypeError,
            r"reward must be a rl_kernel_core.advantages.api_rewards.Signal, got Tensor",
        ),
        (dict(estimator="ppo"), ValueError, r"estimator must be one of"),
    ],
)
def test_bad_input_names_the_argument(seed, bad, error, message):
    args: dict[str, Any] = dict(
        mask=torch.ones(B, T, dtype=torch.bool), reward=Signal(sequence=torch.randn(B)), cost=None, group_size=G
    )
    args.update(bad)
    with pytest.raises(error, match=message):
        token_advantages(args.pop("mask"), args.pop("reward"), args.pop("cost"), **args)


@pytest.mark.gpu
def test_no_host_sync_on_the_gpu(seed):
    signal = random_signal()
    moved = Signal(
        sequence=signal.sequence.cuda(),
        steps=Steps(signal.steps.ends.cuda(), signal.steps.values.cuda()),
        regions=Regions(signal.regions.starts.cuda(), signal.regions.lengths.cuda(), signal.regions.values.cuda()),
    )
    mask = (torch.rand(B, T) < 0.8).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = token_advantages(mask, moved, moved, group_size=G, estimator="rloo")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(
        out.rewards.cpu(), oracle(mask.cpu(), signal, "rloo", True, 1e-6), "elementwise", torch.float32, "rewards"
    )


INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_region_whose_end_wraps_around_is_refused(seed, dtype):
    """``start + length`` beyond the index dtype's range wraps around to a negative end: such a
    region used to pass the range check, land on no token and still enter its group's
    statistics, which flipped the sign of another region's advantage."""
    top = torch.iinfo(dtype).max
    starts = torch.tensor([[2], [top - 1], [5]] * 2, dtype=dtype)
    lengths = torch.tensor([[3], [4], [2]] * 2, dtype=dtype)
    values = torch.tensor([[1.0], [0.0], [3.0]] * 2)
    with pytest.raises(
        ValueError,
        match=re.escape(f"reward.regions[1][0]: a region must lie in [0, {T}) (mask's T), got [{top - 1}, {top + 3})"),
    ):
        token_advantages(
            torch.ones(B, T, dtype=torch.bool), Signal(regions=Regions(starts, lengths, values)), group_size=G
        )
    ends = torch.tensor([[INT64_MAX]] * B if dtype == torch.int64 else [[2**31 - 1]] * B, dtype=dtype)
    with pytest.raises(ValueError, match=re.escape("reward.steps.ends[0][0]: a step's last token must lie in [0, 14)")):
        token_advantages(torch.ones(B, T, dtype=torch.bool), Signal(steps=Steps(ends, torch.randn(B, 1))), group_size=G)


def test_region_positions_property(seed):
    """Property: random regions, some near the index dtype's limits or outside [0, T): refused
    exactly when a region (length > 0) does not lie inside [0, T), computed with Python's
    unbounded integers; otherwise equal to the fp64 loop formula."""
    rng = random.Random(seed)
    for trial in range(60):
        dtype = rng.choice([torch.int64, torch.int32])
        top = torch.iinfo(dtype).max
        pick = [
            lambda: rng.randint(0, T - 1),
            lambda: rng.randint(-3, T + 3),
            lambda: top - rng.randint(0, 5),
            lambda: -top - 1 + rng.randint(0, 5),
        ]
        r = rng.randint(1, 3)
        starts = [[rng.choice(pick[:1] * 6 + pick)() for _ in range(r)] for _ in range(B)]
        lengths = [
            [rng.choice([0, rng.randint(1, 4), rng.randint(-2, 0), top - rng.randint(0, 5)]) for _ in range(r)]
            for _ in range(B)
        ]
        outside = any(
            n > 0 and not (0 <= s and s + n <= T) for row_s, row_n in zip(starts, lengths) for s, n in zip(row_s, row_n)
        )
        regions = Regions(torch.tensor(starts, dtype=dtype), torch.tensor(lengths, dtype=dtype), torch.randn(B, r))
        mask = torch.rand(B, T) < 0.8
        if outside:
            with pytest.raises(ValueError, match=r"a region must lie in \[0, 14\)"):
                token_advantages(mask, Signal(regions=regions), group_size=G)
            continue
        got = token_advantages(mask, Signal(regions=regions), group_size=G).rewards
        assert_close(
            got,
            oracle(mask, Signal(regions=regions), "grpo", True, 1e-6),
            "elementwise",
            torch.float32,
            f"trial {trial}, seed={seed}",
        )


@pytest.mark.parametrize("poison", [float("nan"), -1.0, -1e-30, float("-inf")])
def test_negative_or_nan_mask_weights_are_refused(seed, poison):
    mask = torch.rand(B, T) + 0.5
    mask[2, 7] = poison
    with pytest.raises(ValueError, match=r"^mask weights must be >= 0 and not NaN, got 1 entries outside it"):
        token_advantages(mask, Signal(sequence=torch.randn(B)), group_size=G)


def test_float_mask_property(seed):
    """Property: a float mask with random entries (zeros, positive, negative, NaN, inf) is
    refused exactly when an entry is negative or NaN; otherwise its non-zero entries are the
    tokens that receive advantages."""
    rng = random.Random(seed)
    for _ in range(40):
        mask = torch.tensor(
            [
                [
                    rng.choice([0.0, 0.0, 1.0, rng.random(), 1e30, float("inf"), -rng.random(), float("nan"), -0.0])
                    for _ in range(T)
                ]
                for _ in range(B)
            ],
            dtype=rng.choice(_FLOATS),
        )
        bad = bool(((mask < 0) | mask.isnan()).any())
        reward = Signal(sequence=torch.randn(B))
        if bad:
            with pytest.raises(ValueError, match="mask weights must be >= 0 and not NaN"):
                token_advantages(mask, reward, group_size=G)
        else:
            got = token_advantages(mask, reward, group_size=G).rewards
            expected = token_advantages(mask != 0, reward, group_size=G).rewards
            assert torch.equal(got, expected), f"seed={seed}"


_FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
