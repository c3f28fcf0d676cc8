"""Property-based checks (hypothesis) of the public ops on generated shapes, dtypes, extreme
values and masks: outputs against fp64 formulas within the contract, finite wherever the math is
finite, the Triton kernels (under the interpreter) agreeing with the torch backend, and invalid
input refused with an error naming the argument.

The example budget is fixed for CI; ``RL_KERNEL_HYPOTHESIS_EXAMPLES=N`` runs a longer search.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close

EXAMPLES = int(os.environ.get("RL_KERNEL_HYPOTHESIS_EXAMPLES", "15"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="RL_KERNEL_HYPOTHESIS_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
BACKENDS = ["torch", "triton"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


@pytest.fixture
def interpret(monkeypatch):
    """Triton kernels run under the interpreter on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@st.composite
def masked_logits(draw):
    """``(logits [N, V], targets [N], temperature, dtype)``: unit to 1e4-scale values (1e4 only in
    fp32), a random share of ``-inf`` entries, every target finite."""
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    n = draw(st.integers(1, 4))
    v = draw(st.integers(1, 300))
    scale = draw(st.sampled_from([1.0, 30.0, 1e4] if dtype == torch.float32 else [1.0, 30.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    masked_share = draw(st.sampled_from([0.0, 0.5, 0.99]))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale
    logits[torch.rand(n, v, generator=g) < masked_share] = float("-inf")
    targets = torch.randint(0, v, (n,), generator=g)
    logits[torch.arange(n), targets] = torch.randn(n, generator=g) * scale
    temperature = draw(st.sampled_from([1.0, 0.7, 1.6]))
    return logits.to(dtype), targets, temperature, dtype


def fp64_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    z = logits.double() / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(case=masked_logits())
def test_logprob_from_logits_matches_fp64(interpret, backend, case):
    logits, targets, temperature, dtype = case
    x = logits.clone().requires_grad_()
    lp, ent = rk.logprob_from_logits(x, targets, temperature=temperature, return_entropy=True, backend=backend)
    lp64, ent64 = fp64_logprob_entropy(logits, targets, temperature)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert_close(lp, lp64, "logprob", dtype, "logprob")
    assert_close(ent, ent64, "logprob", dtype, "entropy")
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[torch.isneginf(logits)] == 0).all()


@SETTINGS
@given(case=masked_logits())
def test_logprob_from_logits_backends_agree(interpret, case):
    logits, targets, temperature, dtype = case
    got = rk.logprob_from_logits(logits, targets, temperature=temperature, return_entropy=True, backend="triton")
    ref = rk.logprob_from_logits(logits, targets, temperature=temperature, return_entropy=True, backend="torch")
    for name, a, b in zip(("logprob", "entropy"), got, ref):
        assert_close(a, b.double(), "logprob", dtype, name)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    n=st.integers(1, 5),
    d=st.integers(1, 40),
    v=st.integers(1, 200),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.1, 1.0, 10.0]),
)
def test_linear_logprob_matches_fp64(interpret, backend, n, d, v, seed, scale):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g) * scale
    weight = torch.randn(v, d, generator=g) / d**0.5
    targets = torch.randint(0, v, (n,), generator=g)
    lp, ent = rk.linear_logprob(hidden, weight, targets, return_entropy=True, backend=backend)
    lp64, ent64 = fp64_logprob_entropy(hidden.double() @ weight.double().T, targets, 1.0)
    assert_close(lp, lp64, "logprob", torch.float32, "logprob")
    assert_close(ent, ent64, "logprob", torch.float32, "entropy")


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    groups=st.integers(1, 4),
    size=st.integers(1, 6),
    offset=st.sampled_from([0.0, 1e4]),
    spread=st.sampled_from([0.0, 2e-3, 1.0]),
    eps=st.sampled_from([0.0, 1e-6]),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_advantages_match_fp64(interpret, backend, groups, size, offset, spread, eps, seed):
    rewards = (offset + torch.randn(groups * size, generator=torch.Generator().manual_seed(seed)) * spread).float()
    adv = rk.group_advantages(rewards, group_size=size, eps=eps, backend=backend)
    r = rewards.double().view(groups, size)
    if size == 1:
        expected = r / (1.0 + eps)
    else:
        centred = r - r.mean(-1, keepdim=True)
        std = r.std(-1, keepdim=True)
        expected = torch.where(std + eps == 0, torch.zeros_like(r), centred / (std + eps))
    assert torch.isfinite(adv).all()
    assert_close(adv, expected.flatten(), "reduction", torch.float32, "advantages")


