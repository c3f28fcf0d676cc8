"""Activation: an import hook that patches vime's modules right after they are imported.

Standard library only: ``rl_kernel_vime.pth`` (installed into site-packages with the package)
calls :func:`install_from_env` at interpreter start when ``VIME_RL_KERNEL`` is set to something
other than ``0``. With the switch on, a finder is put first on ``sys.meta_path``; it answers
only for vime's target modules (:data:`rl_kernel_vime.targets.MODULES`), lets the normal
machinery find and execute them, then hands the fresh module to
:func:`rl_kernel_vime.patch.apply_module` (which imports torch and rl_kernel_core: the first
cost the switch adds, paid when vime's own modules load). Unset, nothing runs but the ``.pth``
line's environment lookup.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import logging
import sys
import threading
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Optional

from rl_kernel_vime import config, targets

logger = logging.getLogger("rl_kernel.vime")


class _State:
    def __init__(self) -> None:
        self.config: Optional[config.Config] = None
        self.error: Optional[config.ConfigError] = None


_state = _State()
_busy = threading.local()


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the executed module."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _on_imported(module.__name__, module)

    def __getattr__(self, name: str):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


class VimeFinder(importlib.abc.MetaPathFinder):
    """Finds vime's target modules through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path=None, target=None) -> Optional[ModuleSpec]:
        if fullname not in targets.MODULES:
            return None
        if _state.error is not None:
            raise ImportError(f"rl_kernel_vime: {config.SWITCH} is on but a switch is invalid: {_state.error}") from _state.error
        busy = getattr(_busy, "names", None)
        if busy is None:
            busy = _busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def _finder_installed() -> bool:
    return any(isinstance(f, VimeFinder) for f in sys.meta_path)


def _on_imported(name: str, module: ModuleType) -> None:
    cfg = _state.config
    if cfg is None:
        return
    try:
        from rl_kernel_vime import patch

        patch.apply_module(name, module, cfg)
    except Exception:
        if cfg.strict:
            raise
        logger.exception("rl_kernel_vime: patching %s failed; vime's own code runs there", name)


def activate(cfg: Optional[config.Config] = None) -> None:
    """Turn the hooks on in this process (idempotent).

    ``cfg`` defaults to the environment's ops/strict/profile switches, whatever
    ``VIME_RL_KERNEL`` says (this is the explicit call). Target modules imported before this call
    are patched now; the others when they are imported.
    """
    cfg = cfg or dataclasses.replace(config.from_env(), enabled=True)
    _state.config = cfg
    _state.error = None
    if not _finder_installed():
        sys.meta_path.insert(0, VimeFinder())
    for name in sorted(targets.MODULES):
        module = sys.modules.get(name)
        if module is not None:
            _on_imported(name, module)


def install_from_env() -> None:
    """The ``.pth`` entry point: activate when ``VIME_RL_KERNEL`` is on.

    An invalid switch value does not stop the interpreter: importing a vime target module then
    raises ``ImportError`` naming the variable, so a typo never leaves training silently
    unaccelerated.
    """
    try:
        cfg = config.from_env()
    except config.ConfigError as exc:
        _state.error = exc
        if not _finder_installed():
            sys.meta_path.insert(0, VimeFinder())
        return
    if cfg.enabled:
        activate(cfg)


def current_config() -> Optional[config.Config]:
    """The configuration the hooks run with (None until activated)."""
    return _state.config
