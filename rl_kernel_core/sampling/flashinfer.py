"""The ``flashinfer`` backend of ``sample``: FlashInfer draws the tokens, ``logprob_from_logits``'
Triton kernel gives their log-probs. Importing this module imports FlashInfer (and Triton): when
either is missing the import fails, and dispatch reports that error for ``backend="flashinfer"``.
Which calls it serves, and how each maps onto FlashInfer: :mod:`rl_kernel_core.sampling.flashinfer_supports`.
"""

from __future__ import annotations

import flashinfer.sampling as fi
import torch

from rl_kernel_core import dispatch
from rl_kernel_core.logprob.triton import logprob_fwd
from rl_kernel_core.sampling.flashinfer_supports import Param, active_filters, supports


def draw(
    logits: torch.Tensor, temperature: float, seeds: torch.Tensor, top_k: Param, top_p: Param, min_p: Param
) -> torch.Tensor:
    """Tokens drawn by FlashInfer from ``softmax(fp32(logits) * fp32(1 / temperature))`` restricted by the filters.

    Args:
        logits: ``[B, V]`` fp32/bf16/fp16 CUDA tensor, contiguous.
        temperature: a number > 0.
        seeds: ``[B]`` int64 on ``logits``' device; ``seeds[0]`` seeds FlashInfer's Philox stream
            (offset 0), whose row ``b`` is also keyed on ``b``.
        top_k: None, an int in ``[1, V]`` or an integer tensor ``[B]``.
        top_p: None, a number in ``(0, 1]`` or a float tensor ``[B]``.
        min_p: None, a number in ``[0, 1)`` or a float tensor ``[B]``; not with an active
            ``top_k``/``top_p`` (:func:`rl_kernel_core.sampling.flashinfer_supports.supports` refuses that).

    Returns:
        ``[B]`` int64 token ids. The FlashInfer call for each filter combination is listed in
        :mod:`rl_kernel_core.sampling.flashinfer_supports`.
    """
    x = logits.float()
    if temperature != 1.0:
        x = x * (1.0 / temperature)
    top_k, top_p, min_p = active_filters(logits.shape[1], top_k, top_p, min_p)
    if isinstance(top_k, torch.Tensor):
        top_k = top_k.to(torch.int32)
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.to(torch.float32)
    rng = {"deterministic": True, "seed": seeds[:1], "offset": torch.zeros_like(seeds[:1])}
    if min_p is not None:
        tokens = fi.min_p_sampling_from_probs(torch.softmax(x, dim=-1), min_p, **rng)
    elif top_p is not None:
        if top_k is not None:
            x = fi.top_k_mask_logits(x, top_k)
        tokens = fi.top_p_sampling_from_probs(torch.softmax(x, dim=-1), top_p, **rng)
    elif top_k is not None:
        tokens = fi.top_k_sampling_from_probs(torch.softmax(x, dim=-1), top_k, **rng)
    else:
        tokens = fi.sampling_from_logits(x, **rng)
    return tokens.to(torch.int64)


@dispatch.register("sample", "flashinfer", supports=supports)
def sample(
    logits: torch.Tensor,
    temperature: float,
    seeds: torch.Tensor,
    positions: Param,
    top_k: Param,
    top_p: Param,
    min_p: Param,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample``'s backend contract (:mod:`rl_kernel_core.sampling.api`) for the calls
    :func:`~rl_kernel_core.sampling.flashinfer_supports.supports` accepts (no caller seeds, so ``positions`` do not
    enter the draw). Returns ``(tokens [B] int64, logprobs [B] fp32)``, the log-probs with the bits
    of ``logprob_from_logits(logits, tokens, temperature=temperature, backend="triton")``."""
    tokens = draw(logits, temperature, seeds, top_k, top_p, min_p)
    logprobs, _entropy, _lse = logprob_fwd(logits, tokens, temperature, -1, False)
    return tokens, logprobs
