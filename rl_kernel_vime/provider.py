"""rl-kernel behind vime's provider boundaries for the actor's selected log-probs.

vime has two such boundaries in the wild, each named on its command line; :func:`provider` serves
both, telling them apart by the request vime hands it:

* ``--linear-logp-provider rl_kernel_vime.provider.provider`` (``--linear-logp-provider-mode
  auto|strict``): ``vime/backends/megatron_utils/linear_logp_provider.py`` as at RL-Align/vime
  commit 33254c738f1d43250916ae6887f7981e77dbe411 (vime's pull requests 423/424). vime passes a
  ``LinearLogpRequest`` (CP rows in ``token_layout``, hidden states and LM head in the structural
  ``context``) and takes back an object with ``logp [T, 1]``. ``VIME_RL_KERNEL=1`` makes this the
  default when the flag is absent (:func:`rl_kernel_vime.hooks.linear_logp_provider_path`).
* ``--selected-logprob-provider rl_kernel_vime.provider.provider``
  (``--selected-logprob-provider-mode auto|strict``):
  ``vime/backends/megatron_utils/selected_logprob_provider.py`` as at RL-Align/vime commit
  e0d231806e06a3000b9ba4f5be4bd7ba235dfcdc. vime passes a flat ``SelectedLogprobRequest`` (CP rows
  in ``context_parallel``; optional ``hidden``, ``lm_head_weight``, ``lm_head_bias``,
  ``vocab_start_index``, ``global_vocab_size``, ``real_vocab_size``) and takes back an object
  with ``selected_logprobs [T, 1]``. Earlier commits of that module without the structural fields
  (ec2dda81) are served through the logits.

This module maps a request to one public op and holds no formula:

* with hidden states and the LM-head shard ``weight [V_local, H]`` (and ``bias``): one
  ``rl_kernel_core.linear_logprob`` call on ``softmax((hidden @ weight.T + bias) / temperature)``
  with ``tp_group`` = vime's tensor-parallel group, never materialising logits;
* otherwise: ``rl_kernel_core.logprob_from_logits`` on ``request.logits [T, V]`` as given (vime
  divides them by the rollout temperature before building either request, and its native
  function scores them as they are), one tensor-parallel rank only.

Both score the padded vocabulary, as vime's native function does (``real_vocab_size`` is
recorded, not used to mask). Context parallelism is row ownership: every row is scored on its
own, so any layout is served; it is recorded in the provenance.

vime accepts a structural result and recognises "unavailable" by an exception attribute, so the
provider never imports vime: it returns :class:`LinearLogpResult` or :class:`SelectedLogprobResult`
(this module's, with vime's field names) and raises :class:`ProviderUnavailable` (which carries
both boundaries' markers) for what the ops cannot serve: vime then runs its native function
(``auto``, with its warning) or stops with ``... provider 'rl_kernel_vime.provider.provider' is
unavailable: rl_kernel_vime: <reason>`` (``strict``). Under ``VIME_RL_KERNEL_STRICT=1`` the
provider raises :class:`rl_kernel_vime.fallback.FallbackError` instead, which vime never falls back
from. Not served: the rollout top-p replay mask (``log_prob_keep_mask``), per-row temperatures that
differ, vocab-parallel logits without hidden states, a vocabulary shard that is not rank ``r``'s
contiguous ``[r * V_local, (r + 1) * V_local)`` of equal shards. A malformed request (a field
missing, of the wrong type or shape, a temperature that is not a finite number in the ops' range)
raises ``TypeError``/``ValueError`` naming the field, which vime never hides either.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

import rl_kernel_core as rk
from rl_kernel_core import _checks, contract, dispatch
from rl_kernel_vime import config, fallback, layout, registry, timing

BACKEND_PREFIX = "rl_kernel:"
LINEAR_LOGP = "linear_logp"
"""The ``--linear-logp-provider`` boundary (``LinearLogpRequest``)."""
SELECTED_LOGPROB = "selected_logprob"
"""The ``--selected-logprob-provider`` boundary (``SelectedLogprobRequest``)."""
LAYOUTS = ("single", "zigzag", "allgather")


class ProviderUnavailable(RuntimeError):
    """The request needs something rl-kernel's ops do not serve (the message says what).

    vime recognises it without importing this class, by the attribute its boundary checks:
    ``linear_logp_provider_unavailable`` (``--linear-logp-provider``) or
    ``selected_logprob_provider_unavailable`` (``--selected-logprob-provider``)."""

    linear_logp_provider_unavailable = True
    selected_logprob_provider_unavailable = True


@dataclass(frozen=True)
class LinearLogpResult:
    """The answer to a ``LinearLogpRequest``, with the fields of vime's class of that name."""

    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SelectedLogprobResult:
    """The answer to a ``SelectedLogprobRequest``, with the fields of vime's class of that name."""

    selected_logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any] = field(default_factory=dict)


