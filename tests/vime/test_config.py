"""Parsing of the switches: accepted spellings, defaults, and errors that name the variable."""

import os

import pytest

from rl_kernel_core.switches import SwitchError
from rl_kernel_vime import config


@pytest.mark.parametrize(
    "value, enabled",
    [(None, False), ("", False), ("0", False), ("off", False), ("1", True), ("TRUE", True), (" on ", True)],
)
def test_switch_values(value, enabled):
    env = {} if value is None else {config.SWITCH: value}
    assert config.from_env(env).enabled is enabled


@pytest.mark.parametrize(
    "value, ops",
    [
        (None, set(config.OPS)),
        ("", set(config.OPS)),
        ("all", set(config.OPS)),
        ("none", set()),
        ("logprob", {"logprob"}),
        ("ratio_kl, GRPO_LOSS", {"ratio_kl", "grpo_loss"}),
    ],
)
def test_ops_values(value, ops):
    env = {config.SWITCH: "1"} if value is None else {config.SWITCH: "1", config.OPS_VAR: value}
    assert config.from_env(env).ops == frozenset(ops)


@pytest.mark.parametrize(
    "env, name, value",
    [
        ({config.SWITCH: "yes please"}, config.SWITCH, "yes please"),
        ({config.SWITCH: "1", config.OPS_VAR: "logprob,sampling"}, config.OPS_VAR, "logprob,sampling"),
        ({config.SWITCH: "1", config.STRICT_VAR: "2"}, config.STRICT_VAR, "2"),
    ],
)
def test_invalid_values_name_the_variable(env, name, value):
    with pytest.raises(SwitchError, match=name) as info:
        config.from_env(env)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("master", [None, "", "0", "off", " False "])
def test_master_off_reads_nothing_else(master):
    env = {config.OPS_VAR: "logprob,sampling", config.STRICT_VAR: "2", config.PROFILE_VAR: "x.jsonl"}
    if master is not None:
        env[config.SWITCH] = master
    assert config.from_env(env) == config.OFF


def test_profile_path():
    on = {config.SWITCH: "1"}
    assert config.from_env(on).profile_path is None
    assert config.from_env({**on, config.CORE_PROFILE_VAR: "1"}).profile_path is None
    assert config.from_env({**on, config.CORE_PROFILE_VAR: "false"}).profile_path is None
    assert config.from_env({**on, config.CORE_PROFILE_VAR: "core.jsonl"}).profile_path == "core.jsonl"
    got = config.from_env(
        {**on, config.CORE_PROFILE_VAR: "core.jsonl", config.PROFILE_VAR: "vime.{pid}.jsonl"}
    ).profile_path
    assert got == f"vime.{os.getpid()}.jsonl"
    assert (
        config.from_env({**on, config.CORE_PROFILE_VAR: "core.jsonl", config.PROFILE_VAR: "off"}).profile_path is None
    )


def test_strict():
    assert config.strict_from_env({config.STRICT_VAR: "1"}) and not config.strict_from_env({})
    assert config.settings_from_env({config.STRICT_VAR: " ON "}).strict
    with pytest.raises(SwitchError, match=f"{config.STRICT_VAR} must be one of .*'garbage'"):
        config.strict_from_env({config.STRICT_VAR: "garbage"})
