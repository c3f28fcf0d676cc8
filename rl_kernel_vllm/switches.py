"""The plugin's switches: environment variables read once per process by :func:`read`.

vLLM loads general plugins in every process it starts (the API/driver process, the engine
core, each worker), and those processes inherit the environment, so environment variables are
the one configuration every process sees. Values go through rl-kernel's one boolean parser
(:mod:`rl_kernel_core.switches`: ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``,
any case; unset or empty is the default); anything else is an error naming the variable.

=================================  =======  ================================================
variable                           default  effect
=================================  =======  ================================================
``RL_KERNEL_VLLM``                 ``0``    master switch; off means nothing is touched
``RL_KERNEL_VLLM_LOGPROBS``        ``1``    (a) sampled/top-k log-prob values: trainer's
                                            definition via ``logprob_from_logits``
``RL_KERNEL_VLLM_LM_HEAD``         ``0``    (b) LM head through rl-kernel's fp32,
                                            batch-invariant path (``LogitsProcessor`` OOT)
``RL_KERNEL_VLLM_SAMPLER``         ``0``    (c) seeded, batch-position-invariant sampler
``RL_KERNEL_VLLM_BATCH_INVARIANT`` ``0``    (d) the whole forward in rl-kernel's
                                            batch-invariant mode, so returned log-probs
                                            equal the trainer's bit for bit
                                            (:mod:`rl_kernel_vllm.batch_invariant`)
``RL_KERNEL_VLLM_STRICT``          ``0``    a missing or moved vLLM target is an error
=================================  =======  ================================================

While ``RL_KERNEL_VLLM`` is off the other variables are not read at all: a malformed
sub-switch cannot stop vLLM from starting when the plugin is off. ``RL_KERNEL_VLLM_BATCH_INVARIANT``
and vLLM's own ``VLLM_BATCH_INVARIANT`` are exclusive (an error names both): each replaces the
same kernels with its own. ``VLLM_BATCH_INVARIANT`` is vLLM's variable, so it is read (only with
``RL_KERNEL_VLLM_BATCH_INVARIANT`` on) exactly as vLLM reads it, not with rl-kernel's spellings:
``bool(int(value))`` with ``"0"`` when unset (:func:`vllm_own_mode`). ``2`` or ``-1`` are on and
``0`` off; a value ``int()`` does not take (``true``, ``on``, an empty string) makes vLLM itself
fail with a ``ValueError`` when it reads it, and is refused here the same way, by a
:class:`~rl_kernel_core.switches.SwitchError` naming the variable and the value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from rl_kernel_core.switches import SwitchError, env_switch_family, show_value

MASTER = "RL_KERNEL_VLLM"
STRICT = "RL_KERNEL_VLLM_STRICT"

# hook name -> (environment variable, default when the master switch is on)
HOOK_SWITCHES: dict[str, tuple[str, bool]] = {
    "logprobs": ("RL_KERNEL_VLLM_LOGPROBS", True),
    "lm_head": ("RL_KERNEL_VLLM_LM_HEAD", False),
    "sampler": ("RL_KERNEL_VLLM_SAMPLER", False),
    "batch_invariant": ("RL_KERNEL_VLLM_BATCH_INVARIANT", False),
}


@dataclass(frozen=True)
class Switches:
    """The switch values of one process: ``enabled`` (master), ``strict`` and one bool per hook."""

    enabled: bool
    strict: bool
    hooks: dict[str, bool]

    def wanted(self, hook: str) -> bool:
        """Whether ``hook`` (a key of :data:`HOOK_SWITCHES`) should be installed."""
        return self.enabled and self.hooks[hook]


VLLM_OWN_MODE = "VLLM_BATCH_INVARIANT"


def vllm_own_mode(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether vLLM's own batch-invariant mode is on, read as vLLM reads ``VLLM_BATCH_INVARIANT``
    (``vllm.envs``: ``bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))``): any integer ``int()``
    takes, nonzero meaning on; unset is ``"0"``.

    Raises:
        rl_kernel_core.switches.SwitchError: the value is not one ``int()`` takes (``true``, an
            empty string...), which vLLM refuses with a ``ValueError`` when it reads it.
    """
    raw = (os.environ if environ is None else environ).get(VLLM_OWN_MODE, "0")
    try:
        return int(raw) != 0
    except ValueError:
        raise SwitchError(
            f"{VLLM_OWN_MODE} is vLLM's switch, which vLLM reads as an integer (0 off, any other "
            f"integer on) and refuses {show_value(raw)}: set it to 0 or 1, or unset it"
        ) from None


def read(environ: Optional[Mapping[str, str]] = None) -> Switches:
    """Read the switches from ``environ`` (default ``os.environ``): the master switch first, the
    others only when it is on.

    Raises:
        rl_kernel_core.switches.SwitchError: a switch that is read holds an unaccepted value
            (``VLLM_BATCH_INVARIANT``: one vLLM refuses, :func:`vllm_own_mode`).
        ValueError: ``RL_KERNEL_VLLM_BATCH_INVARIANT`` and vLLM's ``VLLM_BATCH_INVARIANT`` are both on.
    """
    values = env_switch_family(MASTER, {**HOOK_SWITCHES, "strict": (STRICT, False)}, environ)
    if values is None:
        return Switches(enabled=False, strict=False, hooks={hook: False for hook in HOOK_SWITCHES})
    if values["batch_invariant"] and vllm_own_mode(environ):
        own = show_value((os.environ if environ is None else environ)[VLLM_OWN_MODE].strip(), quote=False)
        raise ValueError(
            f"{HOOK_SWITCHES['batch_invariant'][0]}=1 and vLLM's {VLLM_OWN_MODE}={own} are exclusive: "
            "each replaces the same kernels with its own; unset one"
        )
    strict = values.pop("strict")
    return Switches(enabled=True, strict=strict, hooks=values)


def environment_without_switches() -> dict[str, str]:
    """This process's environment less the plugin's and vLLM's batch-invariant switches: a child
    process started with it has the mode off unless the caller turns it on."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_VLLM", "VLLM_BATCH_INVARIANT"))}
