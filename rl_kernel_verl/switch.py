"""The user switch: where it lives in verl's config, how it is read, and typo warnings.

The switch is a key of the model config's free-form ``fused_kernel_options`` dict, which verl's
Hydra schema leaves open (the actor, ref and model dataclasses reject unknown keys)::

    +actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True

The model config is shared by the actor and the reference policy, so the switch covers the
actor update, the old-log-prob pass and the reference pass. ``rl_kernel_strict=True`` beside it
(or ``RL_KERNEL_VERL_STRICT=1`` in the environment, read only when the switch is on) turns every
fallback into an error.

``rl_kernel_batch_invariant=True`` (:data:`BATCH_INVARIANT_OVERRIDE`) runs the backend in
rl-kernel's batch-invariant mode, with log-probs defined as vLLM's rollout under
``RL_KERNEL_VLLM_BATCH_INVARIANT=1`` returns them (see :mod:`rl_kernel_verl.forward`). It turns the
backend on by itself; with ``use_rl_kernel_backend=False`` written beside it, it is an error.

``rl_kernel_row_parallel_split=N`` beside it (:data:`ROW_SPLIT_OVERRIDE`; an integer >= 1, default 1) computes
the decoder layers' ``o_proj``/``down_proj`` as the rank-ordered sum of N ranks' products, as verl's
vLLM rollout at ``tensor_model_parallel_size=N`` computes them under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1``
(:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_row_parallel_split`, which refuses an N not dividing the
model's heads or MLP width when the model is built), so a TP=N rollout's log-probs are the
trainer's bit for bit. N > 1 needs the batch-invariant option.

``rl_kernel_weight_check_every=N`` (:data:`WEIGHT_CHECK_OVERRIDE`; a non-negative integer, 0 or
absent: off) checks every N-th weight sync into verl's vLLM rollout bit for bit
(:mod:`rl_kernel_verl.weight_check`). It is independent of the backend switch.

A key that looks like the switch but is not it (``use_rl_kernel``, ``use_rl_kernel_backends``,
the switch put in ``override_config``...) is reported with a loud warning: the backend stays off,
and the warning says so, instead of silently running verl's path.
"""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping

from rl_kernel_core import adapters
from rl_kernel_core.switches import show_value
from rl_kernel_verl import targets

logger = logging.getLogger("rl_kernel.verl")

SWITCH_KEY = "use_rl_kernel_backend"
STRICT_KEY = "rl_kernel_strict"
BATCH_INVARIANT_KEY = "rl_kernel_batch_invariant"
WEIGHT_CHECK_KEY = "rl_kernel_weight_check_every"
ROW_SPLIT_KEY = "rl_kernel_row_parallel_split"
OVERRIDE = f"+actor_rollout_ref.model.fused_kernel_options.{SWITCH_KEY}=True"
BATCH_INVARIANT_OVERRIDE = f"+actor_rollout_ref.model.fused_kernel_options.{BATCH_INVARIANT_KEY}=True"
WEIGHT_CHECK_OVERRIDE = f"+actor_rollout_ref.model.fused_kernel_options.{WEIGHT_CHECK_KEY}=1"
ROW_SPLIT_OVERRIDE = f"+actor_rollout_ref.model.fused_kernel_options.{ROW_SPLIT_KEY}=2"
_OUR_KEYS = (SWITCH_KEY, STRICT_KEY, BATCH_INVARIANT_KEY, WEIGHT_CHECK_KEY, ROW_SPLIT_KEY)
_VERL_KEYS = ("impl_backend",)


@dataclass(frozen=True)
class Switch:
    """What the config asks for: ``on`` (use the rl-kernel backend), ``strict``,
    ``batch_invariant`` (the backend in batch-invariant mode; implies ``on``), ``row_split`` (the
    row-parallel linears as that many ranks' sum; 2 only with ``batch_invariant``) and
    ``weight_check_every`` (check every N-th weight sync; 0: never; whatever ``on`` is)."""

    on: bool
    strict: bool
    batch_invariant: bool = False
    weight_check_every: int = 0
    row_split: int = 1


def _shown(value: Any) -> str:
    """``value`` as the errors show it: its repr, cut to its start and length when long."""
    return show_value(repr(value), quote=False)


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"fused_kernel_options.{name} must be true or false, got {_shown(value)} ({type(value).__name__})")


