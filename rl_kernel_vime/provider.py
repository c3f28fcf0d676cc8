"""rl-kernel behind vime's provider boundary for selected log-probs.

vime (since its pull requests 423/424; the boundary this follows is
``vime/backends/megatron_utils/linear_logp_provider.py`` at RL-Align/vime commit
33254c738f1d43250916ae6887f7981e77dbe411) computes the actor's log-probs through an optional
provider named on its command line::

    --linear-logp-provider rl_kernel_vime.provider.provider
    --linear-logp-provider-mode auto      # or strict

``VIME_RL_KERNEL=1`` makes :func:`provider` vime's default when that flag is absent (see
:func:`rl_kernel_vime.hooks.linear_logp_provider_path`). vime calls ``provider(request)`` with a
``LinearLogpRequest`` and takes back a ``LinearLogpResult``; this module maps one to the other
and holds no formula:

* with a hidden-state context (``request.context``: ``hidden [T, H]``, the LM-head shard
  ``weight [V_local, H]`` and ``bias [V_local]``, its ``vocab_partition``): one
  ``rl_kernel_core.linear_logprob`` call on ``softmax((hidden @ weight.T + bias) / temperature)``
  with ``tp_group`` = vime's tensor-parallel group, never materialising logits;
* otherwise: ``rl_kernel_core.logprob_from_logits`` on ``request.logits [T, V]`` as given (vime
  divides them by the rollout temperature before building the request, and its native function
  scores them as they are), one tensor-parallel rank only.

Context parallelism is row ownership (``request.token_layout``): every row is scored on its own,
so any layout is served; it is recorded in the provenance. What the ops cannot serve raises
vime's ``LinearLogpProviderUnavailable`` with the reason in one line: vime then runs its native
function (``auto``, with its warning) or stops with ``linear_logp provider
'rl_kernel_vime.provider.provider' is unavailable: <reason>`` (``strict``). Under
``VIME_RL_KERNEL_STRICT=1`` the provider raises
:class:`rl_kernel_vime.fallback.FallbackError` instead, which vime never falls back from. Not
served: the rollout top-p replay mask (``log_prob_keep_mask``), per-row temperatures that
differ, vocab-parallel logits without hidden states, a vocabulary shard that is not rank
``r``'s contiguous ``[r * V_local, (r + 1) * V_local)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

import rl_kernel_core as rk
from rl_kernel_core import adapters, contract, dispatch
from rl_kernel_vime import config, fallback, layout, registry, targets, timing

BACKEND_PREFIX = "rl_kernel:"


class _Unavailable(Exception):
    """A request the ops cannot serve; :func:`provider` turns it into vime's signal."""


def _boundary(name: str) -> Any:
    return adapters.resolve(f"{targets.PROVIDER_BOUNDARY}:{name}")


def _scalar_temperature(temperature: Any) -> float:
    """vime's ``float | Tensor[1] | Tensor[T] | None`` temperature as the one number the op takes.

    A tensor is read back to the host, its entries checked to agree (one sync)."""
    if temperature is None:
        return 1.0
    if not isinstance(temperature, torch.Tensor):
        return float(temperature)
    flat = temperature.reshape(-1)
    if flat.numel() == 0:  # no rows: nothing is divided
        return 1.0
    if not bool((flat == flat[0]).all()):
        raise _Unavailable("per-row temperatures differ: rl_kernel_core.linear_logprob takes one temperature")
    return float(flat[0])


def _tp(group: Any) -> tuple[int, int]:
    """(rank, world size) of vime's tensor-parallel group; (0, 1) without one."""
    world = layout.tp_world_size(group)
    return (dist.get_rank(group) if world > 1 else 0), world


def _from_hidden(request: Any, rank: int, world: int) -> tuple[str, Any, dict[str, Any]]:
    context = request.context
    part = context.vocab_partition
    local = context.projection.weight.size(0)
    if part.local_start != rank * local or part.padded_size != local * world:
        raise _Unavailable(
            f"vocab shard [{part.local_start}, {part.local_start + part.local_size}) of {part.padded_size} is not TP rank "
            f"{rank}'s contiguous share of {world} equal shards, which rl_kernel_core.linear_logprob assumes"
        )
    temperature = _scalar_temperature(request.temperature)
    out = rk.linear_logprob(
        context.hidden, context.projection.weight, request.target_ids, bias=context.projection.bias,
        temperature=temperature, return_entropy=request.with_entropy, tp_group=request.tensor_parallel_group if world > 1 else None,
    )
    facts = {
        "input": "hidden", "temperature": temperature, "input_dtype": contract.dtype_key(context.hidden.dtype),
        "vocab_partition": {"local_start": part.local_start, "local_size": part.local_size, "real_size": part.real_size, "padded_size": part.padded_size},
    }
    return "linear_logprob", out, facts