_RESULTS: dict[str, tuple[type, str]] = {
    LINEAR_LOGP: (LinearLogpResult, "logp"),
    SELECTED_LOGPROB: (SelectedLogprobResult, "selected_logprobs"),
}
"""Each boundary's result class and the name of its log-prob field."""


class _Unavailable(Exception):
    """A request the ops cannot serve; :func:`provider` turns it into vime's signal."""


_MISSING = object()


def _need(owner: Any, path: str, expected: str) -> Any:
    """``owner``'s field named by the last part of ``path``; a clear error when it has none."""
    value = getattr(owner, path.rpartition(".")[2], _MISSING)
    if value is _MISSING:
        raise TypeError(f"{path} is missing: expected {expected}, got a {type(owner).__name__} without it")
    return value


def _tensor(value: Any, path: str, expected: str, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{path} must be {expected}, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{path} must be {expected}, got shape {tuple(value.shape)}")
    return value


def _flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{path} must be a bool, got {type(value).__name__}")
    return value


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{path} must be an int >= {minimum}, got {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{path} must be an int >= {minimum}, got {int(value)}")
    return int(value)


def _optional_int(value: Any, path: str, minimum: int) -> Optional[int]:
    return None if value is None else _int(value, path, minimum)


def _temperatures(value: Any, rows: int) -> Optional[torch.Tensor]:
    """vime's ``float | Tensor[1] | Tensor[T] | None`` temperature, checked: each entry a finite
    number > 0 in the range the ops take (``rl_kernel_core._checks.temperature``). Returns the
    entries (fp64, host; one read-back for a tensor), or None when there is none to apply (no
    temperature, or an empty one for no rows)."""
    path = "request.temperature"
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ValueError(f"{path} must be a tensor with values, got a meta tensor (its values cannot be read)")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{path} must be a real-valued tensor, got dtype {value.dtype}")
        if value.numel() not in (1, rows):
            raise ValueError(
                f"{path} must hold 1 or T={rows} entries, got {value.numel()} (shape {tuple(value.shape)})"
            )
        if value.numel() == 0:  # T = 0: no row is divided
            return None
        entries = value.detach().reshape(-1).to(device="cpu", dtype=torch.float64)

        def where(i: int) -> str:
            return f"{path}[{i}]" if entries.numel() > 1 else path

        ok = torch.isfinite(entries) & (entries > 0)
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0, 0])
            raise ValueError(f"{where(i)} must be a finite number > 0, got {entries[i].item()!r}")
        for i in sorted({int(entries.argmin()), int(entries.argmax())}):  # the ops' range, at its extremes
            _checks.temperature(where(i), entries[i].item())
        return entries
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{path} must be a number, a tensor or None, got {type(value).__name__}")
    number = int(value) if isinstance(value, numbers.Integral) else float(value)
    return torch.tensor([_checks.temperature(path, number)], dtype=torch.float64)


@dataclass(frozen=True)
class _Head:
    """Hidden states and the LM-head shard, with the vocabulary slice the request declares."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    start: int
    padded: Optional[int]
    real: Optional[int]
    record: dict[str, Any]
    """The vocabulary fields as the request names them (provenance)."""


@dataclass(frozen=True)
class _Request:
    """Either boundary's request, read and checked once."""

    boundary: str
    logits: torch.Tensor
    target_ids: torch.Tensor
    tp_group: Any
    cp_field: str
    cp: dict[str, Any]
    with_entropy: bool
    with_entropy_grad: bool
    keep_mask: Any
    temperatures: Optional[torch.Tensor]
    head: Optional[_Head]


