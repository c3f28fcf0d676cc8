"""Boolean environment switches: the one parser every rl-kernel variable goes through.

Standard library only. Accepted spellings, compared after stripping surrounding whitespace and
ignoring case: ``1``/``true``/``yes``/``on`` (on) and ``0``/``false``/``no``/``off`` (off). An
unset or empty (whitespace-only) variable takes the switch's default. Anything else raises
:class:`SwitchError` naming the variable, the accepted spellings and the value found (a value longer
than :data:`SHOWN_CHARS` characters is shown by its start and its length: :func:`show_value`).

A family of switches with a master switch (``RL_KERNEL_VLLM`` and its ``RL_KERNEL_VLLM_*``) is
read by :func:`env_switch_family`: while the master is off, the others are never parsed, so a
malformed sub-switch cannot break a framework the adapter leaves alone.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Union

TRUE_SPELLINGS: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_SPELLINGS: tuple[str, ...] = ("0", "false", "no", "off")
SPELLINGS_TEXT = "1/0, true/false, yes/no, on/off (any case)"
SHOWN_CHARS = 80
"""The most characters of a value an error message quotes (:func:`show_value`)."""


def show_value(raw: str, *, quote: bool = True) -> str:
    """``raw`` as an error message shows it: ``repr(raw)`` (``raw`` itself with ``quote=False``),
    or, for a value longer than :data:`SHOWN_CHARS` characters, its first :data:`SHOWN_CHARS`
    characters followed by ``... (N chars)``, so that a huge value never fills a log line."""
    text = str(raw)
    if len(text) <= SHOWN_CHARS:
        return repr(text) if quote else text
    head = text[:SHOWN_CHARS]
    return f"{head!r}... ({len(text)} chars)" if quote else f"{head}... ({len(text)} chars)"


class SwitchError(ValueError):
    """An environment variable holds a value its switch does not accept (the message names both)."""


def parse_flag(name: str, raw: str) -> bool:
    """``raw`` (the value of variable ``name``) as a boolean.

    Raises:
        SwitchError: ``raw`` is not one of :data:`TRUE_SPELLINGS` / :data:`FALSE_SPELLINGS`.
    """
    value = raw.strip().lower()
    if value in TRUE_SPELLINGS:
        return True
    if value in FALSE_SPELLINGS:
        return False
    raise SwitchError(f"{name} must be one of {SPELLINGS_TEXT}, got {show_value(raw)}")


def _env(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def env_flag(name: str, default: bool = False, environ: Optional[Mapping[str, str]] = None) -> bool:
    """The boolean value of environment variable ``name``; ``default`` when unset or empty.

    ``environ`` defaults to ``os.environ``. Raises :class:`SwitchError` for any other spelling.
    """
    raw = _env(environ).get(name)
    if raw is None or not raw.strip():
        return default
    return parse_flag(name, raw)


def env_switch_family(
    master: str, members: Mapping[str, tuple[str, bool]], environ: Optional[Mapping[str, str]] = None
) -> Optional[dict[str, bool]]:
    """Read a master switch (default off) and, only when it is on, its member switches.

    Args:
        master: the master variable's name.
        members: ``{key: (variable, default)}``.
        environ: the environment (default ``os.environ``).

    Returns:
        ``None`` when the master is off (no member variable is read), else ``{key: bool}``.

    Raises:
        SwitchError: the master, or with the master on a member, holds an unaccepted value.
    """
    env = _env(environ)
    if not env_flag(master, False, env):
        return None
    return {key: env_flag(var, default, env) for key, (var, default) in members.items()}


def env_flag_or_path(name: str, environ: Optional[Mapping[str, str]] = None) -> Union[bool, str]:
    """A variable that is a switch or a path (``RL_KERNEL_PROFILE``).

    Returns ``False`` when unset, empty or an off spelling; ``True`` for an on spelling; otherwise
    the value itself, stripped of surrounding whitespace (a path, which means on).
    """
    raw = _env(environ).get(name)
    if raw is None or not raw.strip():
        return False
    try:
        return parse_flag(name, raw)
    except SwitchError:
        return raw.strip()
