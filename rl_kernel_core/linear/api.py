"""Per-token log-probs (and entropies) from hidden states: the public :func:`linear_logprob`.

It validates its arguments, flattens the leading dims to N rows (making the inputs contiguous, so
strided inputs give the same bits as contiguous ones), returns empty results for N = 0 without
calling a backend, and otherwise runs the implementation chosen by
:func:`rl_kernel_core.dispatch.select`.

Backend contract (what ``@dispatch.register("linear_logprob", backend)`` implementations receive;
arguments are already validated, tensors are on one device and contiguous)::

    impl(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, tp_group)
        -> (logprob [N], entropy [N] or None)

    hidden  [N, D]        float32 / bfloat16 / float16 / float64, N >= 1
    weight  [V_local, D]  hidden's dtype (this rank's contiguous vocab shard under tp_group)
    targets [N]           int64 or int32 global ids, each in [0, V) or == ignore_index
    bias    [V_local]     hidden's dtype, or None
    temperature float > 0, ignore_index int, return_entropy bool,
    tp_group  a torch.distributed ProcessGroup or None

The rest of the contract (output dtypes, autograd, ignored rows, ``-inf`` logits) is
``logprob_from_logits``' (:mod:`rl_kernel_core.logprob.api`).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.linear import reference as _reference  # noqa: F401  (registers the torch backend)
from rl_kernel_core.logprob.api import Result, _empty, _out_dtype, _pack, _scalars
from rl_kernel_core.spans import LossSpans


def _tp_world(tp_group) -> int:
    if tp_group is None:
        return 1
    if not torch.distributed.is_available():
        raise ValueError("tp_group needs torch.distributed, which this torch build lacks")
    if not isinstance(tp_group, torch.distributed.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed.ProcessGroup or None, got {type(tp_group).__name__}")
    if not torch.distributed.is_initialized():
        raise ValueError("tp_group needs an initialised torch.distributed default process group, found none")
    return torch.distributed.get_world_size(tp_group)


def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    tp_group: Optional["torch.distributed.ProcessGroup"] = None,
    loss_spans: Optional[LossSpans] = None,
    backend: Optional[str] = "auto",
) -> Result:
    """Log-probability of ``targets`` (and entropy) under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Never materialises the ``[N, V]`` logits: extra memory is bounded by a fixed chunk whatever N.
    With ``loss_spans`` only the scored rows reach the LM head.

    Args:
        hidden: ``[..., D]`` float32/bfloat16/float16/float64 hidden states; leading dims flatten to N.
        weight: ``[V_local, D]`` output-projection weight in ``hidden``'s dtype (the LM head). With
            ``tp_group`` it is this rank's contiguous vocab shard: rank ``r`` owns global ids
            ``[r * V_local, (r + 1) * V_local)``.
        targets: ``[...]`` (``hidden``'s leading shape) int64/int32 global token ids in ``[0, V)``,
            or ``ignore_index``.
        bias: ``[V_local]`` in ``hidden``'s dtype, or None; ``-inf`` entries mask those tokens out
            (probability 0, gradient 0).
        temperature: a number >= the smallest normal fp32 (about 1.18e-38, so that
            ``1 / temperature`` is finite in fp32; whatever the dtype) dividing the logits.
        ignore_index: an int64; rows whose target equals it give 0 log-prob, 0 entropy and no gradient.
        return_entropy: also return the entropy of the tempered distribution.
        tp_group: vocab-parallel process group, or None. Every rank passes the same ``hidden`` and
            ``targets`` and gets the same (replicated) results; upstream gradients must match too.
        loss_spans: a :class:`rl_kernel_core.spans.LossSpans` over ``targets`` as ``[B, T]``
            (leading dims flatten to B), on ``hidden``'s device, or None (every row). With it,
            the scored rows are gathered into a compact ``[N_scored, D]`` and only they are
            scored: rows outside the spans give 0 log-prob, 0 entropy and no gradient (as rows at
            ``ignore_index`` do), and their targets are not read. Each scored row's values have
            the same bits as without spans (a row never depends on the others).
        backend: ``"auto"`` (or None; ``RL_KERNEL_BACKEND=<name>`` makes ``auto`` mean that
            backend), ``"native"``, ``"triton"`` or ``"torch"``; see :mod:`rl_kernel_core.dispatch`.

    Returns:
        ``logprob`` with ``targets``' shape, fp32 (fp64 for fp64 inputs); or ``(logprob, entropy)``
        when ``return_entropy``. Differentiable w.r.t. ``hidden``, ``weight`` and ``bias`` through
        both; gradients come back in the inputs' dtype.

    Raises:
        TypeError: a wrong type or dtype (names the argument, expected and found).
        ValueError: a wrong shape, device, target id, temperature or an empty vocab/hidden dim.
        rl_kernel_core.BackendUnavailableError: an explicit ``backend`` cannot run these inputs.
    """
    _checks.lm_head_inputs(hidden, weight, bias, targets, min_ndim=1, vocab_name="V_local")
    d = hidden.shape[-1]
    temperature = _scalars(temperature, ignore_index, return_entropy)
    world = _tp_world(tp_group)
    if loss_spans is not None:
        return _on_spans(
            loss_spans,
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            tp_group=tp_group,
            backend=backend,
        )
    _checks.target_ids("targets", targets, weight.shape[0] * world, ignore_index)

    if targets.numel() == 0:
        out = _out_dtype(hidden.dtype)
        return _pack(
            _empty(targets.shape, out, hidden, weight, bias),
            _empty(targets.shape, out, hidden, weight, bias),
            targets.shape,
            return_entropy,
        )
    h2d = hidden.reshape(-1, d).contiguous()
    t1d = targets.reshape(-1).contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    impl = dispatch.select(
        "linear_logprob",
        backend,
        hidden.device,
        h2d,
        weight,
        t1d,
        bias,
        temperature,
        ignore_index,
        return_entropy,
        tp_group,
    )
    logprob, entropy = impl(h2d, weight, t1d, bias, temperature, ignore_index, return_entropy, tp_group)
    return _pack(logprob, entropy, targets.shape, return_entropy)


def _on_spans(
    spans: LossSpans,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    return_entropy: bool,
    **kwargs,
) -> Result:
    """:func:`linear_logprob` of the rows ``spans`` selects, scattered back to ``targets``' shape."""
    if not isinstance(spans, LossSpans):
        raise TypeError(f"loss_spans must be a rl_kernel_core.spans.LossSpans or None, got {type(spans).__name__}")
    spans.check_layout("targets", targets, 0)
    rows = (spans.num_seqs, spans.seq_len)
    out = linear_logprob(
        spans.gather(hidden.reshape(*rows, hidden.shape[-1])),
        weight,
        spans.gather(targets.reshape(rows)),
        return_entropy=return_entropy,
        **kwargs,
    )
    if not return_entropy:
        assert isinstance(out, torch.Tensor)
        return spans.scatter(out).reshape(targets.shape)
    logprob, entropy = out
    return spans.scatter(logprob).reshape(targets.shape), spans.scatter(entropy).reshape(targets.shape)
