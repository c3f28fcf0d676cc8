"""rl-kernel backend for verl (0.9.x, FSDP/FSDP2 engine).

Switch it on in the verl config (Hydra override)::

    +actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True

Then, for the actor update, the old-log-prob pass and the reference pass, the engine computes
per-token log-probs and entropies from the final hidden states with
``rl_kernel_core.linear_logprob`` (no ``[N, V]`` logits), the actor loss with
``rl_kernel_core.loss`` (verl's vanilla PPO/GRPO loss, KL loss and aggregation), and adds
``rl_kernel/*_ms`` timings and ``rl_kernel/backend/<op>/<backend>`` to the metrics of
``update_actor``, ``compute_log_prob`` and ``compute_ref_log_prob``. ``docs/verl.md`` has the
details, what is left alone and the tested versions.

Loading: verl imports the ``verl.plugins`` entry points on ``import verl`` in every process
(``VERL_USE_EXTERNAL_PLUGINS`` filters them); its loader imports this module and does not call
anything, so importing it calls :func:`register`. :func:`register` is idempotent; it arms one
probe (a wrapper around ``EngineRegistry.new`` that reads the switch when an engine is built);
with the switch off, engines are returned untouched and nothing else in verl changes.
"""

from __future__ import annotations

from typing import Any

from rl_kernel_verl import probe
from rl_kernel_verl.switch import OVERRIDE, SWITCH_KEY

__all__ = ["OVERRIDE", "SWITCH_KEY", "register", "restore", "status"]


def register() -> None:
    """Arm the plugin in this process (idempotent; the ``verl.plugins`` entry point)."""
    probe.arm()


def restore() -> None:
    """Disarm the plugin: ``EngineRegistry.new`` and ``BaseRollout.__init__`` are verl's own again
    and the import hook is removed (engines and rollouts already hooked keep their hooks;
    :func:`register` arms it again)."""
    from rl_kernel_verl import weight_check

    probe.disarm()
    weight_check.disarm()


def status() -> dict[str, Any]:
    """Which hooks are live: the probe, per switched-on engine its hooks, loss and routing, and
    the weight check (None when not armed in this process)."""
    from rl_kernel_verl import engine, weight_check

    return {**probe.status(), "engines": engine.engines_status(), "weight_check": weight_check.status()}


register()
