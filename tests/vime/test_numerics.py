"""Each replacement agrees with the contract stand-in's original within rl_kernel_core.contract.

Nothing is patched here: the hooks are called directly, side by side with the stand-in's
functions, on the same random fp32 inputs (packed samples of different lengths, padding,
entropy, temperature), comparing values and gradients.
"""

from typing import Any

import pytest
import torch

from vime_helpers import assert_same_gradients, make_args, make_batch, packed_fields
from rl_kernel_core.contract import assert_close
from rl_kernel_vime import config, hooks, patch, targets
from vime.backends.megatron_utils import cp_utils
from vime.backends.megatron_utils import loss as vime_loss
from vime.utils import ppo_utils

F32 = torch.float32


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [-1, 4])
def test_calculate_log_probs_and_entropy(gen, with_entropy, chunk_size):
    logits = (3 * torch.randn(13, 29, generator=gen)).requires_grad_()
    tokens = torch.randint(0, 29, (13,), generator=gen)
    want_lp, want_ent = ppo_utils.calculate_log_probs_and_entropy(
        logits, tokens, None, with_entropy=with_entropy, chunk_size=chunk_size
    )
    got_lp, got_ent = hooks.calculate_log_probs_and_entropy(
        logits, tokens, None, with_entropy=with_entropy, chunk_size=chunk_size
    )
    assert got_lp.shape == want_lp.shape == (13, 1) and got_lp.dtype == F32
    assert_close(got_lp, want_lp, "logprob", F32, "log_prob")
    if with_entropy:
        assert got_ent is not None and want_ent is not None
        assert_close(got_ent, want_ent, "logprob", F32, "entropy")
    else:
        assert got_ent is None and want_ent is None
    assert_same_gradients([got_lp, got_ent], [want_lp, want_ent], [logits], ["d logits"], gen)


def test_calculate_log_probs_and_entropy_empty(gen):
    logits = torch.randn(0, 11, generator=gen)
    tokens = torch.zeros(0, dtype=torch.long)
    want_lp, want_ent = ppo_utils.calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True)
    got_lp, got_ent = hooks.calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True)
    assert got_ent is not None and want_ent is not None
    assert got_lp.shape == want_lp.shape and got_ent.shape == want_ent.shape


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_get_log_probs_and_entropy_packed(gen, temperature, with_entropy):
    logits, batch = make_batch(gen)
    args = make_args(rollout_temperature=temperature)
    kwargs = dict(args=args, **packed_fields(batch), with_entropy=with_entropy)
    empty_want, want = vime_loss.get_log_probs_and_entropy(logits, **kwargs)
    empty_got, got = hooks.get_log_probs_and_entropy(logits, **kwargs)
    assert empty_got.shape == empty_want.shape == (0,)
    assert list(got) == list(want)
    for key in want:
        assert [t.shape for t in got[key]] == [t.shape for t in want[key]] == [(r,) for r in batch["response_lengths"]]
        for i, (g, w) in enumerate(zip(got[key], want[key])):
            assert_close(g, w, "logprob", F32, f"{key}[{i}]")
    flat = lambda res: [torch.cat(res[k]) for k in res]  # noqa: E731
    assert_same_gradients(flat(got), flat(want), [logits], ["d logits"], gen)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
def test_compute_approx_kl(gen, kl_type):
    # wide log-ratios so that low_var_kl's ±10 clamp is hit on some tokens
    log_probs = (4 * torch.randn(64, generator=gen) - 3).requires_grad_()
    base = 4 * torch.randn(64, generator=gen) - 3
    want = ppo_utils.compute_approx_kl(log_probs, base, kl_type)
    got = hooks.compute_approx_kl(log_probs, base, kl_type)
    if kl_type == "low_var_kl":
        assert bool((want == 10).any()), "inputs must exercise the clamp"
    assert got.dtype == F32
    assert_close(got, want, "elementwise", F32, f"kl {kl_type}")
    assert_same_gradients([got], [want], [log_probs], ["d log_probs"], gen)


LOSS_CONFIGS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dual_clip_entropy": {"eps_clip_c": 3.0, "entropy_coef": 0.01},
    "per_token_loss": {"calculate_per_token_loss": True, "entropy_coef": 0.003},
    "kl_low_var": {"use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.05},
    "kl_k1": {"use_kl_loss": True, "kl_loss_type": "k1", "kl_loss_coef": 0.1},
    "kl_k2_zero_coef": {"use_kl_loss": True, "kl_loss_type": "k2", "kl_loss_coef": 0.0},
    "rollout_logprobs_temperature": {"use_rollout_logprobs": True, "rollout_temperature": 0.8},
}


def _compare_policy_loss(gen, args, batch_edit=None, logprob_hook=False, device="cpu"):
    logits, batch = make_batch(gen, device=device)
    if batch_edit:
        batch_edit(batch)
    reducer = cp_utils.get_sum_of_sample_mean(
        batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], args.calculate_per_token_loss
    )
    loss_want, metrics_want = vime_loss.policy_loss_function(args, batch, logits, reducer)
    (g_want,) = torch.autograd.grad(loss_want, logits)
    if logprob_hook:  # after the reference ran: vime's loss module now resolves our log-prob hook
        cfg = config.Config(enabled=True, ops=frozenset({"logprob"}), strict=False, profile_path=None)
        patch.apply_module(targets.LOSS, vime_loss, cfg)
        assert vime_loss.get_log_probs_and_entropy is hooks.get_log_probs_and_entropy
    loss_got, metrics_got = hooks.policy_loss_function(args, batch, logits, reducer)
    (g_got,) = torch.autograd.grad(loss_got, logits)
    assert list(metrics_got) == list(metrics_want)
    assert_close(loss_got, loss_want, "reduction", F32, "loss")
    for key in metrics_want:
        assert metrics_got[key].dim() == 0 and not metrics_got[key].requires_grad
        assert_close(metrics_got[key], metrics_want[key], "reduction", F32, key)
    assert_close(g_got, g_want, "gradient", F32, "d logits")
    return metrics_got


