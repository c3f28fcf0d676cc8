"""rl-kernel hooks for vime (a slime fork: vLLM rollout, Megatron training).

Switch: ``export VIME_RL_KERNEL=1`` with rl-kernel installed. The ``rl_kernel_vime.pth`` file
installed beside the package then patches vime's log-prob, KL and policy-loss functions as
their modules are imported (see :mod:`rl_kernel_vime.targets`), makes rl-kernel vime's default
log-prob provider (:mod:`rl_kernel_vime.provider`), and times them into vime's step
metrics (``perf/rl_kernel/<region>_ms``) and a JSONL step record. ``VIME_RL_KERNEL_OPS``,
``VIME_RL_KERNEL_STRICT`` and ``VIME_RL_KERNEL_PROFILE`` refine it (:mod:`rl_kernel_vime.config`).
Hook flags reach the same functions: :mod:`rl_kernel_vime.hooks`.

Importing this package costs only the standard library; torch and rl_kernel_core load when a
vime module is patched.
"""

from __future__ import annotations

from typing import Any

from rl_kernel_vime import fallback, registry, targets
from rl_kernel_vime import _bootstrap
from rl_kernel_vime._bootstrap import activate, current_config

__all__ = ["activate", "restore", "status"]


def restore() -> None:
    """Turn the hooks off: vime's functions back everywhere they were bound in vime's modules, the
    import hook removed; a hook that a module elsewhere imported by name calls vime's function
    from now on, until an :func:`activate` patches that target in again."""
    _bootstrap.restore()


def status() -> dict[str, Any]:
    """Which hooks are live in this process and why the others are not.

    Returns ``{"enabled", "ops", "strict", "profile_path", "targets": {key: state},
    "not_replaced": {key: why}, "fallbacks": {op: {reason: count}}, "provider": {"path",
    "calls": {outcome: count}}}``; a target whose module is not imported yet shows
    ``"pending (module not imported)"``. ``provider`` is the ``--linear-logp-provider`` value of
    rl-kernel's provider (the default vime loads while the target
    ``...linear_logp_provider:linear_logp_provider_path`` is live) and what it answered vime so far
    (``"rl_kernel:<backend> via <op>"`` or ``"unavailable: <reason>"``).
    """
    cfg = current_config()
    states = registry.states()
    return {
        "enabled": bool(cfg and cfg.enabled),
        "ops": sorted(cfg.ops) if cfg else [],
        "strict": bool(cfg and cfg.strict),
        "profile_path": cfg.profile_path if cfg else None,
        "targets": {
            t.key: states.get(t.key, "pending (module not imported)" if cfg else "off") for t in targets.TARGETS
        },
        "not_replaced": dict(targets.NOT_REPLACED),
        "fallbacks": fallback.counts(),
        "provider": {"path": targets.PROVIDER_PATH, "calls": registry.provider_calls()},
    }
