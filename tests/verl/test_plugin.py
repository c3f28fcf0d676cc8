"""Loading by verl, the switch as verl's Hydra config carries it, typo warnings, missing targets."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types

import pytest
from verl_cpu import LOADED_BY_VERL, SWITCH_ON, compose_config


def test_verl_loads_the_plugin_on_import():
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.name == "rl_kernel"]
    assert ep.value == "rl_kernel_verl:register"
    assert LOADED_BY_VERL  # `import verl` imported rl_kernel_verl before this test module did


def test_register_is_idempotent():
    import rl_kernel_verl
    from rl_kernel_core import adapters
    from verl.workers.engine.base import EngineRegistry

    rl_kernel_verl.register()
    wrapped = vars(EngineRegistry)["new"]
    rl_kernel_verl.register()
    assert vars(EngineRegistry)["new"] is wrapped
    original = getattr(wrapped, adapters.ORIGINAL_ATTR)
    assert isinstance(original, classmethod) and not adapters.is_patched(original)
    assert original.__func__.__code__.co_filename.endswith("verl/workers/engine/base.py")
    assert not [f for f in sys.meta_path if isinstance(f, adapters.ImportHook)]  # it fired and stepped out
    assert rl_kernel_verl.status()["probe"] == "live"


def test_restore_puts_verls_factory_back():
    import rl_kernel_verl
    from rl_kernel_core import adapters
    from verl.workers.engine.base import EngineRegistry

    wrapped = vars(EngineRegistry)["new"]
    original = getattr(wrapped, adapters.ORIGINAL_ATTR)
    rl_kernel_verl.restore()
    try:
        assert vars(EngineRegistry)["new"] is original
        assert rl_kernel_verl.status()["probe"] == "not armed"
    finally:
        rl_kernel_verl.register()
    assert adapters.is_patched(vars(EngineRegistry)["new"]) and rl_kernel_verl.status()["probe"] == "live"


def test_restore_removes_a_pending_import_hook(monkeypatch):
    """Armed before verl's engine module is imported: restore() takes the import hook off sys.meta_path."""
    from rl_kernel_core import adapters
    from rl_kernel_verl import probe

    probe.disarm()
    monkeypatch.setattr(probe, "_MODULE", "verl.no_such_engine_module")
    try:
        probe.arm()
        assert [
            f for f in sys.meta_path if isinstance(f, adapters.ImportHook) and "verl.no_such_engine_module" in f.modules
        ]
        probe.disarm()
        assert not [f for f in sys.meta_path if isinstance(f, adapters.ImportHook)]
    finally:
        monkeypatch.undo()
        probe.arm()  # verl's module is loaded: the probe wraps the factory again at once
    assert probe.status()["probe"] == "live"


def _model_config(model_dirs, *overrides):
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(compose_config(model_dirs["tied"], *overrides).actor_rollout_ref.model)


def test_switch_read_from_verls_model_config(model_dirs, caplog):
    from rl_kernel_verl import switch

    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        assert switch.read(_model_config(model_dirs, SWITCH_ON)).on
        off = switch.read(_model_config(model_dirs))
    assert not off.on and not off.strict
    assert not caplog.records
    strict = switch.read(
        _model_config(model_dirs, SWITCH_ON, "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_strict=True")
    )
    assert strict.on and strict.strict


def test_batch_invariant_option_turns_the_backend_on(model_dirs, caplog):
    from rl_kernel_verl import switch

    option = switch.BATCH_INVARIANT_OVERRIDE
    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        assert switch.read(_model_config(model_dirs, option)) == switch.Switch(
            on=True, strict=False, batch_invariant=True
        )
        assert switch.read(_model_config(model_dirs, option, SWITCH_ON)).batch_invariant
        assert not switch.read(_model_config(model_dirs, SWITCH_ON)).batch_invariant
    assert not caplog.records
    with pytest.raises(
        ValueError,
        match="rl_kernel_batch_invariant=True runs the rl-kernel backend, but use_rl_kernel_backend=False turns it off",
    ):
        switch.read(
            _model_config(
                model_dirs, option, "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=False"
            )
        )
    with pytest.raises(ValueError, match="rl_kernel_batch_invariant must be true or false, got 'on'"):
        switch.read(
            _model_config(model_dirs, "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariant=on")
        )


def test_batch_invariant_lookalike_names_the_option(model_dirs, caplog):
    from rl_kernel_verl import switch

    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        sw = switch.read(
            _model_config(
                model_dirs, SWITCH_ON, "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariance=True"
            )
        )
    assert sw.on and not sw.batch_invariant
    (message,) = [r.getMessage() for r in caplog.records]
    assert "did you mean rl_kernel_batch_invariant?" in message and switch.BATCH_INVARIANT_OVERRIDE in message


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel=True",
            "fused_kernel_options.use_rl_kernel is not a key",
        ),
        (
            "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernels_backend=True",
            "did you mean use_rl_kernel_backend",
        ),
        ("+actor_rollout_ref.model.fused_kernel_options.rl_kernel=True", "the rl-kernel backend is OFF"),
        ("+actor_rollout_ref.model.override_config.use_rl_kernel_backend=True", "was put in override_config"),
    ],
)
def test_lookalike_keys_warn_loudly_and_leave_it_off(model_dirs, caplog, override, says):
    from rl_kernel_verl import switch

    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        assert not switch.read(_model_config(model_dirs, override)).on
    assert any(says in r.getMessage() and switch.OVERRIDE in r.getMessage() for r in caplog.records)


