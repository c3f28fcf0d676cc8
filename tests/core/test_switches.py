"""The one boolean parser of environment switches: spellings, defaults, errors, master-first reading."""

from collections.abc import Mapping

import pytest

from rl_kernel_core.switches import (
    SHOWN_CHARS,
    SwitchError,
    env_flag,
    env_flag_or_path,
    env_switch_family,
    parse_flag,
    show_value,
)


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "True", "yes", "Yes", "on", "ON", " on ", "\t1\n"])
def test_on_spellings(raw):
    assert parse_flag("X", raw) is True
    assert env_flag("X", False, {"X": raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "no", "No", "off", "Off", " off ", "\t0\n"])
def test_off_spellings(raw):
    assert parse_flag("X", raw) is False
    assert env_flag("X", True, {"X": raw}) is False


@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("environ", [{}, {"X": ""}, {"X": "   "}])
def test_unset_or_empty_is_the_default(environ, default):
    assert env_flag("X", default, environ) is default


@pytest.mark.parametrize("raw", ["ture", "2", "garbage", "y", "n", "enable", "1.0", "-1", "onn"])
def test_anything_else_names_the_variable_and_the_value(raw):
    with pytest.raises(SwitchError) as info:
        env_flag("RL_KERNEL_SOMETHING", False, {"RL_KERNEL_SOMETHING": raw})
    message = str(info.value)
    assert message.startswith("RL_KERNEL_SOMETHING must be one of 1/0, true/false, yes/no, on/off")
    assert message.endswith(f"got {raw!r}")
    assert isinstance(info.value, ValueError)


class _Recording(Mapping):
    """An environment that records which variables were looked up."""

    def __init__(self, values):
        self.data = dict(values)
        self.read = []

    def __getitem__(self, key):
        self.read.append(key)
        return self.data[key]

    def get(self, key, default=None):
        self.read.append(key)
        return self.data.get(key, default)

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


MEMBERS = {"a": ("FAM_A", True), "b": ("FAM_B", False)}


@pytest.mark.parametrize("master", [None, "", "0", "off", "No"])
def test_family_with_the_master_off_reads_no_member(master):
    env = _Recording({"FAM_A": "ture", "FAM_B": "garbage", **({} if master is None else {"FAM": master})})
    assert env_switch_family("FAM", MEMBERS, env) is None
    assert env.read == ["FAM"]


def test_family_with_the_master_on_reads_every_member():
    assert env_switch_family("FAM", MEMBERS, {"FAM": "on"}) == {"a": True, "b": False}
    assert env_switch_family("FAM", MEMBERS, {"FAM": "1", "FAM_A": "no", "FAM_B": "YES"}) == {"a": False, "b": True}
    with pytest.raises(SwitchError, match="FAM_B must be one of .*'ture'"):
        env_switch_family("FAM", MEMBERS, {"FAM": "1", "FAM_B": "ture"})
    with pytest.raises(SwitchError, match="FAM must be one of .*'ture'"):
        env_switch_family("FAM", MEMBERS, {"FAM": "ture", "FAM_B": "1"})


@pytest.mark.parametrize(
    "raw, expected",
    [
        (None, False),
        ("", False),
        ("0", False),
        ("false", False),
        ("OFF", False),
        ("no", False),
        ("1", True),
        ("true", True),
        ("on", True),
        ("steps.jsonl", "steps.jsonl"),
        (" /tmp/x/steps.jsonl ", "/tmp/x/steps.jsonl"),
    ],
)
def test_flag_or_path(raw, expected):
    env = {} if raw is None else {"RL_KERNEL_PROFILE": raw}
    assert env_flag_or_path("RL_KERNEL_PROFILE", env) == expected


def test_a_huge_value_is_shown_by_its_start_and_length():
    raw = "x" * (1 << 20)
    with pytest.raises(SwitchError) as info:
        env_flag("RL_KERNEL_SOMETHING", False, {"RL_KERNEL_SOMETHING": raw})
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, len(message)
    assert message.endswith(f"got {'x' * SHOWN_CHARS!r}... (1048576 chars)")
    assert show_value("y" * SHOWN_CHARS) == repr("y" * SHOWN_CHARS)  # up to the limit: whole
    assert show_value("a\nb" * 100, quote=False) == ("a\nb" * 100)[:SHOWN_CHARS] + "... (300 chars)"


def test_a_huge_backend_name_is_shown_by_its_start_and_length(monkeypatch):
    from rl_kernel_core import dispatch

    monkeypatch.setenv("RL_KERNEL_BACKEND", "z" * (1 << 20))
    with pytest.raises(ValueError) as info:
        dispatch.default_backend()
    assert len(str(info.value)) < 300 and str(info.value).endswith("... (1048576 chars)"), str(info.value)[:400]