def _from_logits(request: Any, world: int) -> tuple[str, Any, dict[str, Any]]:
    if world > 1:
        raise _Unavailable(f"vocab-parallel logits (TP={world}) without hidden states: rl_kernel_core.logprob_from_logits takes no tp_group")
    out = rk.logprob_from_logits(request.logits, request.target_ids, return_entropy=request.with_entropy)
    return "logprob_from_logits", out, {"input": "logits", "temperature": "applied by vime", "input_dtype": contract.dtype_key(request.logits.dtype)}


def _backend(op: str, rows: int) -> dict[str, Any]:
    if rows == 0:  # the op returns empty results without choosing a backend
        return {"backend": "none (no rows)", "requested": None, "skipped": {}}
    decision = dispatch.explain(op)
    return {"backend": decision.backend, "requested": decision.requested, "skipped": dict(decision.skipped)}


def provider(request: Any) -> Any:
    """vime's ``linear_logp`` provider (``--linear-logp-provider rl_kernel_vime.provider.provider``).

    Args:
        request: vime's ``LinearLogpRequest``: ``logits [T, V_local]`` float, ``target_ids [T]``
            int global ids, ``tensor_parallel_group`` (a ProcessGroup or None), ``token_layout``
            (CP world size, rank, ``single``/``zigzag``/``allgather``), ``with_entropy``,
            ``with_entropy_grad``, ``chunk_size`` (unused: the ops bound their own memory),
            ``log_prob_keep_mask`` (must be None), ``context`` (hidden states and LM-head shard,
            or None), ``temperature`` (None, a number, or a 1- or ``[T]``-element tensor whose
            entries agree), ``metadata``.

    Returns:
        vime's ``LinearLogpResult``: ``logp [T, 1]`` fp32 and ``entropy [T]`` fp32 (or None when
        not asked for; detached unless ``with_entropy_grad``), attached to autograd through
        ``hidden``/``weight``/``bias`` or ``logits``; ``backend_id`` ``"rl_kernel:<backend>"``
        (the backend :func:`rl_kernel_core.dispatch.explain` reports for this call),
        ``contract_id`` ``"rl_kernel_core.contract:logprob:<input dtype>"`` (the tolerance row
        the result obeys) and ``provenance`` (op, backend choice and skipped backends, input,
        temperature, TP rank and size, vocab partition, CP layout, rl-kernel version).

    Raises:
        vime's ``LinearLogpProviderUnavailable``: the request needs something the ops do not
            serve (the message says what); vime falls back (``auto``) or stops (``strict``).
        rl_kernel_vime.fallback.FallbackError: the same, under ``VIME_RL_KERNEL_STRICT=1``.
        ValueError, TypeError: malformed tensors, from the ops (named argument, expected, found).
    """
    rows = request.logits.size(0)
    rank, world = _tp(request.tensor_parallel_group)
    try:
        if request.log_prob_keep_mask is not None:
            raise _Unavailable("rollout top-p replay (log_prob_keep_mask) is not supported: rl_kernel_core's log-prob ops take no keep mask")
        device = request.logits.device
        with timing.region(timing.logprob_region(), device):
            if request.context is not None:
                op, out, facts = _from_hidden(request, rank, world)
            else:
                op, out, facts = _from_logits(request, world)
    except _Unavailable as exc:
        reason = f"rl_kernel_vime: {exc}"
        registry.record_provider_call(f"unavailable: {exc}")
        if fallback.strict():
            raise fallback.FallbackError(f"{reason} ({config.STRICT_VAR}=1 forbids vime's native fallback)") from None
        raise _boundary("LinearLogpProviderUnavailable")(reason) from None
    logp, entropy = out if request.with_entropy else (out, None)
    if entropy is not None and not request.with_entropy_grad:
        entropy = entropy.detach()
    chosen = _backend(op, rows)
    backend_id = BACKEND_PREFIX + chosen["backend"]
    registry.record_provider_call(f"{backend_id} via {op}")
    cp = request.token_layout
    provenance = {
        "op": op, **chosen, **facts, "device": str(request.logits.device), "tp_rank": rank, "tp_world_size": world,
        "token_layout": {"world_size": cp.world_size, "rank": cp.rank, "layout": cp.layout},
        "rl_kernel_version": rk.__version__,
    }
    return _boundary("LinearLogpResult")(
        logp=logp.unsqueeze(-1), entropy=entropy, backend_id=backend_id,
        contract_id=f"rl_kernel_core.contract:logprob:{facts['input_dtype']}", provenance=provenance,
    )