@SETTINGS
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 40)),
    seed=st.integers(0, 2**31 - 1),
    kl_type=st.sampled_from(["k1", "abs", "k2", "low_var_kl"]),
    agg=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
    masked_share=st.sampled_from([0.0, 0.5, 1.0]),
    dual_clip=st.booleans(),
)
def test_policy_loss_backends_agree(interpret, shape, seed, kl_type, agg, masked_share, dual_clip):
    g = torch.Generator().manual_seed(seed)
    logprob, old, ref = (torch.randn(shape, generator=g) - 2 for _ in range(3))
    advantages = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) >= masked_share
    kwargs = dict(
        ref_logprob=ref, kl_type=kl_type, kl_coef=0.1, loss_agg_mode=agg, clip_ratio_c=3.0 if dual_clip else None
    )
    loss, metrics = rk.policy_loss(logprob, old, advantages, mask, backend="triton", **kwargs)
    loss_ref, metrics_ref = rk.policy_loss(logprob, old, advantages, mask, backend="torch", **kwargs)
    assert torch.isfinite(loss)
    assert_close(loss, loss_ref.double(), "reduction", torch.float32, "loss")
    for name, value in metrics_ref.items():
        assert_close(metrics[name], value.double(), "reduction", torch.float32, name)


@SETTINGS
@given(
    v=st.integers(2, 50),
    bad=st.sampled_from(["targets_high", "targets_negative", "top_k", "top_p", "min_p", "temperature"]),
    value=st.integers(1, 2**70),
)
def test_invalid_input_names_the_argument(v, bad, value):
    logits = torch.randn(3, v)
    targets = torch.zeros(3, dtype=torch.long)
    if bad == "targets_high":
        targets[1] = v + value % 1000
        call, name = (lambda: rk.logprob_from_logits(logits, targets, backend="torch")), "targets"
    elif bad == "targets_negative":
        targets[2] = -2 - value % 1000
        call, name = (lambda: rk.logprob_from_logits(logits, targets, backend="torch")), "targets"
    elif bad == "top_k":
        call, name = (lambda: rk.sample(logits, top_k=-value, backend="torch")), "top_k"
    elif bad == "top_p":
        call, name = (lambda: rk.sample(logits, top_p=1.0 + value, backend="torch")), "top_p"
    elif bad == "min_p":
        call, name = (lambda: rk.sample(logits, min_p=1.0 + value, backend="torch")), "min_p"
    else:
        call, name = (lambda: rk.sample(logits, temperature=-float(value), backend="torch")), "temperature"
    with pytest.raises((ValueError, TypeError), match=name):
        call()


SMALLEST_TEMPERATURE = 2.0**-126  # the smallest normal fp32
LARGEST_TEMPERATURE = 2.0**126  # its reciprocal: above it 1/T is no normal fp32
TEMPERATURE_REFUSAL = r"temperature must be (0 or )?>= 1\.1754944e-38 and <= 8\.5070592e\+37 \(.*\), got "
OUT_OF_RANGE_TEMPERATURES = st.one_of(
    st.sampled_from([1e46, 1e300, 8.6e37, 1e-39, 1e-45]),
    st.floats(min_value=LARGEST_TEMPERATURE, max_value=1.7976931348623157e308, exclude_min=True),
    st.floats(min_value=5e-324, max_value=SMALLEST_TEMPERATURE, exclude_max=True),
)


