"""Where the plugin meets verl: one wrapper around ``EngineRegistry.new`` that reads the switch.

verl's switch lives in the model config, which only exists once a worker builds its engine, so
the plugin cannot decide at import time. :func:`arm` wraps ``EngineRegistry.new`` (the factory
every verl training engine is made by) as soon as ``verl.workers.engine.base`` is imported, without
importing it early: importing verl's engines from inside ``import verl`` would fix verl's device
platform before a user could register one. The wrapper calls verl's factory unchanged, reads the
switch from the new engine's model config and, only when it is on, hooks that one engine instance
(:func:`rl_kernel_verl.engine.install`). With the switch off the engine is returned untouched and
nothing else in verl is modified.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
from typing import Any, Callable, Optional

from rl_kernel_verl import switch, targets

logger = logging.getLogger("rl_kernel.verl")

_MODULE, _, _ATTR = targets.ENGINE_REGISTRY_NEW.partition(":")
_lock = threading.Lock()
_state: dict[str, Any] = {"armed": False, "wrapped": None, "error": None}


def _engine_created(engine: Any) -> None:
    from rl_kernel_verl import engine as engine_hooks

    model_config = getattr(engine, "model_config", None)
    if model_config is None:
        return
    sw = switch.read(model_config)
    if sw.on:
        engine_hooks.install(engine, strict=sw.strict)


def _wrap_factory(_module: Any) -> None:
    """Wrap ``EngineRegistry.new`` in ``module`` (idempotent)."""
    with _lock:
        try:
            registry = targets.resolve(f"{_MODULE}:EngineRegistry")
            raw = registry.__dict__.get("new")
            if not isinstance(raw, classmethod):
                raise targets.TargetMissing(f"rl_kernel_verl: target {targets.ENGINE_REGISTRY_NEW} is not a classmethod")
        except targets.TargetMissing as exc:
            _state["error"] = str(exc)
            targets.missing(exc, strict=targets.env_strict(), consequence="the switch cannot be read and rl-kernel stays off")
            return
        if getattr(raw.__func__, "__rl_kernel_probe__", False):
            return
        original: Callable = raw.__func__

        @functools.wraps(original)
        def new(cls, *args, **kwargs):
            engine = original(cls, *args, **kwargs)
            _engine_created(engine)
            return engine

        new.__rl_kernel_probe__ = True
        new.__wrapped_original__ = original
        registry.new = classmethod(new)
        _state["wrapped"] = registry
        _state["error"] = None


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the hook on the freshly executed module."""

    def __init__(self, loader: importlib.abc.Loader, hook: Callable[[Any], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of one module so a hook runs after it loads."""

    def __init__(self, name: str, hook: Callable[[Any], None]) -> None:
        self.name = name
        self.hook = hook
        self._busy = False

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, self.hook)
        if self in sys.meta_path:  # one module, once: step out of every later import
            sys.meta_path.remove(self)
        return spec


def arm() -> None:
    """Install the probe: now if verl's engine module is loaded, else right after it loads."""
    with _lock:
        if _state["armed"]:
            return
        _state["armed"] = True
    if _MODULE in sys.modules:
        _wrap_factory(sys.modules[_MODULE])
    else:
        sys.meta_path.insert(0, _Finder(_MODULE, _wrap_factory))


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
