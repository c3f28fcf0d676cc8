"""Triton ``fused_linear_policy_loss``: the PPO/GRPO loss from hidden states in three matrix products.

The loss is linear in per-token terms: with ``w_i = d agg / d v_i`` the aggregation weight of
token ``i`` (a function of the mask and ``loss_agg_mode`` only, known before any logit exists),

    loss = sum_i w_i (pg_i + kl_coef kl_i - entropy_coef entropy_i)

so ``d loss / d logprob_i`` and ``d loss / d entropy_i`` depend on token ``i``'s own log-prob and
entropy and on ``w_i``, nothing global. The forward therefore runs, per fixed-size chunk of rows:

1. the chunk's logits on ``linear_logprob``'s route (``tuning().route``: ``"chunked"`` = one
   cuBLAS product into an fp32 ``[chunk, V]`` buffer; ``"gemm"`` = the Triton ``tl.dot`` pass),
   so the log-probs have ``linear_logprob``'s bits;
2. the tile-statistics pass and merge: the chunk's log-probs, entropies and ``lse``;
3. the per-token loss gradients: one launch of the Triton policy-loss backward kernel
   (:func:`rl_kernel_core.loss.triton.policy_loss_bwd`) in ``token-sum`` mode with the
   chunk's ``w`` as a float mask, which is exactly ``d loss / d logprob`` and ``d loss /
   d entropy`` (the reference's formulas, clamps and tie rules);
4. the gradient pass: ``dl = d loss / d logits`` written over the fp32 chunk in place (chunked,
   and gemm where ``LinearTuning.loss_keeps_logits_from_dim`` has the statistics pass keep the
   chunk's logits) or recomputed from ``hidden`` and ``weight`` (gemm otherwise: one more matrix
   product);
5. ``dh = dl @ W`` (fixed shape) and ``dW += dl^T @ h``.

Then the loss value and metrics come from the reference loss on the ``[N]`` log-probs and
entropies. The op is the custom op ``rl_kernel::triton_fused_linear_policy_loss`` (schemas and
autograd glue in :mod:`rl_kernel_core.loss.opdef`), which returns the gradients it formed; its
backward only scales the stored ``dh``, ``dW``, ``db`` by the upstream gradient:
three products (logits, dh, dW) where the logits are kept or chunked, four where the gradient
pass forms them again.

Memory: the chunk buffer (``tuning().chunk_bytes``, :mod:`rl_kernel_core.linear.chunks`), ``dh``
and ``dW`` in the inputs' dtypes (the gradients, kept from the forward until the backward; with
``tuning().wgrad_fp32`` ``dW`` is accumulated in fp32, ``4 V D`` bytes, during the forward).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.linear import chunks as LC
from rl_kernel_core.linear import triton_sm90
from rl_kernel_core.linear.triton import PASSES
from rl_kernel_core.linear.triton_tile import linear
from rl_kernel_core.opdef import define_differentiable_op
from rl_kernel_core.loss import opdef
from rl_kernel_core.loss.opdef import METRIC_NAMES, FusedLossInputs, LossSettings
from rl_kernel_core.loss import reference as reference
from rl_kernel_core.loss.triton import policy_loss_bwd
from rl_kernel_core.triton._jit import launch_time_jit


def _token_grads(
    lp: torch.Tensor,
    ent: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    w: torch.Tensor,
    ref: torch.Tensor,
    rw: Optional[torch.Tensor],
    token_sum: LossSettings,
    one: torch.Tensor,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fp32 ``(d loss / d logprob, d loss / d entropy or None)`` for one chunk of ``[n]`` tokens.

    ``loss = sum_i w_i term_i`` is the ``token-sum`` aggregation (``token_sum``'s mode) with
    float mask ``w``; ``one`` is the 0-d upstream gradient 1.
    """
    want_ent = token_sum.entropy_coef != 0.0
    g_lp, g_ent = policy_loss_bwd(
        one,
        lp[None],
        old[None],
        adv[None],
        w[None],
        ref[None],
        None if rw is None else rw[None],
        one,
        one,
        token_sum,
        True,
        torch.float32 if want_ent else None,
    )
    assert g_lp is not None, "asked for (need_logprob_grad=True)"
    return g_lp[0], None if g_ent is None else g_ent[0]


