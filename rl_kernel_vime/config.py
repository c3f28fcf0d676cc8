"""The switches, read from the environment. Standard library only (runs at interpreter start).

Boolean switches go through rl-kernel's one parser (:mod:`rl_kernel_core.switches`: ``1``/``0``,
``true``/``false``, ``yes``/``no``, ``on``/``off``, any case; unset or empty is off).

* ``VIME_RL_KERNEL``: the master switch; on turns the hooks on. While it is off (or unset) no
  other variable below is read, so a malformed one cannot break ``import vime``.
* ``VIME_RL_KERNEL_OPS``: comma- or space-separated subset of :data:`OPS`, ``all`` (the
  default when unset or empty) or ``none`` (no function replaced, only the step timing: the
  baseline for ``rl-kernel compare``).
* ``VIME_RL_KERNEL_STRICT``: on turns every fallback, missing target and signature mismatch
  into an error.
* ``VIME_RL_KERNEL_PROFILE``: JSONL path for the per-step timing records (``{pid}`` is replaced
  by the process id); unset or empty falls back to ``RL_KERNEL_PROFILE``; an on value or neither:
  no file (the timings still reach vime's step metrics); an off value: no file.

Any other value is a :class:`~rl_kernel_core.switches.SwitchError` naming the variable, what it
accepts and what it got.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from rl_kernel_core.adapters import strict_switch
from rl_kernel_core.switches import SwitchError, env_flag, env_flag_or_path

SWITCH = "VIME_RL_KERNEL"
OPS_VAR = "VIME_RL_KERNEL_OPS"
STRICT_VAR = "VIME_RL_KERNEL_STRICT"
PROFILE_VAR = "VIME_RL_KERNEL_PROFILE"
CORE_PROFILE_VAR = "RL_KERNEL_PROFILE"

OPS: tuple[str, ...] = ("logprob", "ratio_kl", "grpo_loss")
"""Selectable ops: ``logprob`` (log-prob + entropy from logits), ``ratio_kl`` (KL estimators),
``grpo_loss`` (the PPO/GRPO policy loss)."""


@dataclass(frozen=True)
class Config:
    """What the switches ask for."""

    enabled: bool
    ops: frozenset[str]
    strict: bool
    profile_path: Optional[str]


OFF = Config(enabled=False, ops=frozenset(), strict=False, profile_path=None)
"""The configuration while ``VIME_RL_KERNEL`` is off (no other variable read)."""


def _ops(environ: Mapping[str, str]) -> frozenset[str]:
    raw = environ.get(OPS_VAR, "").replace(",", " ").lower().split()
    if not raw or raw == ["all"]:
        return frozenset(OPS)
    if raw == ["none"]:
        return frozenset()
    unknown = [name for name in raw if name not in OPS]
    if unknown:
        raise SwitchError(
            f"{OPS_VAR} must list names from {list(OPS)} or be 'all' or 'none', got {environ[OPS_VAR]!r} (unknown: {unknown})"
        )
    return frozenset(raw)


def _profile_path(environ: Mapping[str, str]) -> Optional[str]:
    name = PROFILE_VAR if environ.get(PROFILE_VAR, "").strip() else CORE_PROFILE_VAR
    value = env_flag_or_path(name, environ)
    if isinstance(value, bool):
        return None
    return value.replace("{pid}", str(os.getpid()))


def _env(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def strict_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``VIME_RL_KERNEL_STRICT`` is on in ``environ`` (default ``os.environ``)."""
    return strict_switch(STRICT_VAR, _env(environ))


def settings_from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """The ops, strict and profile switches of ``environ`` (default ``os.environ``), enabled,
    whatever ``VIME_RL_KERNEL`` says (the explicit :func:`rl_kernel_vime.activate` route).

    Raises :class:`~rl_kernel_core.switches.SwitchError`.
    """
    env = _env(environ)
    return Config(enabled=True, ops=_ops(env), strict=strict_from_env(env), profile_path=_profile_path(env))


def from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """The switches of ``environ`` (default ``os.environ``): :data:`OFF` when ``VIME_RL_KERNEL``
    is off (nothing else read), else :func:`settings_from_env`.

    Raises :class:`~rl_kernel_core.switches.SwitchError`.
    """
    env = _env(environ)
    if not env_flag(SWITCH, False, env):
        return OFF
    return settings_from_env(env)
