"""The switches, read from the environment. Standard library only (runs at interpreter start).

* ``VIME_RL_KERNEL``: ``1`` (also ``true``/``yes``/``on``) turns the hooks on; unset, empty,
  ``0``/``false``/``no``/``off`` leave vime untouched.
* ``VIME_RL_KERNEL_OPS``: comma- or space-separated subset of :data:`OPS`, ``all`` (the
  default when unset or empty) or ``none`` (no function replaced, only the step timing: the
  baseline for ``rl-kernel compare``).
* ``VIME_RL_KERNEL_STRICT``: ``1`` turns every fallback, missing target and signature mismatch
  into an error.
* ``VIME_RL_KERNEL_PROFILE``: JSONL path for the per-step timing records (``{pid}`` is replaced
  by the process id); unset falls back to ``RL_KERNEL_PROFILE``; neither: no file (the timings
  still reach vime's step metrics).

Any other value is a :class:`ConfigError` naming the variable, what it accepts and what it got.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

SWITCH = "VIME_RL_KERNEL"
OPS_VAR = "VIME_RL_KERNEL_OPS"
STRICT_VAR = "VIME_RL_KERNEL_STRICT"
PROFILE_VAR = "VIME_RL_KERNEL_PROFILE"
CORE_PROFILE_VAR = "RL_KERNEL_PROFILE"

OPS: tuple[str, ...] = ("logprob", "ratio_kl", "grpo_loss")
"""Selectable ops: ``logprob`` (log-prob + entropy from logits), ``ratio_kl`` (KL estimators),
``grpo_loss`` (the PPO/GRPO policy loss)."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class ConfigError(ValueError):
    """A switch holds a value it does not accept."""


@dataclass(frozen=True)
class Config:
    """What the switches ask for."""

    enabled: bool
    ops: frozenset[str]
    strict: bool
    profile_path: Optional[str]


def _flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name} must be one of {list(_TRUE + _FALSE[1:])} (or unset), got {environ[name]!r}")


def _ops(environ: Mapping[str, str]) -> frozenset[str]:
    raw = environ.get(OPS_VAR, "").replace(",", " ").lower().split()
    if not raw or raw == ["all"]:
        return frozenset(OPS)
    if raw == ["none"]:
        return frozenset()
    unknown = [name for name in raw if name not in OPS]
    if unknown:
        raise ConfigError(f"{OPS_VAR} must list names from {list(OPS)} or be 'all' or 'none', got {environ[OPS_VAR]!r} (unknown: {unknown})")
    return frozenset(raw)


def _profile_path(environ: Mapping[str, str]) -> Optional[str]:
    value = environ.get(PROFILE_VAR) or environ.get(CORE_PROFILE_VAR)
    if not value or value == "1":
        return None
    return value.replace("{pid}", str(os.getpid()))


def strict_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``VIME_RL_KERNEL_STRICT`` is on in ``environ`` (default ``os.environ``)."""
    return _flag(os.environ if environ is None else environ, STRICT_VAR)


def from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Parse the switches from ``environ`` (default ``os.environ``); raises :class:`ConfigError`."""
    env = os.environ if environ is None else environ
    return Config(enabled=_flag(env, SWITCH), ops=_ops(env), strict=_flag(env, STRICT_VAR), profile_path=_profile_path(env))
