"""The weight-sync check (``rl_kernel_weight_check_every``): the option as verl's config carries
it, what an armed process hooks and refuses, and one checked sync driven through the hook with a
stand-in vLLM worker (fp32 trainer tensors, a bf16 engine; the real engine runs in the
recipe-verl tier's ``main_ppo`` runs)."""

from __future__ import annotations

import asyncio
import logging
import types

import pytest
import torch
from verl_cpu import SWITCH_ON, compose_config

EVERY = "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_weight_check_every"


def _configs(model_dirs, *overrides):
    from verl.utils.config import omega_conf_to_dataclass

    tp = (
        []
        if any("tensor_model_parallel_size" in o for o in overrides)
        else ["actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    )
    config = compose_config(
        model_dirs["tied"], "actor_rollout_ref.rollout.name=vllm", *tp, *overrides
    ).actor_rollout_ref
    return omega_conf_to_dataclass(config.model), omega_conf_to_dataclass(config.rollout)


def test_option_is_read_whatever_the_backend_switch(model_dirs, caplog):
    from rl_kernel_verl import switch

    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        assert switch.read(_configs(model_dirs, f"{EVERY}=3")[0]) == switch.Switch(
            on=False, strict=False, weight_check_every=3
        )
        on = switch.read(_configs(model_dirs, f"{EVERY}=2", SWITCH_ON)[0])
        assert on.on and on.weight_check_every == 2
        assert switch.read(_configs(model_dirs, f"{EVERY}=0")[0]).weight_check_every == 0
        assert switch.read(_configs(model_dirs)[0]).weight_check_every == 0
    assert not caplog.records
    for value, shown in (("-1", r"-1 \(int\)"), ("True", r"True \(bool\)"), ("two", r"'two' \(str\)")):
        with pytest.raises(
            ValueError, match=rf"rl_kernel_weight_check_every must be an integer >= 0 \(0: off\), got {shown}"
        ):
            switch.read(_configs(model_dirs, f"{EVERY}={value}")[0])
    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        assert not switch.read(
            _configs(model_dirs, "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_weight_check=1")[0]
        ).weight_check_every
    (message,) = [r.getMessage() for r in caplog.records]
    assert "did you mean rl_kernel_weight_check_every?" in message and switch.WEIGHT_CHECK_OVERRIDE in message


def _engine(model_config, forward_only=False):
    calls = []

    def train_batch(data, loss_function):
        calls.append(data)
        return {"metrics": {}}

    return types.SimpleNamespace(
        model_config=model_config,
        engine_config=types.SimpleNamespace(forward_only=forward_only),
        train_batch=train_batch,
        calls=calls,
    )


def test_off_or_a_reference_engine_arms_nothing(model_dirs):
    from verl.workers.rollout.base import BaseRollout

    from rl_kernel_core import adapters
    from rl_kernel_verl import probe, weight_check

    model_config, _ = _configs(model_dirs)
    engine = _engine(model_config)
    probe._engine_created(engine)
    ref = _engine(_configs(model_dirs, f"{EVERY}=1")[0], forward_only=True)
    probe._engine_created(ref)
    assert weight_check.status() is None and not adapters.is_patched(vars(BaseRollout)["__init__"])
    assert "train_batch" in vars(engine) and engine.train_batch.__qualname__.endswith("_engine.<locals>.train_batch")


def _other_rollout():
    from verl.workers.rollout.base import BaseRollout

    class OtherRollout(BaseRollout):
        async def resume(self, tags):
            pass

        async def update_weights(self, weights, wire_format="named_tensors", **kwargs):
            pass

        async def release(self):
            pass

    return OtherRollout


def test_armed_process_refuses_what_it_cannot_check(model_dirs, monkeypatch):
    from verl.workers.rollout.base import BaseRollout

    from rl_kernel_core import adapters
    from rl_kernel_verl import probe, weight_check

    monkeypatch.setenv(weight_check.INSECURE_ENV, "1")
    on_config, rollout_config = _configs(model_dirs, f"{EVERY}=2")
    engine = _engine(on_config)
    probe._engine_created(engine)
    try:
        status = weight_check.status()
        assert adapters.is_patched(vars(BaseRollout)["__init__"]) and status is not None and status["every"] == 2
        with pytest.raises(RuntimeError, match="rl_kernel_weight_check_every=2 is set but no vLLM rollout was built"):
            engine.train_batch({"x": 1}, None)
        assert engine.calls == []  # refused before verl's update ran
        other = _other_rollout()
        with pytest.raises(
            ValueError,
            match=r"rl_kernel_weight_check_every=2: the rollout is .*OtherRollout "
            r"\(rollout.name='vllm'\); the check covers verl.workers.rollout",
        ):
            other(config=rollout_config, model_config=on_config, device_mesh=None)
        plain = other(config=rollout_config, model_config=_configs(model_dirs)[0], device_mesh=None)
        assert "update_weights" not in vars(plain)  # a rollout whose config does not ask is left alone
        with pytest.raises(
            ValueError, match="rl_kernel_weight_check_every=3, but an engine of this process asked for 2"
        ):
            weight_check.arm(_engine(on_config), 3)
    finally:
        weight_check.disarm()
    assert not adapters.is_patched(vars(BaseRollout)["__init__"]) and weight_check.status() is None


@pytest.mark.parametrize(
    "setting, says",
    [
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "one vLLM worker, got rollout.tensor_model_parallel_size=2",
        ),
        ("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "rollout.checkpoint_engine.backend='nccl'"),
        (None, "VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the rollout's environment, got '0'"),
    ],
)
def test_refusals_name_the_setting(model_dirs, monkeypatch, setting, says):
    from rl_kernel_verl import targets, weight_check

    if setting is not None:
        monkeypatch.setenv(weight_check.INSECURE_ENV, "1")
    else:
        monkeypatch.delenv(weight_check.INSECURE_ENV, raising=False)
    _, rollout_config = _configs(model_dirs, *filter(None, [setting]))
    vllm_kind = type("ServerAdapter", (), {"__module__": targets.VLLM_ROLLOUT.partition(":")[0]})
    rollout = vllm_kind()
    rollout.config = rollout_config
    reason = weight_check._refusal(rollout)
    assert reason is not None and says in reason


class _Worker:
    """A stand-in vLLM worker: ``model_runner.get_model()`` is a module holding vLLM's parameter names."""

    def __init__(self, params: dict[str, torch.Tensor]):
        model = torch.nn.Module()
        for name, value in params.items():
            *path, leaf = name.split(".")
            owner = model
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
        self.model = model
        self.model_runner = types.SimpleNamespace(get_model=lambda: model)


class _Rollout:
    """verl's ``ServerAdapter`` seen from the hook: ``_execute_method`` runs the function in the worker."""

    def __init__(self, worker: _Worker):
        self.worker = worker

    async def _execute_method(self, method, non_block=False, timeout=None, args=(), kwargs=None):
        return method(self.worker, *args, **(kwargs or {}))


def test_checked_sync_compares_trainer_bits_rounded_to_the_engine_dtype(seed, caplog):
    from rl_kernel_core.digest import named_digests
    from rl_kernel_vllm import weights
    from rl_kernel_verl import weight_check

    gen = torch.Generator().manual_seed(seed)
    trainer = {
        name: torch.randn(rows, 8, generator=gen)
        for name, rows in (
            ("model.layers.0.self_attn.q_proj.weight", 8),
            ("model.layers.0.self_attn.k_proj.weight", 4),
            ("model.layers.0.self_attn.v_proj.weight", 4),
            ("model.layers.0.mlp.down_proj.weight", 8),
        )
    }
    trainer["model.norm.weight"] = torch.randn(8, generator=gen)
    engine_shapes = {
        "model.layers.0.self_attn.qkv_proj.weight": (16, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 8),
        "model.norm.weight": (8,),
    }
    worker = _Worker({name: torch.randn(*shape, generator=gen).bfloat16() for name, shape in engine_shapes.items()})
    rollout = _Rollout(worker)
    flip = {"sync": None}

    async def load(weights_stream, global_steps=None, wire_format="named_tensors", **kwargs):
        """vLLM's loading as ``copy_`` into the fused bf16 parameters (rounding to nearest even)."""
        engine = dict(worker.model.named_parameters())
        offsets = {"q_proj": 0, "k_proj": 8, "v_proj": 12}
        for name, tensor in weights_stream:
            target = weights.engine_name(name)
            block = next((b for b in offsets if f".{b}." in name), None)
            rows = slice(offsets[block], offsets[block] + tensor.shape[0]) if block else slice(None)
            engine[target].data[rows].copy_(tensor)
        if flip["sync"] == global_steps:
            engine["model.layers.0.mlp.down_proj.weight"].data.view(torch.int16)[5, 1] ^= 1

    state = weight_check.CheckState(every=2)
    sync = weight_check._hook_update_weights(state, rollout, load)
    with caplog.at_level(logging.INFO, logger="rl_kernel.verl"):
        asyncio.run(sync(iter(trainer.items()), global_steps=0))
    assert state.last is not None and state.last["rl_kernel/weight_bits_differ"] == 0.0 and state.checks == 1
    assert state.engine_dtypes is not None and state.engine_dtypes["model.norm.weight"] == torch.bfloat16
    assert "0 of 5 parameters differ" in caplog.text
    asyncio.run(sync(iter(trainer.items()), global_steps=1))  # sync 1 of every 2: not checked
    assert state.last is None and state.checks == 1 and state.syncs == 2
    flip["sync"] = 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        asyncio.run(sync(iter(trainer.items()), global_steps=2))
    assert state.last["rl_kernel/weight_bits_differ"] == 1.0 and state.last["rl_kernel/weight_checks"] == 2.0
    assert "model.layers.0.mlp.down_proj.weight: bits differ (first at row 5)" in caplog.text
    # without rounding to the engine's dtype every parameter would differ: the bits are bf16's
    assert len(weights.compare(named_digests(trainer.items()), weights.engine_digests(worker))) == 3
    asyncio.run(sync(iter(trainer.items()), global_steps=3))
    with pytest.raises(ValueError, match="this weight sync sends a LoRA adapter"):
        asyncio.run(sync(iter(trainer.items()), global_steps=4, peft_config={"r": 8}))
