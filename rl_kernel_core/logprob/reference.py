"""Plain-PyTorch reference of ``logprob_from_logits`` (backend ``torch``), and the row math every
log-prob reference shares (:mod:`rl_kernel_core.linear.reference` builds ``linear_logprob`` on it).

The math, stated once. For one row with scaled logits ``z = logits / T`` over the vocab:

* forward:  ``m = max z``, ``s = sum exp(z - m)``, ``lse = m + log s``,
  ``logprob = z[t] - lse``, ``entropy = log s - sum exp(z - m) (z - m) / s``
  (``= lse - sum p z``, computed shift-invariantly).
* backward: with ``p = exp(z - lse)`` and upstream gradients ``g`` (log-prob) and ``e`` (entropy),
  ``dL/dz = g (onehot(t) - p) - e p (log p + entropy)``
  (``dH/dz_j = -p_j (z_j - sum_k p_k z_k)`` and ``z_j - sum_k p_k z_k = log p_j + H``);
  ``dL/dlogits = dL/dz / T``.

Memory: tokens are processed in chunks of ``max(1, CHUNK_ELEMENTS // V)`` rows, so at most one
chunk of ``[rows, V]`` logits (plus one same-sized work buffer) is alive at a time, whatever N.
The forward saves only its inputs and two ``[N]`` row statistics (``lse``, ``entropy``); the
backward recomputes each chunk's scaled logits. Accumulation is fp32 (fp64 for fp64 inputs): each
chunk is upcast on its own. Gradients come back in their inputs' dtypes.

Deterministic: the chunk size is a constant and every reduction runs in a fixed order, so the same
inputs on the same machine give the same bits run to run. ``logprob_from_logits`` reduces each row
on its own, so a row's bits do not depend on N.
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.opdef import single_backward

CHUNK_ELEMENTS: int = 1 << 22
"""Logit elements per chunk (16 MiB in fp32): rows per chunk = ``max(1, CHUNK_ELEMENTS // V)``."""


def rows_per_chunk(vocab: int) -> int:
    """Token rows processed at once for a (local) vocab of ``vocab`` entries."""
    return max(1, CHUNK_ELEMENTS // vocab)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _local_targets(
    targets: torch.Tensor, ignore_index: int, offset: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid rows, rows whose target lies in this shard, shard-local ids clamped into range)."""
    t = targets.long()
    valid = t != ignore_index
    local = t - offset
    owned = valid & (local >= 0) & (local < vocab)
    return valid, owned, torch.where(owned, local, torch.zeros_like(local))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Clamp -inf (masked logits) to the lowest finite value, in place, so that 0 * x stays 0."""
    return x.clamp_(min=torch.finfo(x.dtype).min)


def _chunk_stats(z: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor, want_entropy: bool) -> torch.Tensor:
    """Row statistics of scaled logits ``z`` [r, V] (overwritten): [4, r] = (m, s, z_t, a).

    ``m = max z``, ``s = sum exp(z - m)``, ``z_t`` the target logit (0 where not owned),
    ``a = sum exp(z - m) (z - m)`` (0 unless ``want_entropy``).
    """
    m = z.amax(dim=1)
    zt = torch.where(owned, z.gather(1, local_t.unsqueeze(1)).squeeze(1), torch.zeros_like(m))
    # a shard whose logits are all -inf (vocab parallel) gives s = 0 relative to 0, not NaN
    zs = z.sub_(torch.where(m == float("-inf"), torch.zeros_like(m), m).unsqueeze(1))
    if want_entropy:
        e = torch.exp(zs)
        s = e.sum(dim=1)
        a = e.mul_(_finite(zs)).sum(dim=1)  # a -inf logit adds exp(-inf) * finite = 0, not nan
    else:
        s = zs.exp_().sum(dim=1)
        a = torch.zeros_like(m)
    return torch.stack((m, s, zt, a))


def _finish(
    stats: torch.Tensor, valid: torch.Tensor, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(logprob, lse, entropy or None) from merged statistics [4, N]; ignored rows give 0."""
    m, s, zt, a = stats.unbind(0)
    log_s = torch.log(s)
    lse = m + log_s
    zero = torch.zeros_like(lse)
    logprob = torch.where(valid, (zt - m) - log_s, zero)
    entropy = torch.where(valid, log_s - a / s, zero) if want_entropy else None
    return logprob, lse, entropy


def _chunk_grad(
    z: torch.Tensor,
    rows: slice,
    lse: torch.Tensor,
    entropy: Optional[torch.Tensor],
    local_t: torch.Tensor,
    owned: torch.Tensor,
    g_lp: Optional[torch.Tensor],
    g_ent: Optional[torch.Tensor],
    temperature: float,
) -> torch.Tensor:
    """dL/d(unscaled logits) for the chunk ``rows`` of the ``[N]`` vectors, from its scaled logits
    ``z`` [r, V] (overwritten).

    ``g_lp``/``g_ent`` [N] are already zero on ignored rows.
    """
    lse, local_t, owned = lse[rows], local_t[rows], owned[rows]
    entropy, g_lp, g_ent = (None if t is None else t[rows] for t in (entropy, g_lp, g_ent))
    logp = z.sub_(lse.unsqueeze(1))
    p = torch.exp(logp)
    ent_term = None
    if g_ent is not None and entropy is not None:  # -e p (log p + H), formed in the log p buffer
        ent_term = _finite(logp).add_(entropy.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))
    if g_lp is None:
        assert ent_term is not None, "a chunk's gradient needs grad_logprob or grad_entropy"
        grad = ent_term
    else:
        grad = p.mul_(-g_lp.unsqueeze(1))
        grad.scatter_add_(1, local_t.unsqueeze(1), torch.where(owned, g_lp, torch.zeros_like(g_lp)).unsqueeze(1))
        if ent_term is not None:
            grad.add_(ent_term)
    return _scale(grad, temperature)


def _upstream(g: Optional[torch.Tensor], valid: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    if g is None:
        return None
    return torch.where(valid, g.to(dtype), torch.zeros((), dtype=dtype, device=g.device))


def _scale(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z / temperature`` in place (dividing by 1 is exact, so it is skipped)."""
    return z if temperature == 1.0 else z.div_(temperature)


class _LogprobFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, ignore_index, return_entropy):
        acc = _acc_dtype(logits.dtype)
        n, vocab = logits.shape
        valid, owned, local_t = _local_targets(targets, ignore_index, 0, vocab)
        stats = torch.empty(4, n, dtype=acc, device=logits.device)
        step = rows_per_chunk(vocab)
        for i in range(0, n, step):
            z = _scale(logits[i : i + step].to(acc, copy=True), temperature)
            stats[:, i : i + step] = _chunk_stats(z, local_t[i : i + step], owned[i : i + step], return_entropy)
            del z
        logprob, lse, entropy = _finish(stats, valid, return_entropy)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    @single_backward("logprob_from_logits (torch backend)")
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, entropy = ctx.saved_tensors
        acc = lse.dtype
        n, vocab = logits.shape
        valid, owned, local_t = _local_targets(targets, ctx.ignore_index, 0, vocab)
        g_lp = _upstream(g_lp, valid, acc)
        g_ent = _upstream(g_ent, valid, acc) if entropy is not None else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        step = rows_per_chunk(vocab)
        for i in range(0, n, step):
            sl = slice(i, i + step)
            z = _scale(logits[sl].to(acc, copy=True), ctx.temperature)
            dl = _chunk_grad(z, sl, lse, entropy, local_t, owned, g_lp, g_ent, ctx.temperature)
            grad[sl].copy_(dl)
            del z, dl
        return grad, None, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """fp32 ``[r]`` log-probs of ``tokens [r]`` under ``logits [r, V]`` (fp32/bf16/fp16), row ``i``
    at temperature ``temperatures[i]``: the scaling and formula of :func:`logprob_from_logits_torch`
    row by row, so each value has its bits (for that row at that temperature)."""
    z = logits.to(torch.float32, copy=True)
    for row, temperature in zip(z, temperatures):
        _scale(row, temperature)
    every = torch.ones_like(tokens, dtype=torch.bool)
    return _finish(_chunk_stats(z, tokens, every, False), every, False)[0]


@dispatch.register("logprob_from_logits", "torch")
def logprob_from_logits_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference ``logprob_from_logits`` on validated 2-D inputs: ``(logprob[N], entropy[N] or None)``.

    ``logits [N, V]`` any float dtype, ``targets [N]`` int64/int32. Each row-chunk is upcast on its
    own; the gradient w.r.t. ``logits`` comes back in ``logits``' dtype.
    """
    return _LogprobFromLogits.apply(logits, targets, temperature, ignore_index, return_entropy)