def _temperature_calls(v: int, seed: int):
    """Each op taking a temperature, as ``call(temperature, backend)`` on random inputs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, v, generator=g)
    targets = torch.randint(0, v, (3,), generator=g)
    hidden, weight = torch.randn(3, 8, generator=g), torch.randn(v, 8, generator=g)
    old, adv = torch.randn(3, generator=g) - 2, torch.randn(3, generator=g)
    seeds = torch.randint(-(2**63), 2**63 - 1, (3,), generator=g)
    return {
        "logprob_from_logits": lambda t, b: rk.logprob_from_logits(logits, targets, temperature=t, backend=b),
        "linear_logprob": lambda t, b: rk.linear_logprob(hidden, weight, targets, temperature=t, backend=b),
        "fused_linear_policy_loss": lambda t, b: rk.fused_linear_policy_loss(
            hidden, weight, targets, old, adv, torch.ones(3, dtype=torch.bool), temperature=t, backend=b
        ),
        "sample": lambda t, b: rk.sample(logits, temperature=t, seeds=seeds, backend=b),
        "sample per row": lambda t, b: rk.sample(
            logits, temperature=torch.tensor([1.0, t, 0.0], dtype=torch.float64), seeds=seeds, backend=b
        ),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    temperature=OUT_OF_RANGE_TEMPERATURES,
    op=st.sampled_from(sorted(_temperature_calls(2, 0))),
    v=st.integers(2, 50),
    seed=st.integers(0, 2**31 - 1),
)
def test_temperatures_without_a_normal_fp32_reciprocal_are_refused(interpret, backend, temperature, op, v, seed):
    """A temperature outside [2**-126, 2**126] (1/T subnormal, 0 or overflowing in fp32) is refused by
    every op on every backend, naming the argument, the accepted range and the value, before any
    kernel runs: none gives a NaN or a value that differs between backends."""
    with pytest.raises(ValueError, match=TEMPERATURE_REFUSAL):
        _temperature_calls(v, seed)[op](temperature, backend)


@SETTINGS
@given(
    temperature=st.one_of(
        st.sampled_from([LARGEST_TEMPERATURE, 1e37, 1e30]), st.floats(min_value=1.0, max_value=LARGEST_TEMPERATURE)
    ),
    n=st.integers(1, 4),
    v=st.integers(2, 300),
    seed=st.integers(0, 2**31 - 1),
    masked_share=st.sampled_from([0.0, 0.5]),
)
def test_large_accepted_temperatures_give_the_torch_result(interpret, temperature, n, v, seed, masked_share):
    """Up to the largest accepted temperature the Triton kernels give the torch backend's finite
    (near-uniform) log-probs and tokens, with ``-inf`` logits and the kernels' padded lanes."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    logits[torch.rand(n, v, generator=g) < masked_share] = float("-inf")
    targets = torch.randint(0, v, (n,), generator=g)
    logits[torch.arange(n), targets] = torch.randn(n, generator=g)
    got = rk.logprob_from_logits(logits, targets, temperature=temperature, return_entropy=True, backend="triton")
    ref = rk.logprob_from_logits(logits, targets, temperature=temperature, return_entropy=True, backend="torch")
    for name, a, b in zip(("logprob", "entropy"), got, ref):
        assert torch.isfinite(a).all(), f"{name}: {a}"
        assert_close(a, b.double(), "logprob", torch.float32, name)
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    tokens, logprobs = rk.sample(logits, temperature=temperature, seeds=seeds, backend="triton")
    ref_tokens, ref_logprobs = rk.sample(logits, temperature=temperature, seeds=seeds, backend="torch")
    assert torch.equal(tokens, ref_tokens) and torch.isfinite(logprobs).all()
    assert_close(logprobs, ref_logprobs.double(), "logprob", torch.float32, "sample logprobs")
