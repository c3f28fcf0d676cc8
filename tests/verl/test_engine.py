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
from torch.distributed.tensor import DTensor
from verl_cpu import SWITCH_ON, engine_of, infer, policy_inputs, random_rollout, update_actor

from rl_kernel_core.contract import assert_close

FP32 = torch.float32
DEFERRED_SYNC = "actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation=True"
VARIANTS = {
    # verl's FSDP2 keeps a tied head in the root unit
    "fsdp2-tied": ("tied", "actor_rollout_ref.actor.strategy=fsdp2"),
    # ... and wraps an untied head as its own unit, whose weight is a sharded DTensor outside its
    # forward (verl issue 5633); gradient sync deferred across micro-batches (verl issue 7520).
    # (verl's FSDP1 path cannot run on CPU: it syncs module states, which FSDP1 does on GPU only.)
    "fsdp2-untied": ("untied", "actor_rollout_ref.actor.strategy=fsdp2", DEFERRED_SYNC),
    # verl's default layout: sequences packed into one row, labels rolled by verl (shift_labels).
    # sdpa on CPU attends across the packed sequences; both sides run the same backbone, so the
    # comparison still isolates the head and the loss
    "fsdp2-untied-packed": (
        "untied",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.model.use_remove_padding=True",
    ),
}


def _workers(build_worker, variant: str, role: str = "actor"):
    """(off, on): verl workers for ``variant`` built from the same weights, switch off and on."""
    model, *overrides = VARIANTS[variant]
    return build_worker(model, role, *overrides), build_worker(model, role, *overrides, SWITCH_ON)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_old_log_prob_pass_matches_verl(build_worker, seed, variant):
    off, on = _workers(build_worker, variant)
    rollout = random_rollout(torch.Generator().manual_seed(seed))
    temperature = float(torch.empty(()).uniform_(0.5, 1.5))

    outputs = []
    hook = engine_of(on).module.register_forward_hook(lambda mod, args, out: outputs.append(out))
    try:
        lp_on, ent_on, metrics_on = infer(on, rollout, temperature)
    finally:
        hook.remove()
    lp_off, ent_off, metrics_off = infer(off, rollout, temperature)

    assert_close(lp_on, lp_off, "logprob", FP32, name="log_probs")
    assert_close(ent_on, ent_off, "logprob", FP32, name="entropy")
    # the switched-on model returned per-token log-probs, never the [N, V] logits
    assert outputs and all(o.logits is None and o.log_probs is not None for o in outputs)
    if variant == "fsdp2-untied":  # the case verl issue 5633 is about: the head's weight is a shard
        assert isinstance(engine_of(on).module.lm_head.weight, DTensor)
    assert {"rl_kernel/old_logprob_ms", "rl_kernel/logprob_ms"} <= metrics_on.keys()
    assert any(k.startswith("rl_kernel/backend/linear_logprob/") for k in metrics_on)
    assert metrics_on["rl_kernel/fallback_micro_batches"] == [0.0]
    assert not [k for k in metrics_off if k.startswith("rl_kernel/")]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_actor_update_matches_verl(build_worker, seed, variant):
    """Loss, every loss metric, grad norm and every parameter's gradient after ``update_actor``."""
    off, on = _workers(build_worker, variant)
    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(g)
    temperature = float(torch.empty(()).uniform_(0.5, 1.5, generator=g))
    per_token = policy_inputs(off, rollout, temperature, g)

    metrics_on, grads_on = update_actor(on, rollout, per_token, temperature)
    metrics_off, grads_off = update_actor(off, rollout, per_token, temperature)

    compared = [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/entropy_loss",
        "kl_loss",
        "kl_coef",
        "loss",
        "grad_norm",
    ]
    assert set(compared) <= metrics_off.keys() and set(compared) <= metrics_on.keys()
    for key in compared:
        assert_close(
            torch.tensor(metrics_on[key], dtype=torch.float64),
            torch.tensor(metrics_off[key], dtype=torch.float64),
            "reduction",
            FP32,
            name=key,
        )
    assert metrics_off["actor/pg_clipfrac"][0] > 0 and metrics_off["actor/pg_clipfrac_lower"][0] > 0
    assert grads_on.keys() == grads_off.keys()
    for name in grads_off:
        assert_close(grads_on[name], grads_off[name], "gradient", FP32, name=f"grad {name}")
    assert {"rl_kernel/logprob_ms", "rl_kernel/loss_ms"} <= metrics_on.keys()
    assert any(k.startswith("rl_kernel/backend/policy_loss/") for k in metrics_on)
    assert not [k for k in metrics_off if k.startswith("rl_kernel/")]


def test_ref_log_prob_pass_matches_verl(build_worker, seed):
    off, on = _workers(build_worker, "fsdp2-untied", role="ref")
    rollout = random_rollout(torch.Generator().manual_seed(seed))
    lp_on, _, metrics_on = infer(on, rollout, 1.0, ref=True)
    lp_off, _, metrics_off = infer(off, rollout, 1.0, ref=True)
    assert_close(lp_on, lp_off, "logprob", FP32, name="ref log_probs")
    assert {"rl_kernel/ref_logprob_ms", "rl_kernel/logprob_ms"} <= metrics_on.keys()
    assert not [k for k in metrics_off if k.startswith("rl_kernel/")]