@pytest.mark.parametrize("logprob_hook", [False, True], ids=["vime_logprob", "hook_logprob"])
@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_policy_loss_function(gen, name, logprob_hook):
    """The loss hook alone (log-probs from vime's function), and with the logprob hook patched in."""
    metrics = _compare_policy_loss(gen, make_args(**LOSS_CONFIGS[name]), logprob_hook=logprob_hook)
    assert "train_rollout_logprob_abs_diff" in metrics


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_policy_loss_function_cuda(gen, name):
    """On CUDA the ops dispatch to their GPU backends; the hooks still match the stand-in."""
    metrics = _compare_policy_loss(gen, make_args(**LOSS_CONFIGS[name]), logprob_hook=True, device="cuda")
    assert "train_rollout_logprob_abs_diff" in metrics


def test_ppo_kl_is_vimes_unclamped_past_the_log_ratio_clamp(gen):
    """Old log-probs 30 below the new ones: the loss takes the ±20 clamp (the clip and dual clip
    bound it), the ``ppo_kl`` metric is vime's unclamped mean."""

    def push(batch):
        batch["log_probs"] = [old - 30.0 for old in batch["log_probs"]]

    _compare_policy_loss(gen, make_args(eps_clip_c=3.0), push)


def test_policy_loss_function_without_old_or_rollout_log_probs(gen):
    def drop(batch):
        batch["log_probs"] = []
        del batch["rollout_log_probs"]

    metrics = _compare_policy_loss(gen, make_args(entropy_coef=0.01), drop)
    assert "train_rollout_logprob_abs_diff" not in metrics


def test_custom_loss_flag_reaches_the_hook(gen):
    """``--loss-type custom_loss --custom-loss-function-path rl_kernel_vime.hooks.policy_loss_function``."""
    logits, batch = make_batch(gen)
    plain = make_args(eps_clip_c=2.5, entropy_coef=0.01)
    flagged = make_args(
        eps_clip_c=2.5,
        entropy_coef=0.01,
        loss_type="custom_loss",
        custom_loss_function_path="rl_kernel_vime.hooks.policy_loss_function",
    )
    loss_want, _, log_want = vime_loss.loss_function(plain, batch, 2, 8, logits)
    loss_got, _, log_got = vime_loss.loss_function(flagged, batch, 2, 8, logits)
    assert log_got["keys"] == log_want["keys"]
    assert_close(loss_got, loss_want, "reduction", F32, "scaled loss")
    assert_close(log_got["values"], log_want["values"], "reduction", F32, "logged values")


def test_policy_loss_function_under_loss_recompute(gen):
    """vime's ``--recompute-loss-function`` runs the loss under non-reentrant activation
    checkpointing; the hook (whose reducer-weight probe uses autograd) must agree there too."""
    from torch.utils.checkpoint import checkpoint

    logits, batch = make_batch(gen)
    args = make_args(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, eps_clip_c=3.0)
    reducer = cp_utils.get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"])
    loss_want, _ = vime_loss.policy_loss_function(args, batch, logits, reducer)
    (g_want,) = torch.autograd.grad(loss_want, logits)
    loss_got, _ = checkpoint(hooks.policy_loss_function, args, batch, logits, reducer, use_reentrant=False)
    (g_got,) = torch.autograd.grad(loss_got, logits)
    assert_close(loss_got, loss_want, "reduction", F32, "loss")
    assert_close(g_got, g_want, "gradient", F32, "d logits")


@pytest.mark.parametrize(
    "setting, names",
    [
        ({"eps_clip": 10**400}, "clip_ratio_low"),
        ({"eps_clip_high": 10**400}, "clip_ratio_high"),
        ({"eps_clip_c": 10**400}, "clip_ratio_c"),
        ({"entropy_coef": 10**400}, "entropy_coef"),
        ({"use_kl_loss": True, "kl_loss_coef": 10**400}, "kl_coef"),
        ({"eps_clip": float("inf")}, "clip_ratio_low"),
    ],
)
def test_policy_loss_function_refuses_settings_beyond_float_naming_them(gen, setting, names):
    """A float setting of 1e400 (an int beyond the float range, or infinity) is a ValueError naming
    rl_kernel_core's argument it feeds, not a bare OverflowError."""
    logits, batch = make_batch(gen)
    args = make_args(**setting)
    reducer = cp_utils.get_sum_of_sample_mean(
        batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], False
    )
    with pytest.raises(ValueError, match=f"^{names} must be .*finite number"):
        hooks.policy_loss_function(args, batch, logits, reducer)


def test_get_log_probs_and_entropy_refuses_a_temperature_beyond_float(gen):
    logits, batch = make_batch(gen)
    with pytest.raises(ValueError, match="^temperature must be a finite number > 0, got an int of"):
        hooks.get_log_probs_and_entropy(logits, args=make_args(rollout_temperature=10**400), **packed_fields(batch))