def _metrics_tensor(metrics: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([metrics[name].to(torch.float32) for name in METRIC_NAMES])


def _forward(hidden, weight, bias, targets, old, adv, mask_eff, ref, rw, temperature, ignore_index, *rest):
    """The forward custom op's body (schema :data:`rl_kernel_core.loss.opdef.FUSED_LOSS_SCHEMA`):
    ``(loss, metrics [6], dh, dW, db)``, a gradient not asked for ``[0]``."""
    *settings_args, need_h, need_w, need_b = rest
    settings = LossSettings.from_args(tuple(settings_args))
    shape = targets.shape
    h2d = LC.canonical_layout(hidden.reshape(-1, hidden.shape[-1]))
    weight = LC.canonical_layout(weight)
    t1d = targets.reshape(-1)
    inv_temp = 1.0 / temperature
    route = LC.tuning().route_for(h2d)
    empty = hidden.new_empty(0)
    if not (need_h or need_w or need_b):
        lp, ent, _ = LC.forward_stats(h2d, weight, bias, t1d, inv_temp, ignore_index, route, True, PASSES)
        loss, metrics = reference.policy_loss(
            lp.view(shape), old, adv, mask_eff, ref, None if ent is None else ent.view(shape), rw, settings
        )
        return loss, _metrics_tensor(metrics), empty, empty.clone(), empty.clone()
    n_rows = h2d.shape[0]
    w = reference.aggregation_weights(mask_eff, settings.loss_agg_mode).reshape(-1)
    old1, adv1, ref1 = old.reshape(-1), adv.reshape(-1), ref.reshape(-1)
    rw1 = None if rw is None else rw.reshape(-1)
    token_sum = dataclasses.replace(settings, loss_agg_mode="token-sum")
    sink = LC.GradSink(h2d, weight, need_h, need_w, need_b and bias is not None)
    keep_logits = route == "gemm" and weight.shape[1] >= linear().loss_keeps_logits_from_dim
    buf = LC.ChunkBuffers(h2d, weight, route, PASSES, need_dl=True, keep_logits=keep_logits)
    one = torch.ones((), dtype=torch.float32, device=hidden.device)
    lp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(lp)
    lse = torch.empty_like(lp)
    for r0 in range(0, n_rows, buf.rows):
        n = min(buf.rows, n_rows - r0)
        sl = slice(r0, r0 + n)
        chunk = buf.chunk(h2d, weight, bias, t1d, r0, n, inv_temp, ignore_index)
        PASSES.stats(chunk, lp[sl], ent[sl], lse[sl])
        g_lp, g_ent = _token_grads(
            lp[sl], ent[sl], old1[sl], adv1[sl], w[sl], ref1[sl], None if rw1 is None else rw1[sl], token_sum, one
        )
        dl = PASSES.grad(chunk, lse[sl], ent[sl], g_lp, g_ent)
        sink.add(dl, r0, n)
    del buf
    loss, metrics = reference.policy_loss(lp.view(shape), old, adv, mask_eff, ref, ent.view(shape), rw, settings)
    dh, dw, db = sink.grads()
    return (
        loss,
        _metrics_tensor(metrics),
        empty if dh is None else dh.view(hidden.shape),
        empty.clone() if dw is None else dw,
        empty.clone() if db is None else db,
    )


@launch_time_jit
def _scale_kernel(x_ptr, out_ptr, g_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    g = tl.load(g_ptr).to(x_ptr.dtype.element_ty).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=keep)
    tl.store(out_ptr + offs, (x.to(tl.float32) * g).to(out_ptr.dtype.element_ty), mask=keep)


_SCALE_BLOCK = 4096


def _scaled(grad_loss: torch.Tensor, grads: tuple[torch.Tensor, ...], in_place: bool) -> tuple[torch.Tensor, ...]:
    """Each of ``grads`` (contiguous; ``[0]`` when absent) times the 0-d ``grad_loss``: ``grad_loss``
    rounded to the gradient's dtype, the product formed in fp32 and rounded once, in one
    vectorized pass with ``grad_loss`` read on the device: torch's ``mul_`` by a 0-d CUDA tensor
    takes its strided kernel, a visible share of the loss's device time
    (``benchmarks/results/linear_h200/chunk_rows/profile_loss.json``)."""
    out = []
    for x in grads:
        y = x if in_place else torch.empty_like(x)
        if x.numel():
            _scale_kernel[(triton.cdiv(x.numel(), _SCALE_BLOCK),)](
                x, y, grad_loss, x.numel(), BLOCK=_SCALE_BLOCK, num_warps=8
            )
        out.append(y)
    return tuple(out)


def _scaled_gradients(
    grad_loss: torch.Tensor, grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward custom op's body: the stored ``(dh, dW, db)`` times ``grad_loss``, new tensors."""
    dh, dw, db = _scaled(grad_loss, (grad_hidden, grad_weight, grad_bias), in_place=False)
    return dh, dw, db


def _scaled_gradients_in_place(
    grad_loss: torch.Tensor, grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager backward: :func:`_scaled_gradients` in place (the same bits). The stored gradients
    are the node's own buffers, used once (:func:`rl_kernel_core.loss.opdef.fused_loss_backward`
    refuses a second backward), and a copy of ``dW`` would double its memory."""
    dh, dw, db = _scaled(grad_loss, (grad_hidden, grad_weight, grad_bias), in_place=True)
    return dh, dw, db


_fused_loss_op = define_differentiable_op(
    "triton_fused_linear_policy_loss",
    _forward,
    opdef.fused_loss_fake,
    _scaled_gradients,
    opdef.fused_loss_backward_fake,
    opdef.fused_loss_setup,
    opdef.fused_loss_backward,
    schema=opdef.FUSED_LOSS_SCHEMA,
    backward_schema=opdef.FUSED_LOSS_BACKWARD_SCHEMA,
    eager_backward_fn=_scaled_gradients_in_place,
)
_fused_loss = opdef.fused_loss_implementation(_fused_loss_op)


def _supports(inputs: FusedLossInputs, **kwargs) -> Optional[str]:
    if inputs.hidden.dtype == torch.float64:
        return "the triton kernels accumulate in fp32; fp64 inputs need the torch backend"
    return None


@dispatch.register("fused_linear_policy_loss", "triton", supports=_supports, kernels=triton_sm90.KERNELS)
def fused_linear_policy_loss_triton(
    inputs: FusedLossInputs,
    *,
    temperature: float,
    ignore_index: int,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO/GRPO loss of :func:`rl_kernel_core.loss.api.policy_loss` from ``hidden [S, T, D]`` and ``weight [V, D]``.

    Validated inputs (see :mod:`rl_kernel_core.loss.api`): 16-bit or fp32 ``hidden``/``weight``/
    ``bias``, ``targets [S, T]`` in ``[0, V)`` or ``ignore_index`` (such tokens leave the mask),
    per-token ``[S, T]`` float tensors, ``mask`` bool or float. Returns ``(loss, metrics)``:
    ``loss`` 0-d fp32, differentiable in ``hidden``, ``weight`` and ``bias`` (its gradient is
    formed during the forward); ``metrics`` detached 0-d tensors.
    """
    mask_eff = reference.scored_mask(inputs.mask, inputs.targets, ignore_index)
    return _fused_loss(
        *inputs._replace(mask=mask_eff), temperature=temperature, ignore_index=ignore_index, settings=settings
    )
