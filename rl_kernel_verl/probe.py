"""Where the plugin meets verl: one wrapper around ``EngineRegistry.new`` that reads the switch.

verl's switch lives in the model config, which only exists once a worker builds its engine, so
the plugin cannot decide at import time. :func:`arm` wraps ``EngineRegistry.new`` (the factory
every verl training engine is made by) as soon as ``verl.workers.engine.base`` is imported, without
importing it early: importing verl's engines from inside ``import verl`` would fix verl's device
platform before a user could register one. The wrapper calls verl's factory unchanged, reads the
switch from the new engine's model config and, only when it is on, hooks that one engine instance
(:func:`rl_kernel_verl.engine.install`); an actor engine whose config asks for the weight check
arms it (:func:`rl_kernel_verl.weight_check.arm`). With both off the engine is returned untouched
and nothing else in verl is modified.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import Any, Callable, Optional

from rl_kernel_core import adapters
from rl_kernel_core.switches import SwitchError
from rl_kernel_verl import switch, targets

logger = logging.getLogger("rl_kernel.verl")

_MODULE, _, _ATTR = targets.ENGINE_REGISTRY_NEW.partition(":")
_lock = threading.Lock()
_patches = adapters.Patches()
_state: dict[str, Any] = {"armed": False, "wrapped": None, "error": None}


def _engine_created(engine: Any) -> None:
    from rl_kernel_verl import engine as engine_hooks

    model_config = getattr(engine, "model_config", None)
    if model_config is None:
        return
    sw = switch.read(model_config)
    if sw.on:
        engine_hooks.install(engine, strict=sw.strict, batch_invariant=sw.batch_invariant, row_split=sw.row_split)
    if sw.weight_check_every and not getattr(getattr(engine, "engine_config", None), "forward_only", False):
        from rl_kernel_verl import weight_check

        weight_check.arm(engine, sw.weight_check_every)


def _wrap_new(raw: Any) -> classmethod:
    if not isinstance(raw, classmethod):
        raise adapters.TargetMissing(f"{targets.ENGINE_REGISTRY_NEW} is not a classmethod")
    original: Callable = raw.__func__

    @functools.wraps(original)
    def new(cls, *args, **kwargs):
        engine = original(cls, *args, **kwargs)
        _engine_created(engine)
        return engine

    return classmethod(new)


def _strict_for_missing_probe() -> bool:
    # Whether the backend is on cannot be known without the probe, so a malformed strict value
    # is reported with the missing target instead of raised into verl's import.
    try:
        return adapters.strict_switch(targets.STRICT_ENV)
    except SwitchError as exc:
        logger.warning("rl_kernel_verl: %s", exc)
        return False


def _wrap_factory(_module: Any = None) -> None:
    """Wrap ``EngineRegistry.new`` (idempotent)."""
    with _lock:
        try:
            _patches.install(targets.ENGINE_REGISTRY_NEW, _wrap_new)
        except adapters.TargetMissing as exc:
            _state["error"] = f"rl_kernel_verl: target {exc}"
            targets.missing(
                exc, strict=_strict_for_missing_probe(), consequence="the switch cannot be read and rl-kernel stays off"
            )
            return
        _state["wrapped"] = adapters.resolve(f"{_MODULE}:EngineRegistry")
        _state["error"] = None


def arm() -> None:
    """Install the probe: now if verl's engine module is loaded, else right after it loads."""
    with _lock:
        if _state["armed"]:
            return
        _state["armed"] = True
    if _MODULE in sys.modules:
        _wrap_factory()
    else:
        _patches.add_import_hook(adapters.ImportHook([_MODULE], _wrap_factory, once=True))


def disarm() -> None:
    """Undo :func:`arm`: ``EngineRegistry.new`` is verl's own again and the import hook is gone.
    Engines already hooked keep their hooks."""
    with _lock:
        _patches.restore()
        _state.update(armed=False, wrapped=None, error=None)


def status() -> dict[str, Optional[str]]:
    """``{"armed": bool, "probe": "live" | "waiting for <module>" | <why it is missing>}``."""
    if _state["error"]:
        probe = _state["error"]
    elif _state["wrapped"] is not None:
        probe = "live"
    elif _state["armed"]:
        probe = f"waiting for {_MODULE} to be imported"
    else:
        probe = "not armed"
    return {"armed": _state["armed"], "probe": probe}