def test_strict_environment_value_is_parsed_only_with_the_switch_on(model_dirs, monkeypatch):
    from rl_kernel_core.switches import SwitchError
    from rl_kernel_verl import switch

    monkeypatch.setenv("RL_KERNEL_VERL_STRICT", "garbage")
    assert switch.read(_model_config(model_dirs)) == switch.Switch(on=False, strict=False)
    with pytest.raises(SwitchError, match="RL_KERNEL_VERL_STRICT must be one of .*'garbage'"):
        switch.read(_model_config(model_dirs, SWITCH_ON))
    monkeypatch.setenv("RL_KERNEL_VERL_STRICT", " Yes ")
    assert switch.read(_model_config(model_dirs, SWITCH_ON)).strict


def test_non_boolean_switch_is_an_error(model_dirs):
    from rl_kernel_verl import switch

    with pytest.raises(ValueError, match="use_rl_kernel_backend must be true or false, got 'yes'"):
        switch.read(
            _model_config(model_dirs, "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=yes")
        )


@pytest.mark.parametrize("options", ["use_rl_kernel_backend=True", ["use_rl_kernel_backend"], 1, True])
def test_fused_kernel_options_that_are_not_a_mapping_are_an_error(options):
    """A string or a list where verl keeps a dict: one line naming the key, the value and its type
    (it was a raw TypeError, or a string searched for the switch by substring)."""
    from rl_kernel_verl import switch

    for config in ({"fused_kernel_options": options}, types.SimpleNamespace(fused_kernel_options=options)):
        with pytest.raises(ValueError) as info:
            switch.read(config)
        message = str(info.value)
        assert message.startswith(
            "actor_rollout_ref.model.fused_kernel_options must be a mapping of option names to values"
        )
        assert message.endswith(f"got {options!r} ({type(options).__name__})") and "\n" not in message, message
    assert switch.read({"fused_kernel_options": None}) == switch.Switch(on=False, strict=False)


def test_bad_option_shapes_through_verls_config(model_dirs):
    """As Hydra composes them: ``rl_kernel_row_parallel_split=2.0`` (a float, which passed and then
    failed the first forward slicing with it) and ``fused_kernel_options=abc`` (a string)."""
    from rl_kernel_verl import switch

    split = (
        "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariant=True",
        "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_row_parallel_split=2.0",
    )
    with pytest.raises(ValueError, match=r"rl_kernel_row_parallel_split must be an integer >= 1 .* got 2.0 \(float\)$"):
        switch.read(_model_config(model_dirs, *split))
    with pytest.raises(
        ValueError, match=r"^actor_rollout_ref.model.fused_kernel_options must be a mapping .* got 'abc' \(str\)$"
    ):
        switch.read(_model_config(model_dirs, "actor_rollout_ref.model.fused_kernel_options=abc"))


def test_a_huge_option_value_is_shown_by_its_start_and_length():
    from rl_kernel_verl import switch

    with pytest.raises(ValueError) as info:
        switch.read({"fused_kernel_options": {"use_rl_kernel_backend": "y" * (1 << 20)}})
    assert len(str(info.value)) < 300 and "... (1048578 chars)" in str(info.value), str(info.value)[:400]


@pytest.mark.parametrize("node", ["actor", "model"])
def test_switch_on_a_dataclass_node_is_rejected_by_verl(model_dirs, node):
    """``+actor_rollout_ref.{actor,model}.use_rl_kernel_backend`` composes, but verl's config
    dataclasses reject the key when the worker builds its config: loud, never silently off."""
    from verl.utils.config import omega_conf_to_dataclass

    config = compose_config(model_dirs["tied"], f"+actor_rollout_ref.{node}.use_rl_kernel_backend=True")
    with pytest.raises(Exception, match="use_rl_kernel_backend"):
        omega_conf_to_dataclass(config.actor_rollout_ref[node])


def test_missing_target_is_a_logged_no_op_or_a_strict_error(monkeypatch, caplog):
    from rl_kernel_core import adapters
    from rl_kernel_verl import engine, targets

    monkeypatch.setattr(targets, "ENGINE_CLASS", "verl.workers.engine.fsdp.transformer_impl:NoSuchEngine")
    stand_in = types.SimpleNamespace(model_config=None, engine_config=None)
    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        assert engine.install(stand_in, strict=False) is False
    assert any(
        "has no attribute 'NoSuchEngine'" in r.getMessage() and "verl's own path" in r.getMessage()
        for r in caplog.records
    )
    assert not vars(stand_in).keys() - {"model_config", "engine_config"}
    with pytest.raises(adapters.TargetMissing, match="NoSuchEngine"):
        engine.install(stand_in, strict=True)


def test_engine_rl_kernel_cannot_serve_stays_on_verl(caplog):
    from rl_kernel_verl import engine

    stand_in = types.SimpleNamespace(model_config=types.SimpleNamespace(model_type="language_model"))
    with caplog.at_level(logging.WARNING, logger="rl_kernel.verl"):
        assert engine.install(stand_in, strict=False) is False
    assert any("is not an FSDPEngineWithLMHead" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="strict.*is not an FSDPEngineWithLMHead"):
        engine.install(stand_in, strict=True)
