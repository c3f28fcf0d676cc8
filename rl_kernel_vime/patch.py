"""Put the hooks in place of vime's functions, idempotently; put the originals back.

:func:`apply_module` runs right after a target module is imported (or at activation for modules
already imported). For each of its targets it checks the op switch, that the function exists
and that its signature still has the parameters the hook expects (the version check); then it
replaces the module attribute with the function of the same name in :mod:`rl_kernel_vime.hooks`
and replaces every by-name import of the original in the loaded ``vime.*`` modules (slime's
actor imports ``get_log_probs_and_entropy`` by name, its loss module ``compute_approx_kl``). A missing
target or a mismatched signature is logged and left alone, or raises
:class:`~rl_kernel_vime.fallback.FallbackError` in strict mode.
"""

from __future__ import annotations

import inspect
import logging
from types import ModuleType
from typing import Callable, Optional

from rl_kernel_vime import config, fallback, hooks, registry, targets, timing

logger = logging.getLogger("rl_kernel.vime")


def _signature_problem(fn: Callable, params: tuple[str, ...]) -> Optional[str]:
    try:
        present = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        return f"signature cannot be read ({exc})"
    missing = [p for p in params if p not in present]
    if missing:
        return f"signature {inspect.signature(fn)} lacks {missing}: this vime version differs from the one the hook was written for"
    return None


def _problem(target: targets.Target, state: str, cfg: config.Config) -> None:
    registry.set_state(target.key, state)
    if cfg.strict:
        raise fallback.FallbackError(f"rl_kernel_vime: {target.key}: {state} ({config.STRICT_VAR}=1)")
    logger.warning("rl_kernel_vime: %s not patched: %s", target.key, state)


def _apply(target: targets.Target, module: ModuleType, cfg: config.Config) -> None:
    if target.op is not None and target.op not in cfg.ops:
        registry.set_state(target.key, f"off ({config.OPS_VAR} does not select {target.op})")
        return
    hook = getattr(hooks, target.attr)
    current = getattr(module, target.attr, None)
    if current is hook:
        return
    if current is None:
        _problem(target, f"missing: {target.module} has no {target.attr}", cfg)
        return
    problem = _signature_problem(current, target.params)
    if problem is not None:
        _problem(target, problem, cfg)
        return
    registry.set_original(target.key, current)
    registry.patches.set(module, target.attr, hook)
    registry.set_state(target.key, registry.LIVE)
    if target.op is None:
        timing.enable(cfg.profile_path)


def _rebind_by_name() -> None:
    """Replace by-name imports of patched originals in every loaded ``vime.*`` module."""
    pairs = [(orig, getattr(hooks, key.partition(":")[2])) for key, orig in registry.originals().items()]
    registry.patches.rebind(pairs, targets.PACKAGE)


def apply_module(name: str, module: ModuleType, cfg: config.Config) -> None:
    """Patch target module ``name`` (just imported) according to ``cfg``."""
    for target in targets.TARGETS:
        if target.module == name:
            _apply(target, module, cfg)
    _rebind_by_name()
    logger.info(
        "rl_kernel_vime: %s patched: %s",
        name,
        {t.key: registry.states().get(t.key) for t in targets.TARGETS if t.module == name},
    )
