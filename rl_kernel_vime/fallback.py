"""Fallbacks to vime's own code: one log line per (op, reason), an error in strict mode.

Standard library only. Strict mode is read from ``VIME_RL_KERNEL_STRICT`` at each decision (a
hook used through a hook flag, without ``VIME_RL_KERNEL``, follows it too); :func:`counts` says
how often each op fell back and why.
"""

from __future__ import annotations

import logging
from collections import Counter

from rl_kernel_vime import config

logger = logging.getLogger("rl_kernel.vime")

_counts: Counter[tuple[str, str]] = Counter()


class FallbackError(RuntimeError):
    """Strict mode (``VIME_RL_KERNEL_STRICT=1``) refused a fallback, missing target or mismatch."""


def strict() -> bool:
    """Whether ``VIME_RL_KERNEL_STRICT`` asks for errors instead of fallbacks."""
    return config.strict_from_env()


def fall_back(op: str, reason: str) -> None:
    """Record that ``op`` runs vime's own code because of ``reason``.

    Raises :class:`FallbackError` in strict mode; otherwise logs a warning the first time this
    (op, reason) pair is seen in the process and returns, and the caller runs the original.
    """
    if strict():
        raise FallbackError(
            f"rl_kernel_vime: {op} cannot run on rl-kernel: {reason} ({config.STRICT_VAR}=1 forbids falling back to vime's code)"
        )
    key = (op, reason)
    if key not in _counts:
        logger.warning("rl_kernel_vime: %s falls back to vime's own code: %s (logged once)", op, reason)
    _counts[key] += 1


def counts() -> dict[str, dict[str, int]]:
    """``{op: {reason: number of fallbacks}}`` in this process."""
    out: dict[str, dict[str, int]] = {}
    for (op, reason), n in _counts.items():
        out.setdefault(op, {})[reason] = n
    return out


def reset() -> None:
    """Forget the fallbacks seen: the next one of each kind is logged again (tests, or a new run
    in a long-lived process)."""
    _counts.clear()
