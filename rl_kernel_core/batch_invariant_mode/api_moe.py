"""Mixture-of-experts layers with one set of bits on both sides of the identity (Qwen3-MoE style).

A Qwen3-MoE sparse block routes each token to ``top_k`` of ``E`` experts (a linear router, a
softmax over the experts, the top ``k``, optionally renormalised to sum to 1), runs each chosen
expert's gated MLP on the token and adds the expert outputs weighted by their routing
probabilities. Inference engines and transformers compute this differently: vLLM's fused MoE
kernels pick tiles from the number of tokens routed to an expert and sum the top-k outputs in
their own order; transformers loops over the experts and accumulates their outputs in expert
order in the model dtype; both break ties in top-k as their kernels happen to.

Here the block is one function of the token's own row, used by both sides while the
batch-invariant mode is on (the engine side: :mod:`rl_kernel_vllm.moe`; the trainer side:
:func:`use_mode_moe`, called by :func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention`):

* :func:`route`: router logits ``x @ W_gate.T`` in the model dtype (the mode's matmul,
  :func:`router_logits`), their log-softmax over the experts in fp32 (the mode's log-softmax), the
  experts sorted by it with a stable sort (ties go to the lower expert index), the first ``top_k``
  taken; the weights are ``exp`` of their log-probabilities (fp32) and, with ``normalize``,
  divided by their sum, added left to right in that order.
* :func:`experts`: each (token, slot) pair's expert MLP ``down(silu(gate(x)) * up(x))`` through
  the mode's row-invariant matmuls in the model dtype (:func:`bi_grouped_linear`: every expert's
  product over its tokens, one launch for all experts on CUDA), then the combine ``sum_j w_j * y_j`` in fp32, slot 0 first (descending routing weight), rounded
  once to the model dtype.

On the CPU the elementwise steps whose vectorised and scalar code paths may round differently
(``exp``, ``silu``) run on fixed-shape row tiles
(:func:`rl_kernel_core.batch_invariant_mode.reference.row_tiled`), so a row's bits do not depend on
where it sits in the batch; on CUDA every element is computed by the same code wherever it is.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.batch_invariant_mode.api import is_batch_invariant
from rl_kernel_core.batch_invariant_mode.reference import Outputs, row_tiled


BLOCK_CLASSES: tuple[str, ...] = ("Qwen3MoeSparseMoeBlock",)
"""transformers' sparse MoE blocks whose router and experts :func:`use_mode_moe` takes over."""


