"""Inputs the hooks cannot serve go to vime's own function (logged once), or raise in strict mode;
missing targets and changed signatures are left alone (or raise in strict mode)."""

import logging
import sys
import types

import pytest
import torch

from rl_kernel_core.contract import assert_close
import rl_kernel_vime
from rl_kernel_vime import config, fallback, hooks, patch, registry, targets
from vime.backends.megatron_utils import loss as vime_loss
from vime.utils import ppo_utils
from vime_helpers import make_args, make_batch, packed_fields


class Spy:
    """Stands in for vime's function: records calls, returns a marker."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []
        self.__signature__ = __import__("inspect").signature(fn)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return ("vime's result", len(self.calls))


def _spy(monkeypatch, module, attr):
    spy = Spy(getattr(module, attr))
    monkeypatch.setattr(module, attr, spy)
    return spy


def _fallback_records(caplog):
    return [r for r in caplog.records if r.name == "rl_kernel.vime" and "falls back" in r.getMessage()]


def _check(monkeypatch, caplog, spy, call, op, reason_part):
    """Twice non-strict: vime's function gets the call both times, one log line; strict: error, no call."""
    with caplog.at_level(logging.WARNING, logger="rl_kernel.vime"):
        first = call()
        second = call()
    assert first == ("vime's result", 1) and second == ("vime's result", 2)
    records = _fallback_records(caplog)
    assert len(records) == 1 and reason_part in records[0].getMessage()
    ((reason, count),) = fallback.counts()[op].items()
    assert reason_part in reason and count == 2
    monkeypatch.setenv(config.STRICT_VAR, "1")
    with pytest.raises(fallback.FallbackError, match=reason_part):
        call()
    assert len(spy.calls) == 2


def _logprob_call(gen, args, **extra):
    logits, batch = make_batch(gen)
    return lambda: hooks.get_log_probs_and_entropy(
        logits,
        args=args,
        **packed_fields(batch),
        with_entropy=True,
        **extra,
    )


@pytest.mark.parametrize(
    "args_or_extra, reason_part",
    [
        ({"context_parallel_size": 2}, "context parallel"),
        ({"tensor_model_parallel_size": 4}, "tensor_model_parallel_size=4"),
        ({"top_p_token_ids": [[1]]}, "top_p_token_ids"),
    ],
)
def test_get_log_probs_and_entropy_falls_back(monkeypatch, caplog, gen, args_or_extra, reason_part):
    spy = _spy(monkeypatch, vime_loss, "get_log_probs_and_entropy")
    if "top_p_token_ids" in args_or_extra:
        call = _logprob_call(gen, make_args(), **args_or_extra)
    else:
        call = _logprob_call(gen, make_args(**args_or_extra))
    _check(monkeypatch, caplog, spy, call, "logprob", reason_part)
    assert spy.calls[0][1]["with_entropy"] is True


def test_calculate_log_probs_and_entropy_falls_back_on_unknown_arguments(monkeypatch, caplog, gen):
    spy = _spy(monkeypatch, ppo_utils, "calculate_log_probs_and_entropy")
    logits = torch.randn(5, 9, generator=gen)
    tokens = torch.randint(0, 9, (5,), generator=gen)
    mask = torch.rand(5, 9, generator=gen) > 0.5
    call = lambda: hooks.calculate_log_probs_and_entropy(logits, tokens, None, True, log_prob_keep_mask=mask)  # noqa: E731
    _check(monkeypatch, caplog, spy, call, "logprob", "log_prob_keep_mask")
    assert spy.calls[0][1]["log_prob_keep_mask"] is mask