def test_switch_off_leaves_verl_untouched(build_worker, model_dirs, seed):
    """With the switch off: no hook on the engine or its model; the worker keeps verl's loss; and
    its results are bitwise those of a worker built with the plugin's probe taken out."""
    import rl_kernel_verl
    import verl_cpu
    from transformers import Qwen2ForCausalLM
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils import losses

    from rl_kernel_core import adapters
    from rl_kernel_verl import targets

    off, on = _workers(build_worker, "fsdp2-untied")
    rollout = random_rollout(torch.Generator().manual_seed(seed))
    lp_off, ent_off, _ = infer(off, rollout, 0.8)
    rl_kernel_verl.restore()  # the probe taken out: verl's own factory
    try:
        assert not adapters.is_patched(vars(EngineRegistry)["new"])
        model, *overrides = VARIANTS["fsdp2-untied"]
        plain = verl_cpu.build_worker(model_dirs[model], "actor", *overrides)
    finally:
        rl_kernel_verl.register()
    lp_plain, ent_plain, _ = infer(plain, rollout, 0.8)
    assert torch.equal(lp_off, lp_plain) and torch.equal(ent_off, ent_plain)
    engine = engine_of(off)
    hooked = set(targets.ENGINE_METHODS) | {"_rl_kernel"}
    assert not hooked & vars(engine).keys()
    assert "forward" not in vars(engine.module) and "forward" not in vars(engine.module.lm_head)
    assert type(engine.module).forward is Qwen2ForCausalLM.forward
    assert off.actor.loss_fn.func is losses.ppo_loss
    # verl's classes are never modified, switch on or off: no method carries a wrapper
    for name in targets.ENGINE_METHODS + ("prepare_model_outputs",):
        assert not hasattr(getattr(FSDPEngineWithLMHead, name), "__wrapped__"), name
    # the one wrapper in verl is the probe; it returns verl's factory's engine as built
    new = vars(EngineRegistry)["new"]
    assert adapters.is_patched(new) and not adapters.is_patched(getattr(new, adapters.ORIGINAL_ATTR))
    assert type(engine) is FSDPEngineWithLMHead
    listed = {e["engine"] for e in rl_kernel_verl.status()["engines"]}
    assert f"FSDPEngineWithLMHead@{id(engine):#x}" not in listed
    assert f"FSDPEngineWithLMHead@{id(engine_of(on)):#x}" in listed
    assert hooked <= vars(engine_of(on)).keys()


def test_status_reports_live_hooks(build_worker, seed):
    import rl_kernel_verl

    _, on = _workers(build_worker, "fsdp2-tied")
    infer(on, random_rollout(torch.Generator().manual_seed(seed)), 1.0)
    status = rl_kernel_verl.status()
    assert status["probe"] == "live"
    (entry,) = [e for e in status["engines"] if e["engine"] == f"FSDPEngineWithLMHead@{id(engine_of(on)):#x}"]
    assert entry["role"] == "actor" and entry["forward"] == "live"
    assert set(entry["hooks"].values()) == {"live"}
    assert entry["micro_batches_served"] > 0 and entry["micro_batches_on_verl_path"] == {}


def test_per_sample_temperature_runs_verls_path(build_worker, seed):
    """A micro-batch the adapter does not serve runs verl's own code (bitwise), counted in the metrics."""
    off, on = _workers(build_worker, "fsdp2-tied")
    rollout = random_rollout(torch.Generator().manual_seed(seed))
    rollout["temperature"] = torch.empty(rollout["input_ids"].shape[0]).uniform_(0.5, 1.5)
    lp_on, ent_on, metrics_on = infer(on, rollout, None)
    lp_off, ent_off, _ = infer(off, rollout, None)
    assert torch.equal(lp_on, lp_off) and torch.equal(ent_on, ent_off)
    assert metrics_on["rl_kernel/fallback_micro_batches"] == [2.0]


def test_strict_mode_refuses_the_fallback(build_worker, seed):
    model, *overrides = VARIANTS["fsdp2-tied"]
    strict = build_worker(
        model, "actor", *overrides, SWITCH_ON, "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_strict=True"
    )
    rollout = random_rollout(torch.Generator().manual_seed(seed))
    rollout["temperature"] = torch.empty(rollout["input_ids"].shape[0]).uniform_(0.5, 1.5)
    with pytest.raises(RuntimeError, match="strict.*per-sample temperature"):
        infer(strict, rollout, None)


def test_bf16_autocast_head_within_contract(build_worker, seed):
    """verl's bf16 mixed precision (FSDP2 bf16 params, CPU autocast): the rl-kernel head takes the
    bf16 operands verl's logits path would, and its log-probs/entropies meet the bf16 contract
    against an fp64 reference on those same operands (fp32 accumulation survives autocast)."""
    model, *overrides = VARIANTS["fsdp2-untied"]
    bf16 = "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}"
    on = build_worker(model, "actor", *overrides, bf16, SWITCH_ON)
    head = engine_of(on).module.lm_head
    seen = []

    def record(mod, args, out):
        hidden, labels, temperature, _ = args
        # FSDP2 stores the shard in fp32 and computes with its bf16 cast (param_dtype)
        seen.append((hidden.detach(), labels, temperature, mod.weight.full_tensor().detach().to(torch.bfloat16), out))

    hook = head.register_forward_hook(record)
    try:
        infer(on, random_rollout(torch.Generator().manual_seed(seed)), 0.9)
    finally:
        hook.remove()
    assert seen
    for hidden, labels, temperature, weight, (log_probs, entropy) in seen:
        assert hidden.dtype == weight.dtype == torch.bfloat16 and log_probs.dtype == torch.float32
        logp = torch.log_softmax(hidden.double() @ weight.double().T / temperature, dim=-1)
        assert_close(
            log_probs, logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), "logprob", torch.bfloat16, name="log_probs"
        )
        assert_close(entropy, -(logp.exp() * logp).sum(-1), "logprob", torch.bfloat16, name="entropy")
