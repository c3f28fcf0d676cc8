"""The plugin's switches: environment variables read once per process by :func:`read`.

vLLM loads general plugins in every process it starts (the API/driver process, the engine
core, each worker), and those processes inherit the environment, so environment variables are
the one configuration every process sees. Values are ``1``/``0`` (also ``true``/``false``,
``yes``/``no``, ``on``/``off``, any case); anything else is an error naming the variable.

=================================  =======  ================================================
variable                           default  effect
=================================  =======  ================================================
``RL_KERNEL_VLLM``                 ``0``    master switch; off means nothing is touched
``RL_KERNEL_VLLM_LOGPROBS``        ``1``    (a) sampled/top-k log-prob values: trainer's
                                            definition via ``logprob_from_logits``
``RL_KERNEL_VLLM_LM_HEAD``         ``0``    (b) LM head through rl-kernel's fp32,
                                            batch-invariant path (``LogitsProcessor`` OOT)
``RL_KERNEL_VLLM_SAMPLER``         ``0``    (c) seeded, batch-position-invariant sampler
``RL_KERNEL_VLLM_STRICT``          ``0``    a missing or moved vLLM target is an error
=================================  =======  ================================================

The sub-switches only matter when ``RL_KERNEL_VLLM`` is on. ``RL_KERNEL_VLLM_BATCH_INVARIANT`` is
refused with an error: the plugin has no hook that makes vLLM's own attention, matmul and norm
kernels batch-invariant (vLLM's ``VLLM_BATCH_INVARIANT=1`` does), and its own ops are row-invariant
without one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

MASTER = "RL_KERNEL_VLLM"
STRICT = "RL_KERNEL_VLLM_STRICT"

# hook name -> (environment variable, default when the master switch is on)
HOOK_SWITCHES: dict[str, tuple[str, bool]] = {
    "logprobs": ("RL_KERNEL_VLLM_LOGPROBS", True),
    "lm_head": ("RL_KERNEL_VLLM_LM_HEAD", False),
    "sampler": ("RL_KERNEL_VLLM_SAMPLER", False),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def flag(name: str, default: bool, environ: Optional[Mapping[str, str]] = None) -> bool:
    """The boolean value of environment variable ``name`` (``default`` when unset).

    Raises:
        ValueError: the variable holds something other than a recognised boolean spelling.
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/0, true/false, yes/no, on/off, got {raw!r}")


@dataclass(frozen=True)
class Switches:
    """The switch values of one process: ``enabled`` (master), ``strict`` and one bool per hook."""

    enabled: bool
    strict: bool
    hooks: dict[str, bool]

    def wanted(self, hook: str) -> bool:
        """Whether ``hook`` (a key of :data:`HOOK_SWITCHES`) should be installed."""
        return self.enabled and self.hooks[hook]


NOT_A_SWITCH = "RL_KERNEL_VLLM_BATCH_INVARIANT"


def read(environ: Optional[Mapping[str, str]] = None) -> Switches:
    """Read every switch from ``environ`` (default ``os.environ``).

    Raises:
        ValueError: a switch holds an unrecognised value, or :data:`NOT_A_SWITCH` is set.
    """
    if NOT_A_SWITCH in (os.environ if environ is None else environ):
        raise ValueError(f"{NOT_A_SWITCH} is not an rl_kernel_vllm switch: the plugin does not make vLLM's layers "
                         "batch-invariant; use vLLM's VLLM_BATCH_INVARIANT=1 for that (rl-kernel's own ops in vLLM "
                         "are row-invariant already)")
    return Switches(
        enabled=flag(MASTER, False, environ),
        strict=flag(STRICT, False, environ),
        hooks={hook: flag(var, default, environ) for hook, (var, default) in HOOK_SWITCHES.items()},
    )