def test_calculate_log_probs_and_entropy_serves_a_single_rank_group(gen, tmp_path):
    """A real (gloo, one rank) tensor-parallel group is served, not a fallback."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        logits = torch.randn(6, 10, generator=gen)
        tokens = torch.randint(0, 10, (6,), generator=gen)
        got, _ = hooks.calculate_log_probs_and_entropy(logits, tokens, dist.group.WORLD)
        want, _ = ppo_utils.calculate_log_probs_and_entropy(logits, tokens, None)
        assert_close(got, want, "logprob", torch.float32, "log_prob")
        assert fallback.counts() == {}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kl_type, with_ratio, reason_part",
    [("k3", False, "unclamped"), ("kl_full", False, "not one of"), ("low_var_kl", True, "importance_ratio")],
)
def test_compute_approx_kl_falls_back(monkeypatch, caplog, gen, kl_type, with_ratio, reason_part):
    spy = _spy(monkeypatch, ppo_utils, "compute_approx_kl")
    a, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    ratio = torch.rand(8, generator=gen) + 0.5 if with_ratio else None
    call = lambda: hooks.compute_approx_kl(a, b, kl_type, importance_ratio=ratio)  # noqa: E731
    _check(monkeypatch, caplog, spy, call, "ratio_kl", reason_part)


@pytest.mark.parametrize(
    "overrides, reason_part",
    [
        ({"use_tis": True}, "use_tis"),
        ({"advantage_estimator": "gspo"}, "gspo"),
        ({"use_kl_loss": True, "kl_loss_type": "k3", "kl_loss_coef": 0.1}, "k3"),
        ({"context_parallel_size": 2}, "context parallel"),
        ({"use_unbiased_kl": True, "use_kl_loss": True}, "use_unbiased_kl"),
    ],
)
def test_policy_loss_function_falls_back(monkeypatch, caplog, gen, overrides, reason_part):
    spy = _spy(monkeypatch, vime_loss, "policy_loss_function")
    logits, batch = make_batch(gen)
    args = make_args(**overrides)
    call = lambda: hooks.policy_loss_function(args, batch, logits, lambda t: t.sum())  # noqa: E731
    _check(monkeypatch, caplog, spy, call, "grpo_loss", reason_part)
    assert spy.calls[0][0][0] is args and spy.calls[0][0][1] is batch


def _fake_module(name, **attrs):
    module = types.ModuleType(name)
    for attr, value in attrs.items():
        setattr(module, attr, value)
    return module


def _cfg(strict=False, ops=config.OPS):
    return config.Config(enabled=True, ops=frozenset(ops), strict=strict, profile_path=None)


def test_missing_target_is_logged_and_left_alone(caplog):
    module = _fake_module(targets.PPO_UTILS, compute_approx_kl=ppo_utils.compute_approx_kl)
    with caplog.at_level(logging.WARNING, logger="rl_kernel.vime"):
        patch.apply_module(targets.PPO_UTILS, module, _cfg())
    assert module.compute_approx_kl is hooks.compute_approx_kl
    assert not hasattr(module, "calculate_log_probs_and_entropy")
    state = registry.states()[f"{targets.PPO_UTILS}:calculate_log_probs_and_entropy"]
    assert state.startswith("missing")
    assert any("calculate_log_probs_and_entropy" in r.getMessage() for r in caplog.records)
    with pytest.raises(fallback.FallbackError, match="missing"):
        patch.apply_module(targets.PPO_UTILS, _fake_module(targets.PPO_UTILS), _cfg(strict=True))


def test_changed_signature_is_not_patched():
    def compute_approx_kl(log_probs, reference, kind):  # a vime whose parameters were renamed
        raise AssertionError("never called here")

    module = _fake_module(targets.PPO_UTILS, compute_approx_kl=compute_approx_kl)
    patch.apply_module(targets.PPO_UTILS, module, _cfg(ops=["ratio_kl"]))
    assert module.compute_approx_kl is compute_approx_kl
    assert "lacks" in registry.states()[f"{targets.PPO_UTILS}:compute_approx_kl"]
    with pytest.raises(fallback.FallbackError, match="lacks"):
        patch.apply_module(targets.PPO_UTILS, module, _cfg(strict=True, ops=["ratio_kl"]))


def test_patching_is_idempotent_and_restorable(monkeypatch):
    original = ppo_utils.compute_approx_kl
    original_logprob = vime_loss.get_log_probs_and_entropy
    # a non-target vime module importing by name, as slime's actor does
    actor = _fake_module("vime.backends.megatron_utils.actor", get_log_probs_and_entropy=original_logprob)
    monkeypatch.setitem(sys.modules, actor.__name__, actor)
    for _ in range(2):
        patch.apply_module(targets.PPO_UTILS, ppo_utils, _cfg())
        patch.apply_module(targets.LOSS, vime_loss, _cfg())
    assert ppo_utils.compute_approx_kl is hooks.compute_approx_kl
    assert vime_loss.compute_approx_kl is hooks.compute_approx_kl  # the by-name import too
    assert actor.get_log_probs_and_entropy is hooks.get_log_probs_and_entropy
    assert registry.original(f"{targets.PPO_UTILS}:compute_approx_kl") is original
    rl_kernel_vime.restore()
    assert ppo_utils.compute_approx_kl is original and vime_loss.compute_approx_kl is original
    assert actor.get_log_probs_and_entropy is original_logprob
