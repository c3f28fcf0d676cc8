"""Contract stand-in for ``vime.backends.megatron_utils.selected_logprob_provider`` (not vime).

vime's other provider boundary for the actor's selected log-probs (``--selected-logprob-provider
MODULE.ATTR``, ``--selected-logprob-provider-mode auto|strict``), reproduced from the module as it
stands at RL-Align/vime commit e0d231806e06a3000b9ba4f5be4bd7ba235dfcdc: the same names, fields,
signatures, request checks and ``auto``/``strict`` decisions, written anew. What it keeps:

* the request is flat: local ``logits [T, V_local]`` (already divided by the rollout
  temperature), global ``target_ids [T]``, the TP group, the CP row ownership
  (``context_parallel``), the entropy flags, the top-p replay mask, ``metadata``, and the optional
  structural fields ``hidden [T, H]``, ``lm_head_weight [V_local, H]``, ``lm_head_bias [V_local]``,
  ``vocab_start_index`` (this rank's first global id), ``global_vocab_size`` (the padded
  vocabulary, all TP shards), ``real_vocab_size`` (the tokenizer's) and ``temperature`` (vime's
  loss sets it to the rollout temperature, whether or not it passes hidden states);
* vime resolves the provider on every call (:func:`selected_logprob_provider_path`,
  :func:`selected_logprob_provider_mode`, read from ``args``);
* ``auto`` runs vime's native function when the provider cannot be imported, or raises
  :class:`SelectedLogprobProviderUnavailable` or an exception whose
  ``selected_logprob_provider_unavailable`` attribute is true; ``strict`` turns both into
  ``RuntimeError("selected-logprob provider '<path>' is unavailable: <reason>")``;
* any other provider exception, and a result of the wrong shape, device or dtype, fails the call
  in both modes; ``strict`` also wants non-empty ``backend_id``/``contract_id`` and a result
  attached to autograd when the logits (or, with ``with_entropy_grad``, the entropy) need it;
* a provider may return :class:`SelectedLogprobResult`, a mapping or any object with its fields
  (``selected_logprobs [T, 1]``, ``entropy``, ``backend_id``, ``contract_id``, ``provenance``).

Left out: vime's one-time log line naming the provider backend. The machinery this module shares
with ``linear_logp_provider`` (vime repeats it there) is written once in
:mod:`vime.backends.megatron_utils._provider_boundary`, a stand-in module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from vime.backends.megatron_utils import _provider_boundary as shared
from vime.backends.megatron_utils._provider_boundary import ProviderMode

logger = logging.getLogger(__name__)


class SelectedLogprobProviderUnavailable(RuntimeError):
    """Raised by a provider to ask for vime's native path (``auto``); ``strict`` refuses it."""


@dataclass(frozen=True)
class ContextParallelLayout:
    """Which context-parallel rank owns the local logit rows, and how rows are split."""

    world_size: int
    rank: int
    layout: Literal["single", "zigzag", "allgather"]

    def __post_init__(self) -> None:
        shared.check_topology("context-parallel", self.world_size, self.rank, self.layout)


@dataclass(frozen=True)
class SelectedLogprobRequest:
    """What vime hands a provider (see the module docstring for the fields)."""

    logits: torch.Tensor
    target_ids: torch.Tensor
    tensor_parallel_group: Any
    context_parallel: ContextParallelLayout
    with_entropy: bool
    with_entropy_grad: bool
    chunk_size: int
    log_prob_keep_mask: torch.Tensor | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    lm_head_weight: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None
    vocab_start_index: int = 0
    global_vocab_size: int | None = None
    real_vocab_size: int | None = None
    temperature: float | torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.logits.ndim != 2:
            raise ValueError(f"selected-logprob logits must be [T, V_local], got {tuple(self.logits.shape)}")
        rows = self.logits.size(0)
        shared.check_targets("selected-logprob", self.logits, self.target_ids, self.log_prob_keep_mask)
        if self.hidden is None and self.lm_head_weight is None:
            if self.lm_head_bias is not None:
                raise ValueError("linear_logp structural request fields must be supplied together")
            return
        if not isinstance(self.hidden, torch.Tensor):
            raise ValueError("linear_logp request.hidden must be a torch.Tensor")
        if not isinstance(self.lm_head_weight, torch.Tensor):
            raise ValueError("linear_logp request.lm_head_weight must be a torch.Tensor")
        if self.hidden.ndim != 2:
            raise ValueError("linear_logp request.hidden must be [T, hidden]")
        if self.lm_head_weight.ndim != 2:
            raise ValueError("linear_logp request.lm_head_weight must be [V_local, hidden]")
        if self.hidden.size(0) != rows:
            raise ValueError("linear_logp hidden rows must match local logits rows")
        if self.hidden.size(1) != self.lm_head_weight.size(1):
            raise ValueError("linear_logp hidden width must match LM-head width")
        if self.hidden.device != self.logits.device or self.lm_head_weight.device != self.logits.device:
            raise ValueError("linear_logp tensors must share the logits device")
        if self.lm_head_bias is not None:
            if not isinstance(self.lm_head_bias, torch.Tensor):
                raise ValueError("linear_logp request.lm_head_bias must be a torch.Tensor")
            if self.lm_head_bias.ndim != 1 or self.lm_head_bias.size(0) != self.lm_head_weight.size(0):
                raise ValueError("linear_logp LM-head bias must match local vocab width")
            if self.lm_head_bias.device != self.logits.device:
                raise ValueError("linear_logp LM-head bias must share the logits device")
        for name, value in (("global_vocab_size", self.global_vocab_size), ("real_vocab_size", self.real_vocab_size)):
            if value is not None and (isinstance(value, bool) or int(value) <= 0):
                raise ValueError(f"linear_logp {name} must be positive")
        shared.check_temperature(self.temperature, rows)


@dataclass(frozen=True)
class SelectedLogprobResult:
    """A provider's answer: ``selected_logprobs [T, 1]``, ``entropy [T]`` or None, and who computed them."""

    selected_logprobs: torch.Tensor
    entropy: torch.Tensor | None
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class SelectedLogprobProvider(Protocol):
    def __call__(self, request: SelectedLogprobRequest) -> SelectedLogprobResult: ...


_BOUNDARY = shared.Boundary(
    flag="selected_logprob_provider",
    label="selected-logprob",
    logp_field="selected_logprobs",
    result_class=SelectedLogprobResult,
    logger=logger,
    unavailable_class=SelectedLogprobProviderUnavailable,
    strict_label="selected-logprob provider",
    warning_label="Selected-logprob",
)


def selected_logprob_provider_path(args: Any) -> str | None:
    """``args.selected_logprob_provider`` stripped, or None when unset or blank."""
    return shared.provider_path(_BOUNDARY, args)


def selected_logprob_provider_mode(args: Any) -> ProviderMode:
    """``args.selected_logprob_provider_mode`` (default ``auto``), lower-cased; anything else is an error."""
    return shared.provider_mode(_BOUNDARY, args)


def compute_selected_logprobs(
    *,
    args: Any,
    request: SelectedLogprobRequest,
    native: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(selected log-probs [T, 1], entropy [T] or None)`` from the configured provider, or from ``native``."""
    return shared.compute(
        _BOUNDARY, args, request, native, selected_logprob_provider_path, selected_logprob_provider_mode
    )
