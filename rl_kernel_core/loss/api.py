"""Ratio/KL, the PPO/GRPO policy loss, and the same loss straight from hidden states.

Public ops: :func:`ratio_kl`, :func:`policy_loss`, :func:`fused_linear_policy_loss`. Each checks
its arguments (errors name the argument, what was expected and what was found), normalises
them, then runs the implementation :func:`rl_kernel_core.dispatch.select` picks. The formulas,
clamps and aggregation modes are verl 0.9.1's; ``docs/loss.md`` states them.

Backend implementation signatures (``dispatch.register(op, backend)``; every backend takes
exactly these arguments, already validated):

* ``"ratio_kl"``: ``fn(logprob, old_logprob, ref_logprob, kl_type) -> (ratio, kl)``. Tensors of
  one shape (any rank, at least one element: empty inputs never reach a backend), float dtypes; ``ref_logprob`` is never None (the op passes
  ``old_logprob`` when the caller gave none); ``kl_type`` is canonical: ``"k1"``, ``"abs"``,
  ``"k2"``, ``"k3"``, ``"k1+"``, ``"abs+"`` or ``"k3+"``. Outputs fp32 (fp64 for fp64 inputs) of
  the input shape, differentiable in ``logprob``.
* ``"policy_loss"``: ``fn(logprob, old_logprob, advantages, mask, ref_logprob, entropy,
  rollout_is_weights, settings) -> (loss, metrics)``, ``settings`` a :class:`LossSettings`. Tensors are ``[S, T]`` (S sequences of T
  tokens, S·T >= 1: empty inputs never reach a backend), float dtypes; ``mask`` bool or float;
  ``ref_logprob`` never None; ``entropy`` and ``rollout_is_weights`` may be None;
  ``settings`` validated (``kl_type`` canonical as above). ``loss`` is a 0-d fp32 (fp64 for fp64
  inputs) tensor differentiable in ``logprob`` and ``entropy``; ``metrics`` maps the names of
  :data:`METRIC_NAMES` to detached 0-d tensors, computed without a host sync.
* ``"fused_linear_policy_loss"``: ``fn(inputs, *, temperature, ignore_index, settings) -> (loss,
  metrics)``, ``inputs`` a :class:`rl_kernel_core.loss.opdef.FusedLossInputs` (``hidden [S, T, D]``,
  ``weight [V, D]``, ``targets [S, T]`` int with ids checked in range, ``bias [V]`` or None,
  per-token tensors ``[S, T]``, S·T >= 1); same outputs as ``policy_loss``,
  with the entropy of the tempered softmax always computed (metric and ``entropy_coef`` term)
  and tokens at ``ignore_index`` removed from the mask.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.loss.opdef import METRIC_NAMES, FusedLossInputs, LossSettings
from rl_kernel_core.loss import reference as _reference  # registers the torch backend
from rl_kernel_core.spans import LossSpans

__all__ = [
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "METRIC_NAMES",
    "GlobalBatch",
    "LossSettings",
    "fused_linear_policy_loss",
    "policy_loss",
    "ratio_kl",
]

KL_TYPES: dict[str, str] = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "k1+": "k1+",
    "kl+": "k1+",
    "abs+": "abs+",
    "k2+": "k2",
    "mse+": "k2",
    "k3+": "k3+",
    "low_var_kl+": "k3+",
}
"""Accepted ``kl_type`` names (verl's spellings) → the canonical name backends receive.

A ``+`` suffix keeps the estimator's value and takes k2's gradient (verl's straight-through
variant); ``k2+`` is k2 itself.
"""

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
_MASK_DTYPES: tuple[torch.dtype, ...] = (torch.bool,) + _checks.FLOAT_DTYPES


def _canonical_kl_type(kl_type: object) -> str:
    if not isinstance(kl_type, str):
        raise TypeError(f"kl_type must be a str, got {type(kl_type).__name__}")
    if kl_type.rstrip("+") == "full":
        raise ValueError(
            "kl_type='full' needs both policies' full-vocabulary distributions (logits), which per-token "
            f"log-probs do not carry (verl 0.9 does not implement it either); use one of {list(KL_TYPES)}"
        )
    return KL_TYPES[_checks.choice("kl_type", kl_type, list(KL_TYPES))]


def _check_settings(
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: Optional[float],
    kl_type: str,
    kl_coef: float,
    entropy_coef: float,
    loss_agg_mode: str,
) -> LossSettings:
    """Validate the loss settings; return them as the :class:`LossSettings` implementations take."""
    c = None
    if clip_ratio_c is not None:
        expected = "None or a finite number > 1 (dual-clip lower bound)"
        c = _checks.number("clip_ratio_c", clip_ratio_c, expected)
        if not c > 1.0:
            raise ValueError(f"clip_ratio_c must be {expected}, got {clip_ratio_c}")
    return LossSettings(
        clip_ratio_low=_checks.non_negative("clip_ratio_low", clip_ratio_low),
        clip_ratio_high=_checks.non_negative("clip_ratio_high", clip_ratio_high),
        clip_ratio_c=c,
        kl_type=_canonical_kl_type(kl_type),
        kl_coef=_checks.non_negative("kl_coef", kl_coef),
        entropy_coef=_checks.non_negative("entropy_coef", entropy_coef),
        loss_agg_mode=_checks.choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES),
    )


@dataclass(frozen=True)
class GlobalBatch:
    """Global batch quantities that make a micro-batch's aggregate a share of the whole batch's
    (verl 0.9.1's ``agg_loss`` with ``global_batch_info``), so gradients do not depend on how a
    mini-batch is split into micro-batches and data-parallel ranks.

    ``dp_size``: data-parallel ranks (>= 1). ``batch_num_tokens``: the global count of loss tokens
    (a number or 0-d tensor), needed by ``token-mean`` when ``dp_size > 1``. ``global_batch_size``:
    the global count of sequences, needed by the ``seq-mean-*`` modes when ``dp_size > 1``.
    ``loss_scale_factor``: ``seq-mean-token-sum-norm`` divides by it instead of T when set.
    """

    dp_size: int = 1
    batch_num_tokens: Any = None
    global_batch_size: Any = None
    loss_scale_factor: Optional[float] = None


def _global_normaliser(mode: str, mask: torch.Tensor, batch: GlobalBatch) -> tuple[str, Any]:
    """The aggregation mode to compute locally and the factor that turns it into ``batch``'s share."""
    if isinstance(batch.dp_size, bool) or not isinstance(batch.dp_size, int) or batch.dp_size < 1:
        raise ValueError(f"global_batch.dp_size must be an int >= 1, got {batch.dp_size!r}")
    dp_size = batch.dp_size
    if mode == "token-sum":
        return "token-sum", dp_size
    if mode == "token-mean":
        if batch.batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError(
                    "global_batch.batch_num_tokens (the global token count) is required for token-mean when dp_size > 1"
                )
            return "token-mean", 1.0
        return "token-sum", dp_size / batch.batch_num_tokens
    factor: Any = 1.0
    if batch.global_batch_size is not None:
        local_seqs = ((mask != 0).sum(dim=-1) > 0).sum()
        factor = local_seqs * dp_size / batch.global_batch_size
    elif dp_size > 1:
        raise ValueError(f"global_batch.global_batch_size is required for {mode} when dp_size > 1")
    if mode == "seq-mean-token-sum-norm" and batch.loss_scale_factor is not None:
        factor = factor * mask.shape[-1] / batch.loss_scale_factor
    return mode, factor


_AGGREGATE_METRICS = ("pg_loss", "kl_loss", "entropy")


def _scaled(
    loss: torch.Tensor, metrics: dict[str, torch.Tensor], factor: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and the aggregate metrics times ``factor`` (the other metrics are token means)."""
    return loss * factor, {
        name: value * factor if name in _AGGREGATE_METRICS else value for name, value in metrics.items()
    }


def _check_token_tensors(ref_name: str, ref: torch.Tensor, mask: object, required: dict, optional: dict) -> None:
    """Per-token tensors: float dtypes (mask bool or float), ``ref``'s shape and device."""
    for name, value in required.items():
        _checks.tensor(name, value, dtypes=_checks.FLOAT_DTYPES)
    for name, value in optional.items():
        _checks.optional_tensor(name, value, dtypes=_checks.FLOAT_DTYPES)
    mask = _checks.tensor("mask", mask, dtypes=_MASK_DTYPES)
    _checks.same_shape(ref_name, ref, mask=mask, **required, **optional)
    _checks.same_device(ref_name, ref, mask=mask, **required, **optional)
    _checks.non_negative_weights("mask", mask)


def _mask_or_spans(
    mask: Optional[torch.Tensor], loss_spans: Optional[LossSpans], ref_name: str, ref: torch.Tensor
) -> Any:
    """The dense mask: ``mask`` itself, or ``loss_spans``' as a bool tensor of ``ref``'s shape;
    exactly one of them must be given."""
    if (mask is None) == (loss_spans is None):
        raise ValueError(
            f"exactly one of mask and loss_spans must be given, got {'neither' if mask is None else 'both'}"
        )
    if loss_spans is None:
        return mask
    if not isinstance(loss_spans, LossSpans):
        raise TypeError(f"loss_spans must be a rl_kernel_core.spans.LossSpans or None, got {type(loss_spans).__name__}")
    loss_spans.check_layout(ref_name, ref, 0)
    return loss_spans.dense_mask().reshape(ref.shape)


_Compact = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    float,
]


def _compact(
    spans: LossSpans,
    mode: str,
    ignore_index: int,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprob: Optional[torch.Tensor],
    rollout_is_weights: Optional[torch.Tensor],
) -> _Compact:
    """The scored rows of a fused loss's inputs in a layout that aggregates as the dense one:
    one sequence ``[1, N_scored]`` for the token modes; ``[B, W]`` (W the most scored rows of a
    sequence, padding masked out, its targets at ``ignore_index``) for the ``seq-mean-*`` modes.
    Returns the compact hidden, targets, old_logprob, advantages, mask, ref_logprob,
    rollout_is_weights and the factor that turns the compact loss into the dense one
    (``seq-mean-token-sum-norm`` divides by the layout's T)."""
    rows = (spans.num_seqs, spans.seq_len)
    if mode in ("token-mean", "token-sum"):

        def pick(t: torch.Tensor) -> torch.Tensor:
            return spans.gather(t.reshape(*rows, *t.shape[targets.dim() :]))[None]

        mask = torch.ones((1, spans.total), dtype=torch.bool, device=hidden.device)
        compact_targets = pick(targets)
    else:

        def pick(t: torch.Tensor) -> torch.Tensor:
            return spans.gather_padded(t.reshape(*rows, *t.shape[targets.dim() :]))[0]

        mask = spans.gather_padded(targets.reshape(rows))[1]
        compact_targets = torch.where(mask, pick(targets), ignore_index)
    factor = spans.max_seqlen / max(spans.seq_len, 1) if mode == "seq-mean-token-sum-norm" else 1.0
    optional = [None if t is None else pick(t) for t in (ref_logprob, rollout_is_weights)]
    return pick(hidden), compact_targets, pick(old_logprob), pick(advantages), mask, optional[0], optional[1], factor


def _as_sequences(t: Optional[torch.Tensor], num_seqs: int, seq_len: int) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(num_seqs, seq_len)


def ratio_kl(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: Optional[torch.Tensor] = None,
    *,
    kl_type: str = "low_var_kl",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO ratio and KL estimate.

    Args:
        logprob: current policy's log-probs of the taken tokens, any shape, float dtype.
        old_logprob: behaviour (old) policy's log-probs, same shape.
        ref_logprob: reference policy's log-probs, same shape; None measures the KL against
            ``old_logprob``.
        kl_type: ``"k1"``/``"kl"`` (log-ratio), ``"abs"``, ``"k2"``/``"mse"`` (½ log-ratio²),
            ``"k3"``/``"low_var_kl"`` (``x = clamp(ref - logprob, ±20)``,
            ``clamp(eˣ - x - 1, ±10)``); a ``+`` suffix gives k2's gradient with the estimator's
            value. ``"full"`` is rejected: it needs full-vocabulary logits.
        backend: ``"auto"`` or a name from ``dispatch.BACKENDS``.

    Returns:
        ``(ratio, kl)``, fp32 (fp64 for fp64 inputs) of the input shape:
        ``ratio = exp(clamp(logprob - old_logprob, -20, 20))``, ``kl`` as above; both
        differentiable in ``logprob``.
    """
    _checks.tensor("logprob", logprob, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor("old_logprob", old_logprob, dtypes=_checks.FLOAT_DTYPES)
    _checks.optional_tensor("ref_logprob", ref_logprob, dtypes=_checks.FLOAT_DTYPES)
    _checks.same_shape("logprob", logprob, old_logprob=old_logprob, ref_logprob=ref_logprob)
    _checks.same_device("logprob", logprob, old_logprob=old_logprob, ref_logprob=ref_logprob)
    kind = _canonical_kl_type(kl_type)
    ref = old_logprob if ref_logprob is None else ref_logprob
    if logprob.numel() == 0:
        return _reference.ratio_kl(logprob, old_logprob, ref, kind)
    fn = dispatch.select("ratio_kl", backend, logprob.device, logprob, old_logprob, ref, kind)
    return fn(logprob, old_logprob, ref, kind)


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    loss_spans: Optional[LossSpans] = None,
    ref_logprob: Optional[torch.Tensor] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    kl_type: str = "low_var_kl",
    kl_coef: float = 0.0,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Optional[torch.Tensor] = None,
    global_batch: Optional[GlobalBatch] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy loss with dual clip, KL and entropy terms (verl's vanilla loss).

    Shapes: every tensor is ``[..., T]``: leading dims index sequences, the last one tokens
    (1-D input is one sequence). Float dtypes; ``mask`` bool or float (a float mask weighs
    tokens, as in verl's ``masked_sum``; weights must be >= 0: a negative or NaN weight raises
    ``ValueError`` for CPU tensors, and for GPU tensors with the switch ``RL_KERNEL_CHECK_VALUES`` on, which
    costs one host sync; unchecked on the GPU by default, where the loss never syncs).

    Per token, with ``r = exp(clamp(logprob - old_logprob, ±20))`` and ``A = advantages``::

        pg = max(-A·r, -A·clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        pg = min(pg, -A·clip_ratio_c)  where A < 0            (dual clip, when clip_ratio_c)
        pg = pg · rollout_is_weights                          (when given)

    ``loss = agg(pg) + kl_coef·agg(kl) - entropy_coef·agg(entropy)``, where ``kl`` is
    :func:`ratio_kl`'s estimate against ``ref_logprob`` (``old_logprob`` when None) and ``agg``
    is ``loss_agg_mode``: ``token-mean`` (masked sum / mask sum), ``token-sum`` (masked sum),
    ``seq-mean-token-sum`` (mean
    over non-empty sequences of their masked sums), ``seq-mean-token-mean`` (mean over non-empty
    sequences of their masked means), ``seq-mean-token-sum-norm`` (``seq-mean-token-sum`` / T).
    An empty mask (or N = 0) gives 0, not verl's 0/0.

    Args:
        mask: ``[..., T]`` bool or float, the tokens that count; or None with ``loss_spans``.
        loss_spans: a :class:`rl_kernel_core.spans.LossSpans` over the ``[B, T]`` tokens
            (leading dims flatten to B) instead of ``mask``: the same as its dense bool mask.
            Exactly one of ``mask`` and ``loss_spans``.
        clip_ratio_low, clip_ratio_high: >= 0.
        clip_ratio_c: None (no dual clip) or > 1.
        kl_type: see :func:`ratio_kl`. kl_coef, entropy_coef: >= 0; ``entropy_coef`` > 0 needs
            ``entropy``.
        global_batch: a :class:`GlobalBatch`: the loss and the aggregate metrics (``pg_loss``,
            ``kl_loss``, ``entropy``) become this micro-batch's share of the global aggregate, as
            verl computes it (``token-mean``: local masked sum times ``dp_size / batch_num_tokens``;
            ``token-sum``: times ``dp_size``; ``seq-mean-*``: local aggregate times
            ``local non-empty sequences * dp_size / global_batch_size``, ``-norm`` divided by
            ``loss_scale_factor / T`` when set). None: the aggregate over these tensors alone.
        backend: ``"auto"`` or a name from ``dispatch.BACKENDS``.

    Returns:
        ``(loss, metrics)``: ``loss`` 0-d fp32 (fp64 for fp64 inputs), differentiable in
        ``logprob`` and ``entropy``; ``metrics`` holds detached 0-d tensors (no host sync):
        ``pg_loss`` (agg(pg)), ``pg_clipfrac`` (token-mean of ``-A·clip(r) > -A·r``),
        ``pg_clipfrac_lower`` (token-mean of dual-clipped tokens; 0 without ``clip_ratio_c``),
        ``ppo_kl`` (token-mean of ``-clamp(logprob - old_logprob, ±20)``), ``kl_loss``
        (agg(kl)), ``entropy`` (agg(entropy); 0 without ``entropy``).
    """
    _checks.tensor("logprob", logprob, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    mask = _mask_or_spans(mask, loss_spans, "logprob", logprob)
    _check_token_tensors(
        "logprob",
        logprob,
        mask,
        {"old_logprob": old_logprob, "advantages": advantages},
        {"ref_logprob": ref_logprob, "entropy": entropy, "rollout_is_weights": rollout_is_weights},
    )
    settings = _check_settings(
        clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_type, kl_coef, entropy_coef, loss_agg_mode
    )
    if entropy is None and settings.entropy_coef != 0.0:
        raise ValueError(
            f"entropy must be given when entropy_coef != 0, got entropy=None with entropy_coef={entropy_coef}"
        )
    seq_len = logprob.shape[-1]
    num_seqs = math.prod(logprob.shape[:-1])
    args = [
        _as_sequences(t, num_seqs, seq_len)
        for t in (
            logprob,
            old_logprob,
            advantages,
            mask,
            old_logprob if ref_logprob is None else ref_logprob,
            entropy,
            rollout_is_weights,
        )
    ]
    factor = None
    if global_batch is not None:
        if not isinstance(global_batch, GlobalBatch):
            raise TypeError(f"global_batch must be a GlobalBatch or None, got {type(global_batch).__name__}")
        mode, factor = _global_normaliser(settings.loss_agg_mode, mask, global_batch)
        settings = dataclasses.replace(settings, loss_agg_mode=mode)
    if logprob.numel() == 0:
        loss, metrics = _reference.policy_loss(*args, settings)
    else:
        fn = dispatch.select("policy_loss", backend, logprob.device, *args, settings)
        loss, metrics = fn(*args, settings)
    if factor is None:
        return loss, metrics
    return _scaled(loss, metrics, factor)


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    loss_spans: Optional[LossSpans] = None,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    ref_logprob: Optional[torch.Tensor] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    kl_type: str = "low_var_kl",
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` with ``logprob``/``entropy`` taken from hidden states.

    Equals ``policy_loss(*linear_logprob(hidden, weight, targets, bias=bias,
    temperature=temperature, ignore_index=ignore_index, return_entropy=True), ...)`` with tokens
    at ``ignore_index`` removed from ``mask``; fast backends form the loss gradient in the pass
    that forms the logits, never holding ``[N, V]`` logits.

    Args:
        hidden: ``[..., T, D]`` float (``[T, D]`` is one sequence).
        weight: ``[V, D]`` in ``hidden``'s dtype, the LM head. bias: ``[V]`` in ``hidden``'s
            dtype, or None.
        targets: ``[..., T]`` int64/int32 token ids in ``[0, V)`` or ``ignore_index`` (checked:
            one host sync).
        old_logprob, advantages, mask, ref_logprob, rollout_is_weights: ``[..., T]`` as in
            :func:`policy_loss`.
        loss_spans: a :class:`rl_kernel_core.spans.LossSpans` over the ``[B, T]`` tokens instead
            of ``mask`` (exactly one of them): only the scored rows' hidden states reach the LM
            head (gathered into ``[1, N_scored, D]`` for the token modes, into ``[B, W, D]``, W
            the most scored rows of a sequence, for the ``seq-mean-*`` modes), their targets
            alone are read, and the gradient reaches exactly those rows of ``hidden``. Equal to
            the dense path with the spans' bool mask within the numerical contract.
        temperature: a number in ``[2**-126, 2**126]`` (about 1.18e-38 to 8.51e37, so that it and
            ``1 / temperature`` are normal fp32 numbers); logits are divided by it.
        ignore_index: an int64.
        Other knobs: as in :func:`policy_loss`; the entropy term uses the softmax's entropy.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`; ``loss`` is differentiable in ``hidden``,
        ``weight`` and ``bias``.
    """
    _checks.lm_head_inputs(hidden, weight, bias, targets, min_ndim=2, vocab_name="V")
    dim = hidden.shape[-1]
    vocab = weight.shape[0]
    _check_token_tensors(
        "targets",
        targets,
        _mask_or_spans(mask, loss_spans, "targets", targets),
        {"old_logprob": old_logprob, "advantages": advantages},
        {"ref_logprob": ref_logprob, "rollout_is_weights": rollout_is_weights},
    )
    temperature = _checks.temperature("temperature", temperature)
    _checks.int64("ignore_index", ignore_index)
    settings = _check_settings(
        clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_type, kl_coef, entropy_coef, loss_agg_mode
    )
    factor = 1.0
    if loss_spans is not None:
        hidden, targets, old_logprob, advantages, mask, ref_logprob, rollout_is_weights, factor = _compact(
            loss_spans,
            settings.loss_agg_mode,
            ignore_index,
            hidden,
            targets,
            old_logprob,
            advantages,
            ref_logprob,
            rollout_is_weights,
        )
    assert mask is not None
    _checks.target_ids("targets", targets, vocab, ignore_index)
    seq_len = targets.shape[-1]
    num_seqs = math.prod(targets.shape[:-1])
    shape = (num_seqs, seq_len)
    inputs = FusedLossInputs(
        hidden.reshape(*shape, dim),
        weight,
        targets.reshape(shape),
        old_logprob.reshape(shape),
        advantages.reshape(shape),
        mask.reshape(shape),
        bias,
        (old_logprob if ref_logprob is None else ref_logprob).reshape(shape),
        _as_sequences(rollout_is_weights, num_seqs, seq_len),
    )
    kwargs = {"temperature": temperature, "ignore_index": ignore_index, "settings": settings}
    # no token: the reference's empty sums, whatever backend was asked for
    chosen = "torch" if targets.numel() == 0 else backend
    loss, metrics = dispatch.select("fused_linear_policy_loss", chosen, hidden.device, inputs, **kwargs)(
        inputs, **kwargs
    )
    if factor == 1.0:
        return loss, metrics
    return _scaled(loss, metrics, factor)
