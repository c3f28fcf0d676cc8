"""``rl_kernel_verl.loss.ppo_loss`` against verl's own ``ppo_loss`` on the same inputs.

Inputs are laid out as verl's worker hands them to the loss (nested per-sequence log-probs over
prompt + response, a no-padding TensorDict with padded per-token fields), over every
aggregation mode, the KL estimators, and both verl normalisations: local (one rank, no global
counts) and global (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``). Loss, every metric (value and aggregation type) and the gradients with
respect to the log-probs and entropies must agree within the contract.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from verl_cpu import compose_config, random_rollout, to_engine_batch

from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss.api import LOSS_AGG_MODES

FP32 = torch.float32


@pytest.fixture(scope="module")
def actor_config(model_dirs):
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(compose_config(model_dirs["tied"]).actor_rollout_ref.actor)


def _case(seed: int, *, global_norm: bool, entropy: bool, weights: bool):
    """(model_output factory, data): random log-probs/entropies and the batch verl's loss reads."""
    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(g)
    mask = rollout["response_mask"]
    shape = mask.shape
    per_token = {
        "advantages": torch.randn(shape, generator=g),
        "old_log_probs": -3.0 * torch.rand(shape, generator=g),
        "ref_log_prob": -3.0 * torch.rand(shape, generator=g),
    }
    if weights:
        per_token["rollout_is_weights"] = 0.5 + torch.rand(shape, generator=g)
    dp_size, tokens, seqs = (2, int(mask.sum()) * 2 + 3, 2 * shape[0] + 1) if global_norm else (1, None, None)
    data = to_engine_batch({**rollout, **per_token}, dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=seqs)
    offsets = data["input_ids"].offsets()
    total = int(offsets[-1])
    # current log-probs near the old ones (ratios around 1, some clipped, a few dual-clipped)
    values = {"log_probs": -3.0 * torch.rand(total, generator=g), "entropy": 2.0 * torch.rand(total, generator=g)}

    def model_output():
        leaves = {k: v.clone().requires_grad_(True) for k, v in values.items() if k == "log_probs" or entropy}
        nested = {k: torch.nested.nested_tensor_from_jagged(v, offsets) for k, v in leaves.items()}
        return nested, leaves

    from verl.workers.utils.padding import no_padding_2_padding

    current = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(values["log_probs"], offsets), data)
    data["old_log_probs"] = current + 0.4 * torch.randn(shape, generator=g)
    data["old_log_probs"][0, :2] = current[0, :2] - 1.5
    data["advantages"][0, :2] = -data["advantages"][0, :2].abs() - 0.1
    return model_output, data


def _compare(config, seed: int, **case):
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    from rl_kernel_verl.loss import ppo_loss

    model_output, data = _case(seed, **case)
    out_verl, leaves_verl = model_output()
    out_ours, leaves_ours = model_output()
    loss_verl, metrics_verl = verl_ppo_loss(config, out_verl, data)
    loss_ours, metrics_ours = ppo_loss(config, out_ours, data)

    assert_close(loss_ours, loss_verl, "reduction", FP32, name="loss")
    assert metrics_ours.keys() == metrics_verl.keys()
    for key, expected in metrics_verl.items():
        actual = metrics_ours[key]
        if key == "kl_coef":
            assert actual == expected
            continue
        assert actual.aggregation == expected.aggregation, key
        assert_close(
            torch.as_tensor(actual.values[0], dtype=torch.float64),
            torch.as_tensor(expected.values[0], dtype=torch.float64).detach(),
            "reduction",
            FP32,
            name=key,
        )
    loss_verl.backward()
    loss_ours.backward()
    for name in leaves_verl:
        assert_close(leaves_ours[name].grad, leaves_verl[name].grad, "gradient", FP32, name=f"d loss / d {name}")


@pytest.mark.parametrize("global_norm", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k1", "mse", "abs", "k3+"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_loss_matches_verl(actor_config, seed, mode, kl_type, global_norm):
    config = dataclasses.replace(
        actor_config,
        loss_agg_mode=mode,
        kl_loss_type=kl_type,
        use_kl_loss=True,
        loss_scale_factor=16 if global_norm else None,
        global_batch_info={},
    )
    _compare(config, seed, global_norm=global_norm, entropy=True, weights=True)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_loss_without_entropy_or_kl_matches_verl(actor_config, seed, mode):
    config = dataclasses.replace(
        actor_config, loss_agg_mode=mode, use_kl_loss=False, entropy_coeff=0.0, global_batch_info={}
    )
    _compare(config, seed, global_norm=True, entropy=False, weights=False)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"policy_loss": {"loss_mode": "gspo"}}, "loss_mode='gspo'"),
        ({"kl_loss_type": "full"}, "kl_loss_type='full'"),
        ({"entropy_coeff": -0.1}, "negative coefficient"),
    ],
)
def test_configs_rl_kernel_does_not_implement_keep_verls_loss(actor_config, change, reason):
    from rl_kernel_verl.loss import unsupported_reason

    from verl.workers.config import PolicyLossConfig

    if "policy_loss" in change:
        change = {"policy_loss": dataclasses.replace(actor_config.policy_loss, **change["policy_loss"])}
    config = dataclasses.replace(actor_config, use_kl_loss=True, **change)
    found = unsupported_reason(config)
    assert found is not None and reason in found
    assert unsupported_reason(actor_config) is None
    assert isinstance(actor_config.policy_loss, PolicyLossConfig)
