"""Which vime functions are replaced, their originals, each target's state, the record of
every change made to vime (:data:`patches`), and what the provider answered vime. Standard
library only."""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Callable

from rl_kernel_core.adapters import Patches

patches = Patches()
"""Every attribute replaced in vime's modules (by-name bindings included) and the import hook:
:func:`rl_kernel_vime.restore` undoes them all."""

_originals: dict[str, Callable] = {}
_states: dict[str, str] = {}
_withdrawn: set[str] = set()
_provider_calls: Counter[str] = Counter()

LIVE = "live"
RESTORED = "restored"


def set_original(key: str, original: Callable) -> None:
    """Remember ``original`` as what target ``key`` (``"module:attr"``) held before patching (the
    hook goes in now: it serves again wherever it is held, see :func:`restored`)."""
    _originals.setdefault(key, original)
    _withdrawn.discard(key)


def forget(key: str) -> None:
    """Drop target ``key``'s original (after it was put back)."""
    _originals.pop(key, None)


def originals() -> dict[str, Callable]:
    """``{key: original}`` of the targets patched now."""
    return dict(_originals)


def original(key: str) -> Callable:
    """vime's own function for target ``key``: the saved original when patched, else the
    module's current attribute (a hook used through a hook flag, with nothing patched)."""
    if key in _originals:
        return _originals[key]
    module_name, _, attr = key.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"rl_kernel_vime needs vime's {key} to fall back to, and {module_name} cannot be imported: {exc}"
        ) from exc
    if not hasattr(module, attr):
        raise AttributeError(
            f"rl_kernel_vime needs vime's {key} to fall back to, and {module_name} has no attribute {attr!r}"
        )
    return getattr(module, attr)


def set_state(key: str, state: str) -> None:
    """Record target ``key``'s state: :data:`LIVE` or why it is not."""
    _states[key] = state


def withdraw(key: str) -> None:
    """Record that :func:`rl_kernel_vime.restore` put target ``key``'s vime function back: the
    hook, wherever it is still held, passes calls to vime's function until it is patched in again."""
    _withdrawn.add(key)
    _states[key] = RESTORED


def restored(key: str) -> bool:
    """Whether target ``key``'s hook was withdrawn by :func:`rl_kernel_vime.restore` and not
    patched in since: true after a restore whatever a later activation decided for the target
    (its op not selected, its signature changed), so a hook held outside vime never serves
    while :func:`rl_kernel_vime.status` says the target is not live."""
    return key in _withdrawn


def reset_states() -> None:
    """Forget every target's state, so hooks called directly serve again after a
    :func:`rl_kernel_vime.restore` (tests, like :func:`rl_kernel_vime.fallback.reset`)."""
    _states.clear()
    _withdrawn.clear()


def states() -> dict[str, str]:
    """``{key: state}`` of every target seen so far."""
    return dict(_states)


def record_provider_call(outcome: str) -> None:
    """Count one answer of :func:`rl_kernel_vime.provider.provider`: ``"rl_kernel:<backend> via <op>"``
    or ``"unavailable: <reason>"``."""
    _provider_calls[outcome] += 1


def provider_calls() -> dict[str, int]:
    """``{outcome: count}`` of the provider's answers in this process."""
    return dict(_provider_calls)


def reset_provider_calls() -> None:
    """Forget the provider's answers (tests, or a new run in a long-lived process)."""
    _provider_calls.clear()
