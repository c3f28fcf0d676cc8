"""FlashInfer backend of ``sample``: which calls it serves, and why it refuses the others.

FlashInfer (the ``flashinfer-python`` package; 0.7.2 tested, on an H100) draws the tokens; the log-probs are
``logprob_from_logits``' Triton kernel on the same logits, so they have its bits. The backend
(:mod:`rl_kernel_core.sampling.flashinfer`) imports FlashInfer; this module does not, so
:func:`supports` can be imported and tested without it.

What it serves, and how each call maps onto FlashInfer (``x = fp32(logits) * fp32(1 / T)``, the
reference's tempered logits; the probabilities ``softmax(x)`` in fp32):

* no filter: ``sampling_from_logits(x)`` (Gumbel-max on the logits);
* top-k alone: ``top_k_sampling_from_probs``; top-p alone: ``top_p_sampling_from_probs``;
  min-p alone: ``min_p_sampling_from_probs``;
* top-k and top-p: ``top_k_mask_logits(x, k)`` (keeps every logit >= the k-th largest), then
  ``top_p_sampling_from_probs`` on the softmax of what it kept: top-p over the renormalised top-k
  set, vLLM's order. ``top_k_top_p_sampling_from_logits`` is not used: for an int ``top_k`` up to
  256 over a vocabulary of at least 65536 it takes a radix top-k that returns exactly k tokens, so
  tokens tying with the k-th largest may be dropped, where the contract keeps them all.

FlashInfer's rules are the reference's (a token survives top-k when fewer than k tokens are
larger, top-p when the mass of the larger tokens is below ``top_p``, min-p when ``p >= min_p *
max p``), computed on fp32 probabilities with ``top_p``/``min_p`` rounded to fp32, so the kept
set can differ from the reference's only for a token whose probability sits within rounding of a
threshold. Scalar parameters that keep every token (``top_k >= V``, ``top_p == 1``, ``min_p ==
0``) are dropped before the call.

Without ``seeds``, ``sample`` draws one seed per row from ``generator`` (or the global RNG); the
backend hands the first to FlashInfer as its Philox seed (a device tensor: no host sync, CUDA-graph
safe), with offset 0. FlashInfer keys row ``b``'s stream on ``(seed, b, offset)``, so rows draw
independently, and the same generator state gives the same tokens run to run (its
``deterministic=True`` kernels), though not the tokens ``torch`` and ``triton`` draw.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Param = Union[int, float, torch.Tensor, None]


def active_filters(vocab: int, top_k: Param, top_p: Param, min_p: Param) -> tuple[Param, Param, Param]:
    """``(top_k, top_p, min_p)`` with the scalars that keep every token (``top_k >= vocab``,
    ``top_p >= 1``, ``min_p == 0``) replaced by None; ``[B]`` tensors are kept as they are."""
    if isinstance(top_k, int) and top_k >= vocab:
        top_k = None
    if isinstance(top_p, float) and top_p >= 1.0:
        top_p = None
    if isinstance(min_p, float) and min_p == 0.0:
        min_p = None
    return top_k, top_p, min_p


def supports(
    logits: torch.Tensor,
    temperature: Union[float, torch.Tensor],
    seeds: Optional[torch.Tensor],
    positions: Param,
    top_k: Param,
    top_p: Param,
    min_p: Param,
) -> Optional[str]:
    """None when the ``flashinfer`` backend serves the call exactly under ``sample``'s contract,
    else the reason it does not, naming the argument (``dispatch.explain`` shows it).

    Takes ``sample``'s backend arguments as ``dispatch.select`` passes them (``seeds`` None when the
    caller gave none; see :mod:`rl_kernel_core.sampling.api`). The device is dispatch's check, before
    this one (FlashInfer runs on CUDA tensors only).
    """
    if seeds is not None:
        return (
            "seeds given: FlashInfer keys row b's Philox stream on (seed, b, offset), so a row's draw would "
            "depend on its position in the batch, where seeded draws must depend on the row's logits, "
            "parameters, seed and position alone; use backend='triton' or 'torch' for seeded calls"
        )
    if logits.dtype == torch.float64:
        return "fp64 logits (the log-probs come from logprob_from_logits' Triton kernel, which reads fp32/bf16/fp16)"
    if isinstance(temperature, torch.Tensor):
        return (
            "temperature as a [B] tensor (the log-probs come from logprob_from_logits' Triton kernel, which takes "
            "one temperature per call; a number is served)"
        )
    if temperature == 0.0:
        return "temperature 0 (greedy): FlashInfer's samplers only draw; the torch and triton backends take the argmax"
    top_k, top_p, min_p = active_filters(logits.shape[1], top_k, top_p, min_p)
    if min_p is not None and (top_k is not None or top_p is not None):
        return "min_p together with top_k/top_p: FlashInfer has no sampler that applies min-p before top-k/top-p"
    return None
