"""Activation: an import hook that patches vime's modules right after they are imported.

Standard library only: ``rl_kernel_vime.pth`` (installed into site-packages with the package)
calls :func:`install_from_env` at interpreter start when ``VIME_RL_KERNEL`` is set to something
other than empty or ``0`` (a cheap pre-filter; the value itself is parsed by
:func:`rl_kernel_vime.config.from_env`). With the switch on, an
:class:`rl_kernel_core.adapters.ImportHook` is put first on ``sys.meta_path``; it answers only
for vime's target modules (:data:`rl_kernel_vime.targets.MODULES`), lets the normal machinery find
and execute them, then hands the fresh module to :func:`rl_kernel_vime.patch.apply_module` (which
imports torch and rl_kernel_core's ops: the first cost the switch adds, paid when vime's own
modules load). Off, nothing is installed; unset, nothing runs but the ``.pth`` line's lookup.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Optional

from rl_kernel_core.adapters import ImportHook
from rl_kernel_core.switches import SwitchError
from rl_kernel_vime import config, registry, targets

logger = logging.getLogger("rl_kernel.vime")


class _State:
    def __init__(self) -> None:
        self.config: Optional[config.Config] = None
        self.error: Optional[SwitchError] = None
        self.hooked = False


_state = _State()


def _refuse_invalid(name: str) -> None:
    if _state.error is not None:
        raise ImportError(
            f"rl_kernel_vime: {config.SWITCH} is on but a switch is invalid: {_state.error}"
        ) from _state.error


def _install_hook() -> None:
    if not _state.hooked:
        registry.patches.add_import_hook(ImportHook(targets.MODULES, _on_module, before=_refuse_invalid))
        _state.hooked = True


def _on_module(module: ModuleType) -> None:
    _on_imported(module.__name__, module)


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
    cfg = cfg or config.settings_from_env()
    _state.config = cfg
    _state.error = None
    _install_hook()
    for name in sorted(targets.MODULES):
        module = sys.modules.get(name)
        if module is not None:
            _on_imported(name, module)


def restore() -> None:
    """Turn the hooks off in this process: every original back (by-name bindings in other vime
    modules included), the import hook off ``sys.meta_path``, the configuration forgotten."""
    registry.patches.restore()
    _state.config = None
    _state.error = None
    _state.hooked = False
    for key in registry.originals():
        registry.forget(key)
        registry.withdraw(key)


def install_from_env() -> None:
    """The ``.pth`` entry point: activate when ``VIME_RL_KERNEL`` is on.

    An invalid switch value does not stop the interpreter: importing a vime target module then
    raises ``ImportError`` naming the variable, so a typo never leaves training silently
    unaccelerated. With the master switch off nothing is installed and no other switch is read.
    """
    try:
        cfg = config.from_env()
    except SwitchError as exc:
        _state.error = exc
        _install_hook()
        return
    if cfg.enabled:
        activate(cfg)


def current_config() -> Optional[config.Config]:
    """The configuration the hooks run with (None until activated)."""
    return _state.config