def _cp_layout(request: Any, name: str, kind: str) -> dict[str, Any]:
    cp = _need(request, f"request.{name}", f"vime's {kind} (world_size, rank, layout)")
    world = _int(_need(cp, f"request.{name}.world_size", "an int >= 1"), f"request.{name}.world_size", 1)
    rank = _int(_need(cp, f"request.{name}.rank", f"an int in [0, {world})"), f"request.{name}.rank", 0)
    if rank >= world:
        raise ValueError(f"request.{name}.rank must be in [0, world_size={world}), got {rank}")
    kind_ = _need(cp, f"request.{name}.layout", f"one of {list(LAYOUTS)}")
    if kind_ not in LAYOUTS or (world == 1) != (kind_ == "single"):
        expected = "'single'" if world == 1 else "'zigzag' or 'allgather'"
        raise ValueError(f"request.{name}.layout must be {expected} for world_size={world}, got {kind_!r}")
    return {"world_size": world, "rank": rank, "layout": kind_}


def _head_tensors(
    hidden: Any, weight: Any, bias: Any, prefix: str, names: tuple[str, str, str]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    h, w, b = (f"{prefix}{n}" for n in names)
    hidden = _tensor(hidden, h, "a [T, H] float tensor", 2)
    weight = _tensor(weight, w, "a [V_local, H] float tensor (this rank's LM-head shard)", 2)
    if bias is not None:
        bias = _tensor(bias, b, "a [V_local] float tensor or None", 1)
    return hidden, weight, bias


def _linear_head(request: Any) -> Optional[_Head]:
    context = getattr(request, "context", None)  # vime's default: None
    if context is None:
        return None
    hidden = _need(context, "request.context.hidden", "a [T, H] float tensor")
    projection = _need(context, "request.context.projection", "vime's LinearProjection (weight, bias)")
    weight = _need(projection, "request.context.projection.weight", "a [V_local, H] float tensor")
    hidden, weight, bias = _head_tensors(
        hidden,
        weight,
        getattr(projection, "bias", None),
        "request.context.",
        ("hidden", "projection.weight", "projection.bias"),
    )
    part = _need(
        context,
        "request.context.vocab_partition",
        "vime's VocabPartition (local_start, local_size, real_size, padded_size)",
    )
    values = {}
    for name, minimum in (("local_start", 0), ("local_size", 1), ("real_size", 1), ("padded_size", 1)):
        path = f"request.context.vocab_partition.{name}"
        values[name] = _int(_need(part, path, f"an int >= {minimum}"), path, minimum)
    if values["local_size"] != weight.size(0):
        raise ValueError(
            f"request.context.vocab_partition.local_size must equal the LM-head shard's rows "
            f"(request.context.projection.weight {tuple(weight.shape)}), got {values['local_size']}"
        )
    return _Head(hidden, weight, bias, values["local_start"], values["padded_size"], values["real_size"], dict(values))


def _selected_head(request: Any) -> Optional[_Head]:
    hidden = getattr(request, "hidden", None)  # vime's defaults: None, None, None, 0, None, None
    weight = getattr(request, "lm_head_weight", None)
    bias = getattr(request, "lm_head_bias", None)
    if hidden is None and weight is None:
        if bias is not None:
            raise ValueError(
                "request.lm_head_bias must be None without request.hidden and request.lm_head_weight, got a value"
            )
        return None
    if hidden is None or weight is None:
        given, absent = ("hidden", "lm_head_weight") if weight is None else ("lm_head_weight", "hidden")
        raise ValueError(
            f"request.{absent} must be a tensor when request.{given} is given (they come together), got None"
        )
    hidden, weight, bias = _head_tensors(hidden, weight, bias, "request.", ("hidden", "lm_head_weight", "lm_head_bias"))
    start = _int(getattr(request, "vocab_start_index", 0), "request.vocab_start_index", 0)
    padded = _optional_int(getattr(request, "global_vocab_size", None), "request.global_vocab_size", 1)
    real = _optional_int(getattr(request, "real_vocab_size", None), "request.real_vocab_size", 1)
    record = {"vocab_start_index": start, "global_vocab_size": padded, "real_vocab_size": real}
    return _Head(hidden, weight, bias, start, padded, real, record)


def _read(request: Any) -> _Request:
    """The request's fields, each checked (``TypeError``/``ValueError`` naming it)."""
    if hasattr(request, "token_layout") or hasattr(request, "context"):
        boundary, cp_field, kind = LINEAR_LOGP, "token_layout", "TokenLayout"
    elif any(hasattr(request, name) for name in ("context_parallel", "hidden", "lm_head_weight")):
        boundary, cp_field, kind = SELECTED_LOGPROB, "context_parallel", "ContextParallelLayout"
    else:
        raise TypeError(
            "request must be vime's LinearLogpRequest (with token_layout) or SelectedLogprobRequest (with context_parallel), "
            f"got a {type(request).__name__} with neither field"
        )
    logits = _tensor(
        _need(request, "request.logits", "a [T, V_local] float tensor"),
        "request.logits",
        "a [T, V_local] float tensor",
        2,
    )
    rows = logits.size(0)
    targets = _tensor(
        _need(request, "request.target_ids", f"a [T={rows}] integer tensor"),
        "request.target_ids",
        f"a [T={rows}] integer tensor",
        1,
    )
    if targets.size(0) != rows:
        raise ValueError(
            f"request.target_ids must have T={rows} entries (one per row of request.logits), got {targets.size(0)}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"request.target_ids must be an integer tensor, got dtype {targets.dtype}")
    tp_group = _need(request, "request.tensor_parallel_group", "vime's tensor-parallel ProcessGroup or None")
    cp = _cp_layout(request, cp_field, kind)
    with_entropy = _flag(_need(request, "request.with_entropy", "a bool"), "request.with_entropy")
    with_entropy_grad = _flag(_need(request, "request.with_entropy_grad", "a bool"), "request.with_entropy_grad")
    temperatures = _temperatures(getattr(request, "temperature", None), rows)
    head = _linear_head(request) if boundary == LINEAR_LOGP else _selected_head(request)
    if head is not None and head.real is not None and head.padded is not None and head.real > head.padded:
        real, padded = (
            ("real_size", "padded_size") if boundary == LINEAR_LOGP else ("real_vocab_size", "global_vocab_size")
        )
        raise ValueError(f"{real} must be at most {padded}={head.padded} (the padded vocabulary), got {head.real}")
    return _Request(
        boundary,
        logits,
        targets,
        tp_group,
        cp_field,
        cp,
        with_entropy,
        with_entropy_grad,
        getattr(request, "log_prob_keep_mask", None),
        temperatures,
        head,
    )


def _one_temperature(temperatures: Optional[torch.Tensor]) -> float:
    """The one temperature ``linear_logprob`` takes; entries that differ are not served."""
    if temperatures is None:
        return 1.0
    if not bool((temperatures == temperatures[0]).all()):
        raise _Unavailable("per-row temperatures differ: rl_kernel_core.linear_logprob takes one temperature")
    return float(temperatures[0])


def _tp(group: Any) -> tuple[int, int]:
    """(rank, world size) of vime's tensor-parallel group; (0, 1) without one."""
    world = layout.tp_world_size(group)
    return (dist.get_rank(group) if world > 1 else 0), world


def _from_hidden(req: _Request, head: _Head, rank: int, world: int) -> tuple[str, Any, dict[str, Any]]:
    local = head.weight.size(0)
    padded = head.padded if head.padded is not None else local * world
    if head.start != rank * local or padded != local * world:
        raise _Unavailable(
            f"vocab shard [{head.start}, {head.start + local}) of {padded} is not TP rank "
            f"{rank}'s contiguous share of {world} equal shards, which rl_kernel_core.linear_logprob assumes"
        )
    temperature = _one_temperature(req.temperatures)
    out = rk.linear_logprob(
        head.hidden,
        head.weight,
        req.target_ids,
        bias=head.bias,
        temperature=temperature,
        return_entropy=req.with_entropy,
        tp_group=req.tp_group if world > 1 else None,
    )
    field_name = "vocab_partition" if req.boundary == LINEAR_LOGP else "vocab"
    facts = {
        "input": "hidden",
        "temperature": temperature,
        "input_dtype": contract.dtype_key(head.hidden.dtype),
        field_name: head.record,
    }
    return "linear_logprob", out, facts


def _from_logits(req: _Request, world: int) -> tuple[str, Any, dict[str, Any]]:
    if world > 1:
        raise _Unavailable(
            f"vocab-parallel logits (TP={world}) without hidden states: rl_kernel_core.logprob_from_logits takes no tp_group"
        )
    out = rk.logprob_from_logits(req.logits, req.target_ids, return_entropy=req.with_entropy)
    return (
        "logprob_from_logits",
        out,
        {"input": "logits", "temperature": "applied by vime", "input_dtype": contract.dtype_key(req.logits.dtype)},
    )


def _backend(op: str, rows: int) -> dict[str, Any]:
    if rows == 0:  # the op returns empty results without choosing a backend
        return {"backend": "none (no rows)", "requested": None, "skipped": {}}
    decision = dispatch.explain(op)
    return {"backend": decision.backend, "requested": decision.requested, "skipped": dict(decision.skipped)}


def provider(request: Any) -> Any:
    """vime's selected-log-prob provider, for either boundary (``--linear-logp-provider`` or
    ``--selected-logprob-provider rl_kernel_vime.provider.provider``).

    Args:
        request: vime's ``LinearLogpRequest`` or ``SelectedLogprobRequest`` (or any object with
            their fields). Both: ``logits [T, V_local]`` float (divided by the rollout temperature),
            ``target_ids [T]`` int global ids, ``tensor_parallel_group`` (a ProcessGroup or None),
            ``with_entropy``, ``with_entropy_grad`` (bools), ``log_prob_keep_mask`` (must be None),
            ``temperature`` (None, a number, or a 1- or ``[T]``-element tensor; finite, in the ops'
            range; its entries must agree where hidden states are scored), ``chunk_size`` (unused:
            the ops bound their own memory). ``LinearLogpRequest``: ``token_layout`` (CP world
            size, rank, ``single``/``zigzag``/``allgather``) and ``context`` (``hidden [T, H]``,
            ``projection.weight [V_local, H]``/``.bias``, ``vocab_partition``) or None.
            ``SelectedLogprobRequest``: ``context_parallel`` (as ``token_layout``) and, together or
            not at all, ``hidden [T, H]``, ``lm_head_weight [V_local, H]``, ``lm_head_bias``, with
            ``vocab_start_index`` (this rank's first id), ``global_vocab_size`` (the padded
            vocabulary, all shards; None: ``V_local`` times the TP size), ``real_vocab_size``.

    Returns:
        :class:`LinearLogpResult` (``logp``) or :class:`SelectedLogprobResult`
        (``selected_logprobs``), following the request: ``[T, 1]`` fp32 log-probs and ``entropy
        [T]`` fp32 (or None when not asked for; detached unless ``with_entropy_grad``), attached to
        autograd through the hidden states and LM head or the logits; ``backend_id``
        ``"rl_kernel:<backend>"`` (what :func:`rl_kernel_core.dispatch.explain` reports for this
        call), ``contract_id`` ``"rl_kernel_core.contract:logprob:<input dtype>"`` (the tolerance
        row the result obeys) and ``provenance`` (boundary, op, backend choice and skipped
        backends, input, temperature, TP rank and size, vocabulary fields, CP layout, rl-kernel
        version).

    Raises:
        ProviderUnavailable: the request needs something the ops do not serve (the message says
            what); vime falls back (``auto``) or stops (``strict``).
        rl_kernel_vime.fallback.FallbackError: the same, under ``VIME_RL_KERNEL_STRICT=1``.
        TypeError, ValueError: a malformed request (the field, what it must be and what it is), or
            malformed tensors, from the ops.
    """
    req = _read(request)
    rows = req.logits.size(0)
    rank, world = _tp(req.tp_group)
    try:
        if req.keep_mask is not None:
            raise _Unavailable(
                "rollout top-p replay (log_prob_keep_mask) is not supported: rl_kernel_core's log-prob ops take no keep mask"
            )
        with timing.region(timing.logprob_region(), req.logits.device):
            if req.head is not None:
                op, out, facts = _from_hidden(req, req.head, rank, world)
            else:
                op, out, facts = _from_logits(req, world)
    except _Unavailable as exc:
        reason = f"rl_kernel_vime: {exc}"
        registry.record_provider_call(f"unavailable: {exc}")
        if fallback.strict():
            raise fallback.FallbackError(f"{reason} ({config.STRICT_VAR}=1 forbids vime's native fallback)") from None
        raise ProviderUnavailable(reason) from None
    logp, entropy = out if req.with_entropy else (out, None)
    if entropy is not None and not req.with_entropy_grad:
        entropy = entropy.detach()
    chosen = _backend(op, rows)
    backend_id = BACKEND_PREFIX + chosen["backend"]
    registry.record_provider_call(f"{backend_id} via {op}")
    provenance = {
        "boundary": req.boundary,
        "op": op,
        **chosen,
        **facts,
        "device": str(req.logits.device),
        "tp_rank": rank,
        "tp_world_size": world,
        req.cp_field: req.cp,
        "rl_kernel_version": rk.__version__,
    }
    result_class, logp_field = _RESULTS[req.boundary]
    return result_class(
        **{logp_field: logp.unsqueeze(-1)},
        entropy=entropy,
        backend_id=backend_id,
        contract_id=f"rl_kernel_core.contract:logprob:{facts['input_dtype']}",
        provenance=provenance,
    )