def _as_count(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(
        f"fused_kernel_options.{name} must be an integer >= 0 (0: off), got {_shown(value)} ({type(value).__name__})"
    )


def _options(model_config: Any) -> Mapping:
    """The model config's ``fused_kernel_options``: a mapping (verl's ``dict``, an OmegaConf
    ``DictConfig``), ``{}`` when absent or None."""
    options = _get(model_config, "fused_kernel_options")
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(
            f"actor_rollout_ref.model.fused_kernel_options must be a mapping of option names to values "
            f"(e.g. {OVERRIDE}), got {_shown(options)} ({type(options).__name__})"
        )
    return options


def _looks_like_ours(key: str) -> bool:
    squashed = re.sub(r"[^a-z]", "", key.lower())
    if "rlkernel" in squashed or "rlkernal" in squashed:
        return True
    return bool(difflib.get_close_matches(key, _OUR_KEYS, n=1, cutoff=0.75))


def _warn(message: str) -> None:
    logger.warning("rl_kernel_verl: %s", message)


def read(model_config: Any) -> Switch:
    """Read the switch from a verl model config (``HFModelConfig`` or a mapping).

    Warns loudly about keys that resemble the switch but are not it, and about the switch placed
    in ``override_config`` (where verl forwards it to the Hugging Face config and nothing reads
    it). ``RL_KERNEL_VERL_STRICT`` is read only when the switch is on.

    Raises:
        ValueError: ``fused_kernel_options`` is not a mapping, the switch, ``rl_kernel_strict``
            or ``rl_kernel_batch_invariant`` holds something other than a boolean, ``rl_kernel_batch_invariant=True`` sits beside
            ``use_rl_kernel_backend=False``, ``rl_kernel_weight_check_every`` is not an
            integer >= 0, or ``rl_kernel_row_parallel_split`` is not an integer >= 1 or is above 1
            without ``rl_kernel_batch_invariant=True``.
        rl_kernel_core.switches.SwitchError: the switch is on and ``RL_KERNEL_VERL_STRICT`` holds
            an unaccepted value.
    """
    options = _options(model_config)
    strict = _as_bool(STRICT_KEY, options[STRICT_KEY]) if STRICT_KEY in options else False
    batch_invariant = (
        _as_bool(BATCH_INVARIANT_KEY, options[BATCH_INVARIANT_KEY]) if BATCH_INVARIANT_KEY in options else False
    )
    on = _as_bool(SWITCH_KEY, options[SWITCH_KEY]) if SWITCH_KEY in options else batch_invariant
    every = _as_count(WEIGHT_CHECK_KEY, options[WEIGHT_CHECK_KEY]) if WEIGHT_CHECK_KEY in options else 0
    if batch_invariant and not on:
        raise ValueError(
            f"fused_kernel_options.{BATCH_INVARIANT_KEY}=True runs the rl-kernel backend, but "
            f"{SWITCH_KEY}=False turns it off: drop {SWITCH_KEY} or set it to True"
        )
    row_split = options[ROW_SPLIT_KEY] if ROW_SPLIT_KEY in options else 1
    if type(row_split) is not int or row_split < 1:  # an int: 2.0 or True would pass `>= 1`
        raise ValueError(
            f"fused_kernel_options.{ROW_SPLIT_KEY} must be an integer >= 1 (the rollout's tensor "
            f"parallel size), got {_shown(row_split)} ({type(row_split).__name__})"
        )
    if row_split > 1 and not batch_invariant:
        raise ValueError(
            f"fused_kernel_options.{ROW_SPLIT_KEY}={row_split} reproduces a TP={row_split} rollout bit for "
            f"bit only in the batch-invariant mode: set {BATCH_INVARIANT_KEY}=True beside it"
        )
    for key in options:
        if key not in _OUR_KEYS and key not in _VERL_KEYS and _looks_like_ours(str(key)):
            meant = (difflib.get_close_matches(str(key), _OUR_KEYS, n=1, cutoff=0.75) or [SWITCH_KEY])[0]
            _warn(
                f"fused_kernel_options.{key} is not a key rl-kernel reads (did you mean {meant}?); "
                f"the rl-kernel backend is {'ON' if on else 'OFF'} for this model"
                f"{', batch-invariant' if batch_invariant else ''}. The switch is: {OVERRIDE}"
                f"{f'; the batch-invariant option: {BATCH_INVARIANT_OVERRIDE}' if meant == BATCH_INVARIANT_KEY else ''}"
                f"{f'; the weight check: {WEIGHT_CHECK_OVERRIDE}' if meant == WEIGHT_CHECK_KEY else ''}"
            )
    override = _get(model_config, "override_config") or {}
    nested = override.get("model_config", {}) if isinstance(override, Mapping) else {}
    for where in (override, nested):
        if isinstance(where, Mapping) and any(k in where for k in _OUR_KEYS):
            _warn(
                f"{SWITCH_KEY} was put in override_config, which verl copies into the Hugging Face config; "
                f"rl-kernel does not read it there and the backend is {'ON' if on else 'OFF'}. The switch is: {OVERRIDE}"
            )
    if not on:
        return Switch(on=False, strict=False, weight_check_every=every)
    return Switch(
        on=True,
        strict=strict or adapters.strict_switch(targets.STRICT_ENV),
        batch_invariant=batch_invariant,
        weight_check_every=every,
        row_split=row_split,
    )


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)
