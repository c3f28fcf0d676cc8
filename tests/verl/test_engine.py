"""verl's real FSDP2 engine with the rl-kernel switch off and on: same numbers, and off is untouched.

Each comparison feeds one random rollout to two verl workers built from the same saved weights,
one with ``use_rl_kernel_backend`` and one without, through verl's own worker methods
(``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``). With the switch on the
log-probs and entropies come from ``linear_logprob`` on the final hidden states and the loss from
``policy_loss``; with it off they are verl's (logits → ``log_softmax``, verl's ``ppo_loss``).
Tolerances come from ``rl_kernel_core.contract`` (fp32 model).
"""

from __future__ import annotations

import pytest
import torch
from conftest import SWITCH_ON, random_rollout, to_engine_batch

from rl_kernel_core.contract import assert_close

FP32 = torch.float32


def _engine(worker):
    return worker.actor.engine if worker.actor is not None else worker.ref.engine


def _infer(worker, rollout: dict, temperature: float, ref: bool = False):
    from verl.utils import tensordict_utils as tu

    batch = to_engine_batch(rollout, calculate_entropy=not ref, compute_loss=False, temperature=temperature)
    out = worker.compute_ref_log_prob(batch) if ref else worker.compute_log_prob(batch)
    entropy = None if ref else tu.get(out, "entropy").values()
    return tu.get(out, "log_probs").values(), entropy, tu.get(out, "metrics")


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_old_log_prob_pass_matches_verl(build_worker, seed, model):
    off = build_worker(model, "actor")
    on = build_worker(model, "actor", SWITCH_ON)
    rollout = random_rollout(torch.Generator().manual_seed(seed))
    temperature = float(torch.empty(()).uniform_(0.5, 1.5))

    outputs = []
    hook = _engine(on).module.register_forward_hook(lambda mod, args, out: outputs.append(out))
    try:
        lp_on, ent_on, metrics_on = _infer(on, rollout, temperature)
    finally:
        hook.remove()
    lp_off, ent_off, metrics_off = _infer(off, rollout, temperature)

    assert_close(lp_on, lp_off, "logprob", FP32, name="log_probs")
    assert_close(ent_on, ent_off, "logprob", FP32, name="entropy")
    # the switched-on model returned per-token log-probs, never the [N, V] logits
    assert outputs and all(o.logits is None and o.log_probs is not None for o in outputs)
    assert {"rl_kernel/old_logprob_ms", "rl_kernel/logprob_ms"} <= metrics_on.keys()
    assert any(k.startswith("rl_kernel/backend/linear_logprob/") for k in metrics_on)
    assert metrics_on["rl_kernel/fallback_micro_batches"] == [0.0]
    assert not [k for k in metrics_off if k.startswith("rl_kernel/")]