def _rows(fn: Callable[..., Outputs], *tensors: torch.Tensor) -> Outputs:
    """``fn`` of row-aligned ``tensors``, on fixed row tiles on the CPU (see the module docstring)."""
    if tensors[0].device.type == "cpu":
        return row_tiled(fn, *tensors)
    return fn(*tensors)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x [N, H], weight [E, H]) -> [N, E]`` in ``x``'s dtype (the mode's matmul while it is on)."""
    return F.linear(x, weight)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights.

    Args:
        logits: ``[N, E]`` router logits, floating (the model dtype).
        top_k: experts per token, ``1 <= top_k <= E``.
        normalize: divide the ``top_k`` weights by their sum (a config's ``norm_topk_prob``).

    Returns:
        ``(weights [N, top_k] fp32, ids [N, top_k] int64)``: slot 0 holds the most probable expert;
        equal probabilities are ordered by expert index. Each row depends only on its own logits.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating [N, E] tensor, got {tuple(logits.shape)} {logits.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k: expected 1..{logits.shape[1]} (the number of experts), got {top_k}")

    def tile(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(t.float(), dim=-1)
        ordered, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
        weights = ordered[:, :top_k].exp()
        if normalize:
            total = weights[:, 0]
            for j in range(1, top_k):
                total = total + weights[:, j]
            weights = weights / total[:, None]
        return weights, ids[:, :top_k]

    weights, ids = _rows(tile, logits)
    return weights, ids


def _gated(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def bi_grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, backend: Optional[str] = "auto"
) -> torch.Tensor:
    """Each expert's batch-invariant ``F.linear`` over its rows, all experts in one call.

    Args:
        rows: ``[R, K]`` float32/bfloat16/float16/float64, sorted by expert: ``counts[0]`` rows of
            expert 0, then expert 1's, and so on.
        weight: ``[E, N, K]`` in ``rows``' dtype, any strides.
        counts: ``[E]`` int64 on ``rows``' device, summing to R (not checked: that would read it
            to the host).
        backend: ``"auto"`` (or None: ``RL_KERNEL_BACKEND``, default auto) or a backend name.

    Returns:
        ``[R, N]`` in ``rows``' dtype: expert ``e``'s rows are bitwise ``bi_linear`` of those rows
        and ``weight[e]`` on the same backend. The ``triton`` backend runs
        every expert in one launch and reads nothing to the host; ``torch`` runs one product per expert.
        Differentiable in ``rows`` and ``weight``.
    """
    _checks.tensor("rows", rows, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    _checks.tensor("weight", weight, dtypes=(rows.dtype,), ndim=3)
    _checks.tensor("counts", counts, dtypes=(torch.int64,), ndim=1)
    _checks.same_device("rows", rows, weight=weight, counts=counts)
    e, n, k = weight.shape
    _checks.shape("weight", weight, (e, n, rows.shape[1]), f"[E, N, K={rows.shape[1]}]")
    _checks.shape("counts", counts, (e,), f"[E={e}]")
    return dispatch.select("bi_grouped_linear", backend, rows.device, rows, weight, counts)(rows, weight, counts)


def experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The weighted sum of each token's routed experts' gated MLPs.

    Args:
        x: ``[N, H]`` hidden states (model dtype).
        ids: ``[N, k]`` int64 expert ids in ``[0, E)``; weights: ``[N, k]`` fp32 (from :func:`route`).
        gate_up: ``[E, 2I, H]`` in ``x``'s dtype, each expert's gate rows then its up rows.
        down: ``[E, H, I]`` in ``x``'s dtype.

    Returns:
        ``[N, H]`` in ``x``'s dtype: ``sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x)`` with
        ``e = ids[:, j]``, each expert's products in ``x``'s dtype, the sum in fp32 from slot 0 on,
        rounded once. Each row depends only on its own inputs. Differentiable in ``x``, the weights
        and both expert tensors. The products are :func:`bi_grouped_linear`'s: on CUDA nothing is
        read to the host.
    """
    n, hidden = x.shape
    k = ids.shape[1]
    num_experts = gate_up.shape[0]
    if gate_up.dim() != 3 or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [E, 2I, H={hidden}], got {tuple(gate_up.shape)}")
    if down.shape != (num_experts, hidden, gate_up.shape[1] // 2):
        raise ValueError(
            f"down: expected [E={num_experts}, H={hidden}, I={gate_up.shape[1] // 2}], got {tuple(down.shape)}"
        )
    if ids.shape != weights.shape or ids.shape[0] != n:
        raise ValueError(f"ids, weights: expected both [N={n}, k], got {tuple(ids.shape)} and {tuple(weights.shape)}")
    if n == 0:
        return x.new_zeros(x.shape)
    flat = ids.reshape(-1)
    # (token, slot) pairs grouped by expert, in token order within an expert; counts without a host read
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    # two grouped products (every routed expert's rows); the activation once over all of them
    act = _rows(_gated, bi_grouped_linear(rows, gate_up, counts))
    grouped = bi_grouped_linear(act, down, counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = grouped.index_select(0, inverse).view(n, k, hidden)
    out = weights[:, 0, None] * per_slot[:, 0].float()
    for j in range(1, k):
        out = out + weights[:, j, None] * per_slot[:, j].float()
    return out.to(x.dtype)


def sparse_moe(
    x: torch.Tensor, gate_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, normalize: bool
) -> torch.Tensor:
    """A Qwen3-MoE sparse block on ``x [N, H]``: :func:`route` of :func:`router_logits` of
    ``gate_weight [E, H]``, then :func:`experts`; ``[N, H]`` in ``x``'s dtype."""
    weights, ids = route(router_logits(x, gate_weight), top_k, normalize)
    return experts(x, ids, weights, gate_up, down)


def _router_forward(router: Any) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    original = router.forward

    def forward(hidden_states: torch.Tensor):
        if not is_batch_invariant():
            return original(hidden_states)
        logits = router_logits(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        weights, ids = route(logits, router.top_k, router.norm_topk_prob)
        return logits, weights, ids

    return forward


def _experts_forward(module: Any) -> Callable[..., torch.Tensor]:
    original = module.forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if not is_batch_invariant():
            return original(hidden_states, top_k_index, top_k_weights)
        if top_k_weights.dtype != torch.float32:
            raise ValueError(
                "batch-invariant MoE experts: top_k_weights must come from the mode's router (fp32), "
                f"got {top_k_weights.dtype}"
            )
        return experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj)

    return forward


def use_mode_moe(model: torch.nn.Module) -> list[str]:
    """Make ``model``'s transformers sparse MoE blocks (:data:`BLOCK_CLASSES`) compute :func:`route`
    and :func:`experts` while batch-invariant mode is on: each block's router module returns the
    logits (model dtype), :func:`route`'s fp32 weights and its expert ids, and its experts module
    returns :func:`experts` (the block's own forward, and transformers' recording of the router
    logits, stay as they are). While the mode is off both modules run their own forward, so the
    model computes exactly what it did before. Idempotent; returns the patched blocks' names.

    Raises ``ValueError`` for a covered block whose experts are not the concatenated, untransposed,
    bias-free SiLU layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    names = []
    for name, block in model.named_modules():
        if type(block).__name__ not in BLOCK_CLASSES or getattr(block, "_rl_kernel_mode_moe", False):
            continue
        experts_module, router = block.experts, block.gate
        act = getattr(getattr(experts_module, "config", None), "hidden_act", "silu")
        if (
            getattr(experts_module, "is_transposed", False)
            or getattr(experts_module, "has_bias", False)
            or not getattr(experts_module, "is_concatenated", True)
            or act != "silu"
        ):
            raise ValueError(
                f"{name}: batch-invariant MoE covers concatenated, untransposed, bias-free SiLU experts "
                f"(hidden_act {act!r})"
            )
        router.forward = _router_forward(router)
        experts_module.forward = _experts_forward(experts_module)
        block._rl_kernel_mode_moe = True
        names.append(name)
    return names
