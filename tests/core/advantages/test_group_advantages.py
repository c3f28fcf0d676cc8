"""group_advantages against fp64 formulas written here as verl writes them (dicts of groups), and
the shared cases on every backend (``op_backends.on_backends``: ``torch`` on CPU, ``triton`` under
the interpreter on CPU and compiled on CUDA, ``native`` on CUDA) against the per-group fp64 oracle
(``oracles.advantages_oracle``) and the reference backend.

Tolerances come from rl_kernel_core.contract only.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from op_backends import Backend, on_backends
from oracles import advantages_oracle

ESTIMATORS = ["grpo", "dr_grpo", "rloo"]
DTYPES = [torch.float32, torch.bfloat16]


def advantages_formula(
    rewards: torch.Tensor, ids: list, estimator: str, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Python floats (fp64): group by id, then verl's per-estimator rule."""
    r = rewards.double().tolist()
    groups = defaultdict(list)
    for i, g in enumerate(ids):
        groups[g].append(i)
    out = [0.0] * len(r)
    for members in groups.values():
        vals = [r[i] for i in members]
        k = len(vals)
        mean = sum(vals) / k if k > 1 else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (k - 1)) if k > 1 else 1.0
        for i in members:
            if estimator == "rloo":
                out[i] = r[i] - (sum(vals) - r[i]) / (k - 1) if k > 1 else r[i]
            elif estimator == "grpo" and norm_by_std:
                out[i] = (r[i] - mean) / (std + eps)
            else:
                out[i] = r[i] - mean
    return torch.tensor(out, dtype=torch.float64)


def random_rewards(n: int, dtype=torch.float32) -> torch.Tensor:
    r = torch.randn(n)
    return (r + 0.05 * torch.sign(r)).to(dtype)


