"""With the hooks patched in, vime's training step reports per-module timings (step metrics and
a JSONL record) and otherwise trains as vime does. No timing value is asserted."""

import json

import pytest
import torch

from rl_kernel_core.contract import assert_close
from rl_kernel_vime import config, hooks, patch, targets
from vime.backends.megatron_utils import loss as vime_loss
from vime.backends.megatron_utils import model as vime_model
from vime.utils import ppo_utils
from vime_helpers import make_args, make_batch, packed_fields

VOCAB = 17


class TinyLM(torch.nn.Module):
    """tokens [1, T] -> logits [1, T, V] fp32."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=gen))
        self.head = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=gen))

    def forward(self, tokens):
        return self.embed[tokens] @ self.head.T


def _batches(gen, n, device="cpu"):
    out = []
    for _ in range(n):
        _, batch = make_batch(gen, vocab=VOCAB, pad=0, device=device)
        batch["tokens"] = torch.cat(batch["unconcat_tokens"]).unsqueeze(0)
        out.append(batch)
    return out


def _run_steps(model_state, batches, args, with_between_step_work, device="cpu"):
    """Two training steps of 2 micro-batches through whatever vime's functions are now."""
    model = TinyLM(torch.Generator()).to(device)
    model.load_state_dict(model_state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    it = iter(batches)
    for step in range(2):
        if with_between_step_work:
            # what vime does between steps: old log-probs without grad, KL for the advantages
            b = batches[2 * step]
            with torch.no_grad():
                _, res = vime_loss.get_log_probs_and_entropy(model(b["tokens"]), args=args, **packed_fields(b))
            ppo_utils.compute_approx_kl(torch.cat(res["log_probs"]), torch.cat(b["ref_log_probs"]), "low_var_kl")
        results.append(vime_model.train_one_step(args, 7, step, it, model, optimizer, None, 2, 8))
    return results, model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_metrics_and_jsonl_record(gen, tmp_path, device):
    args = make_args(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05, eps_clip_c=3.0)
    state = TinyLM(gen).state_dict()
    batches = _batches(gen, 4, device)
    want, model_want = _run_steps(state, batches, args, with_between_step_work=False, device=device)

    path = tmp_path / "steps.jsonl"
    cfg = config.Config(enabled=True, ops=frozenset(config.OPS), strict=False, profile_path=str(path))
    for name, module in ((targets.PPO_UTILS, ppo_utils), (targets.LOSS, vime_loss), (targets.MODEL, vime_model)):
        patch.apply_module(name, module, cfg)
    assert vime_model.train_one_step is hooks.train_one_step
    got, model_got = _run_steps(state, batches, args, with_between_step_work=True, device=device)

    for (metrics_got, _), (metrics_want, _) in zip(got, want):
        perf = {k: v for k, v in metrics_got.items() if k.startswith("perf/rl_kernel/")}
        assert set(perf) >= {"perf/rl_kernel/logprob_ms", "perf/rl_kernel/loss_ms", "perf/rl_kernel/step_ms"}
        assert all(isinstance(v, float) for v in perf.values())
        assert {k: v for k, v in metrics_got.items() if k not in perf}.keys() == metrics_want.keys()
        for key, value in metrics_want.items():
            assert_close(torch.tensor(metrics_got[key]), torch.tensor(value), "reduction", torch.float32, key)
    for p_got, p_want in zip(model_got.parameters(), model_want.parameters()):
        assert_close(p_got, p_want, "gradient", torch.float32, "parameters after two steps")

    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step_id"] for r in records] == [0, 1] and all(r["rollout_id"] == 7 for r in records)
    for record in records:
        assert {"logprob", "old_logprob", "ratio_kl", "loss", "step"} <= set(record["regions"])
        assert set(record["backends"]) == {"logprob_from_logits", "ratio_kl", "policy_loss"}
        assert record["fallbacks"] == {}
        assert "peak_vram_gib" not in record  # CUDA's peak counter is vime's (profiling.enable(memory=False))


def test_no_step_metrics_without_the_step_hook(gen):
    cfg = config.Config(enabled=True, ops=frozenset(config.OPS), strict=False, profile_path=None)
    for name, module in ((targets.PPO_UTILS, ppo_utils), (targets.LOSS, vime_loss)):
        patch.apply_module(name, module, cfg)
    results, _ = _run_steps(TinyLM(gen).state_dict(), _batches(gen, 4), make_args(), with_between_step_work=True)
    assert not any(k.startswith("perf/") for metrics, _ in results for k in metrics)


@pytest.mark.parametrize("ops", [["ratio_kl"], []])
def test_op_selection(ops):
    cfg = config.Config(enabled=True, ops=frozenset(ops), strict=False, profile_path=None)
    originals = {
        name: getattr(module, attr)
        for name, module, attr in [
            ("kl", ppo_utils, "compute_approx_kl"),
            ("lp", ppo_utils, "calculate_log_probs_and_entropy"),
            ("loss", vime_loss, "policy_loss_function"),
            ("step", vime_model, "train_one_step"),
        ]
    }
    for name, module in ((targets.PPO_UTILS, ppo_utils), (targets.LOSS, vime_loss), (targets.MODEL, vime_model)):
        patch.apply_module(name, module, cfg)
    assert (ppo_utils.compute_approx_kl is hooks.compute_approx_kl) == ("ratio_kl" in ops)
    assert ppo_utils.calculate_log_probs_and_entropy is originals["lp"]
    assert vime_loss.policy_loss_function is originals["loss"]
    assert vime_model.train_one_step is hooks.train_one_step  # step timing: the baseline when ops is empty