def random_groups(n: int) -> torch.Tensor:
    """Ids with varied group sizes, singletons included, in shuffled order."""
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(min(int(torch.randint(1, 9, (1,))), n - sum(sizes)))
    sizes[0] = 1 if n > 1 else sizes[0]
    sizes[-1] += n - sum(sizes)
    ids = torch.cat([torch.full((s,), 1000 - 7 * g) for g, s in enumerate(sizes)])  # arbitrary, unsorted id values
    return ids[torch.randperm(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("group_size", [1, 2, 8])
def test_contiguous_groups_match_formula(seed, dtype, estimator, group_size):
    rewards = random_rewards(64, dtype)
    adv = rk.group_advantages(rewards, group_size=group_size, estimator=estimator)
    ids = [i // group_size for i in range(64)]
    assert adv.dtype == torch.float32 and adv.shape == (64,)
    assert_close(adv, advantages_formula(rewards, ids, estimator), "reduction", dtype, f"{estimator} advantages")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_index_groups_any_order_match_formula(seed, dtype, estimator):
    rewards = random_rewards(57, dtype)
    ids = random_groups(57)
    for index_dtype in (torch.int64, torch.int32):
        adv = rk.group_advantages(rewards, group_index=ids.to(index_dtype), estimator=estimator)
        assert_close(
            adv, advantages_formula(rewards, ids.tolist(), estimator), "reduction", dtype, f"{estimator} advantages"
        )


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_shuffled_index_equals_contiguous(seed, estimator):
    rewards = random_rewards(48)
    contiguous = rk.group_advantages(rewards, group_size=6, estimator=estimator)
    ids = torch.arange(48) // 6
    same_layout = rk.group_advantages(rewards, group_index=ids, estimator=estimator)
    assert torch.equal(contiguous, same_layout)
    perm = torch.randperm(48)
    shuffled = rk.group_advantages(rewards[perm], group_index=ids[perm], estimator=estimator)
    assert_close(shuffled, contiguous[perm].double(), "reduction", torch.float32, "shuffled advantages")


def test_norm_by_std_false_is_dr_grpo_and_rloo_scaling(seed):
    rewards = random_rewards(40)
    ids = random_groups(40)
    grpo_plain = rk.group_advantages(rewards, group_index=ids, estimator="grpo", norm_by_std=False)
    assert torch.equal(grpo_plain, rk.group_advantages(rewards, group_index=ids, estimator="dr_grpo"))
    assert_close(
        grpo_plain,
        advantages_formula(rewards, ids.tolist(), "grpo", norm_by_std=False),
        "reduction",
        torch.float32,
        "grpo without std",
    )
    rloo = rk.group_advantages(rewards, group_size=5, estimator="rloo")
    dr = rk.group_advantages(rewards, group_size=5, estimator="dr_grpo")
    assert_close(rloo, dr.double() * 5 / 4, "reduction", torch.float32, "rloo = n/(n-1) (r - mean)")


def test_eps_and_constant_groups(seed):
    # exactly representable rewards: a constant group has mean == reward exactly, so std 0 gives 0
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 0.25, 0.75, 0.5])
    adv = rk.group_advantages(rewards, group_size=4)
    assert bool((adv[:4] == 0).all())
    for eps in (1e-6, 0.5):
        adv = rk.group_advantages(rewards, group_size=4, eps=eps)
        assert_close(
            adv,
            advantages_formula(rewards, [0] * 4 + [1] * 4, "grpo", eps=eps),
            "reduction",
            torch.float32,
            f"eps={eps}",
        )


def test_singleton_groups_follow_verl(seed):
    rewards = random_rewards(5)
    ids = torch.tensor([3, 9, 3, 11, 3])  # groups {0, 2, 4}, {1}, {3}
    grpo = rk.group_advantages(rewards, group_index=ids)
    assert_close(grpo[[1, 3]], rewards[[1, 3]].double() / (1 + 1e-6), "reduction", torch.float32, "grpo singleton")
    for estimator in ("dr_grpo", "rloo"):
        adv = rk.group_advantages(rewards, group_index=ids, estimator=estimator)
        assert torch.equal(adv[[1, 3]], rewards[[1, 3]])


def test_deterministic_and_detached(seed):
    rewards = random_rewards(300).requires_grad_()
    ids = random_groups(300)
    runs = [rk.group_advantages(rewards, group_index=ids, estimator=e) for e in ESTIMATORS for _ in range(2)]
    for a, b in zip(runs[::2], runs[1::2]):
        assert torch.equal(a, b)
    assert not runs[0].requires_grad
    assert dispatch.explain("group_advantages").backend == "torch"


def test_fp64_rewards_stay_fp64(seed):
    rewards = random_rewards(24, torch.float64)
    adv = rk.group_advantages(rewards, group_size=4, estimator="grpo")
    assert adv.dtype == torch.float64
    assert_close(
        adv,
        advantages_formula(rewards, [i // 4 for i in range(24)], "grpo"),
        "reduction",
        torch.float64,
        "fp64 advantages",
    )


def test_non_contiguous_rewards(seed):
    base = random_rewards(64).reshape(16, 4)
    strided = base.t()[1]  # 16 rewards with stride 4
    assert not strided.is_contiguous()
    ids = random_groups(16)
    assert torch.equal(
        rk.group_advantages(strided, group_index=ids), rk.group_advantages(strided.contiguous(), group_index=ids)
    )


def test_empty_rewards():
    for kw in (dict(group_size=3), dict(group_index=torch.zeros(0, dtype=torch.int64))):
        adv = rk.group_advantages(torch.zeros(0), **kw)
        assert adv.shape == (0,) and adv.dtype == torch.float32


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_matches_verl_core_algos_when_installed(seed, estimator):
    """Parity with verl's own estimators (skipped where verl is not installed)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    n = 60
    rewards = torch.randint(1, 6, (n,)).float() / 4  # exact quarters: verl's fp32 group means are exact
    ids = random_groups(n)
    index = ids.numpy()
    scores, mask = rewards[:, None].clone(), torch.ones(n, 1)
    if estimator == "rloo":
        expected, _ = core_algos.compute_rloo_outcome_advantage(scores, mask, index)
    else:
        expected, _ = core_algos.compute_grpo_outcome_advantage(
            scores, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=estimator == "grpo"
        )
    adv = rk.group_advantages(rewards, group_index=ids, estimator=estimator)
    assert_close(adv, expected[:, 0].double(), "reduction", torch.float32, f"{estimator} vs verl")


META = torch.device("meta")


@pytest.mark.parametrize(
    "rewards, kw, err, name",
    [
        ([1.0, 2.0], dict(group_size=1), TypeError, "rewards"),
        (torch.ones(4, dtype=torch.int64), dict(group_size=2), TypeError, "rewards"),
        (torch.ones(2, 4), dict(group_size=2), ValueError, "rewards"),
        (torch.ones(6), {}, ValueError, "group_size and group_index"),
        (
            torch.ones(6),
            dict(group_size=2, group_index=torch.zeros(6, dtype=torch.int64)),
            ValueError,
            "group_size and group_index",
        ),
        (torch.ones(6), dict(group_size=4), ValueError, "group_size"),
        (torch.ones(6), dict(group_size=0), ValueError, "group_size"),
        (torch.ones(6), dict(group_size=2.0), TypeError, "group_size"),
        (torch.ones(6), dict(group_size=True), TypeError, "group_size"),
        (torch.ones(6), dict(group_index=torch.zeros(6)), TypeError, "group_index"),
        (torch.ones(6), dict(group_index=torch.zeros(5, dtype=torch.int64)), ValueError, "group_index"),
        (torch.ones(6), dict(group_index=torch.zeros(2, 3, dtype=torch.int64)), ValueError, "group_index"),
        (torch.ones(6), dict(group_index=torch.zeros(6, dtype=torch.int64, device=META)), ValueError, "group_index"),
        (
            torch.ones(6, device=META),
            dict(group_index=torch.zeros(6, dtype=torch.int64, device=META)),
            ValueError,
            "group_index must hold data",
        ),
        (torch.ones(6).to_sparse(), dict(group_size=2), TypeError, "rewards must be a dense"),
        (torch.ones(6), dict(group_size=2, estimator="ppo"), ValueError, "estimator"),
        (torch.ones(6), dict(group_size=2, norm_by_std=1), TypeError, "norm_by_std"),
        (torch.ones(6), dict(group_size=2, eps=-1e-6), ValueError, "eps"),
        (
            torch.ones(6),
            dict(group_size=2, eps=10**400),
            ValueError,
            "eps must be a finite number >= 0, got an int of 1329 bits",
        ),
    ],
)
def test_bad_input_names_the_argument(rewards, kw, err, name):
    with pytest.raises(err, match=name):
        rk.group_advantages(rewards, **kw)


def test_explicit_backend_that_cannot_run_raises(seed):
    with pytest.raises(rk.BackendUnavailableError, match="native"):
        rk.group_advantages(random_rewards(4), group_size=2, backend="native")


@pytest.mark.gpu
def test_cuda_matches_cpu_deterministically(seed):
    rewards = random_rewards(4096)
    ids = random_groups(4096)
    torch.use_deterministic_algorithms(True)
    try:
        for estimator in ESTIMATORS:
            cpu = rk.group_advantages(rewards, group_index=ids, estimator=estimator)
            runs = [rk.group_advantages(rewards.cuda(), group_index=ids.cuda(), estimator=estimator) for _ in range(2)]
            assert torch.equal(runs[0], runs[1])
            assert_close(runs[0], cpu.double(), "reduction", torch.float32, estimator)
            contiguous = [rk.group_advantages(rewards.cuda(), group_size=8, estimator=estimator) for _ in range(2)]
            assert torch.equal(contiguous[0], contiguous[1])
    finally:
        torch.use_deterministic_algorithms(False)


BACKENDS = [
    pytest.param(("cpu", "torch"), id="cpu-torch"),
    pytest.param(("cpu", "triton"), id="cpu-triton"),
    pytest.param(("cuda", "torch"), id="cuda-torch", marks=pytest.mark.gpu),
    pytest.param(("cuda", "triton"), id="cuda-triton", marks=pytest.mark.gpu),
    pytest.param(("cuda", "native"), id="cuda-native", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKENDS)
def backend_on(request, monkeypatch):
    """``(device, backend)``; CPU Triton runs in the interpreter (chosen at each launch)."""
    device, backend = request.param
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return torch.device(device), backend


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_statistics_in_fp64_on_every_backend(seed, backend_on, estimator):
    """fp32 rewards 1e4 + O(1e-3): differences of a few ulps, which fp32 statistics turn into 0 or
    noise; fp64 statistics give the formula's values within the fp32 contract."""
    device, backend = backend_on
    rewards = (1e4 + torch.randn(64) * 2e-3).to(device)
    index = random_groups(64)
    cases = ((dict(group_size=4), [i // 4 for i in range(64)]), (dict(group_index=index.to(device)), index.tolist()))
    for kw, ids in cases:
        got = rk.group_advantages(rewards, estimator=estimator, backend=backend, **kw)
        assert got.dtype == torch.float32
        assert_close(
            got, advantages_formula(rewards.cpu(), ids, estimator), "reduction", torch.float32, f"advantages {list(kw)}"
        )


def test_equal_rewards_and_zero_eps_give_zero_on_every_backend(seed, backend_on):
    """Groups of equal rewards (whose plain mean is not exact: 0.1, 1/3) get advantage 0 with
    eps = 0 (std + eps = 0) and with the default eps; the other groups follow the formula."""
    device, backend = backend_on
    values = [0.1] * 4 + [1 / 3] * 4 + [-2.5] * 4 + random_rewards(4).tolist()
    rewards = torch.tensor(values, dtype=torch.float32, device=device)
    ids = [i // 4 for i in range(16)]
    for eps in (0.0, 1e-6):
        for kw in (dict(group_size=4), dict(group_index=torch.tensor(ids, device=device))):
            got = rk.group_advantages(rewards, eps=eps, backend=backend, **kw)
            assert torch.equal(got[:12], torch.zeros(12, device=device)), f"eps={eps} {list(kw)}: {got[:12].tolist()}"
            assert_close(
                got[12:],
                advantages_formula(rewards[12:].cpu(), ids[:4], "grpo", eps=eps),
                "reduction",
                torch.float32,
                f"eps={eps}",
            )


# ============================================================== shared cases, every backend


@on_backends("group_advantages")
@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False), ("dr_grpo", True), ("rloo", True)])
def test_group_advantages_by_size_and_by_index(seed, backend: Backend, estimator, norm_by_std):
    device = backend.device
    rewards = torch.randn(48).to(device)
    kw = dict(estimator=estimator, norm_by_std=norm_by_std, eps=1e-6, backend=backend.name)
    by_size = rk.group_advantages(rewards, group_size=8, **kw)
    assert by_size.dtype == torch.float32 and by_size.shape == (48,)
    expected = advantages_oracle(
        rewards, [list(range(g, g + 8)) for g in range(0, 48, 8)], estimator, norm_by_std, 1e-6
    )
    assert_close(by_size, expected, "reduction", torch.float32, "by size")
    index = torch.randint(0, 9, (48,))
    index[:2] = 100  # a group of two, and (likely) some of one
    index[2] = 101
    groups = [torch.nonzero(index == g).flatten().tolist() for g in index.unique()]
    by_index = rk.group_advantages(rewards, group_index=index.to(device), **kw)
    assert_close(
        by_index,
        advantages_oracle(rewards, groups, estimator, norm_by_std, 1e-6),
        "reduction",
        torch.float32,
        "by index",
    )
    ref = rk.group_advantages(rewards, group_index=index.to(device), **{**kw, "backend": "torch"})
    assert_close(by_index, ref.double(), "reduction", torch.float32, "by index vs reference")
    assert torch.equal(by_index, rk.group_advantages(rewards, group_index=index.to(device).to(torch.int32), **kw))


@on_backends("group_advantages")
def test_group_advantages_large_groups_bf16_rewards(seed, backend: Backend):
    rewards = (torch.randn(2 * 1500) * 2 + 1).to(torch.bfloat16).to(backend.device)  # groups span several blocks
    out = rk.group_advantages(rewards, group_size=1500, backend=backend.name)
    groups = [list(range(0, 1500)), list(range(1500, 3000))]
    assert_close(
        out, advantages_oracle(rewards, groups, "grpo", True, 1e-6), "reduction", torch.bfloat16, "bf16 rewards"
    )
    assert torch.equal(out, rk.group_advantages(rewards, group_size=1500, backend=backend.name))


@on_backends("group_advantages", exclude=("triton-interpret", "triton-cuda"))  # triton refuses fp64 rewards
def test_group_advantages_fp64_rewards_stay_fp64(seed, backend: Backend):
    r64 = torch.randn(300, dtype=torch.float64).to(backend.device)
    out64 = rk.group_advantages(r64, group_size=30, estimator="rloo", backend=backend.name)
    assert out64.dtype == torch.float64
    ref64 = rk.group_advantages(r64, group_size=30, estimator="rloo", backend="torch")
    assert_close(out64, ref64, "reduction", torch.float64, "fp64 rewards vs reference")


@on_backends("group_advantages", exclude=("torch",))
def test_group_advantages_custom_op_passes_opcheck(seed, backend: Backend):
    """The fake impl and schema agree with the real kernel."""
    op = getattr(torch.ops.rl_kernel, f"{backend.name}_group_advantages")
    torch.library.opcheck(op, (torch.randn(12, device=backend.device), 4, None, "grpo", True, 1e-6))
