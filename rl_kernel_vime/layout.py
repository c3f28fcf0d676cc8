"""vime's tensor layouts, translated for the public ops. No arithmetic on values happens here.

vime (like slime) packs a micro-batch's samples into one sequence: ``logits [1, T, V/TP]`` holds
sample ``i``'s ``total_lengths[i]`` positions after the previous samples' (``T`` may include
padding at the end). Row ``p`` predicts the token at ``p + 1``, so sample ``i``'s response of
``response_lengths[i]`` tokens is scored by rows ``[end_i - R_i - 1, end_i - 1)`` where
``end_i`` is the sample's end offset. Per-token training tensors (advantages, old log-probs,
masks) are the responses concatenated: ``sum(response_lengths)`` entries.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist


def response_rows(total_lengths: Sequence[int], response_lengths: Sequence[int], num_rows: int) -> list[slice]:
    """Each sample's response rows in the packed logits (see the module docstring).

    Raises ``ValueError`` when the lists differ in length, a response is not shorter than its
    sample (its first token would have no predicting row), or the samples overrun ``num_rows``.
    """
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"response_lengths must have one entry per sample ({len(total_lengths)} total_lengths), got {len(response_lengths)}"
        )
    rows = []
    end = 0
    for i, (total, response) in enumerate(zip(total_lengths, response_lengths)):
        if not 0 <= response < total:
            raise ValueError(
                f"response_lengths[{i}] must be in [0, total_lengths[{i}]={total}) (a response needs a prompt token "
                f"before it), got {response}"
            )
        end += total
        rows.append(slice(end - response - 1, end - 1))
    if end > num_rows:
        raise ValueError(f"total_lengths must sum to at most the packed length T={num_rows}, got sum {end}")
    return rows


def response_targets(
    rows: Sequence[slice],
    unconcat_tokens: Sequence[torch.Tensor],
    response_lengths: Sequence[int],
    total_lengths: Sequence[int],
    num_rows: int,
    ignore_index: int,
    device: torch.device,
) -> torch.Tensor:
    """``[T]`` int64 targets: each response row holds the token it predicts, every other row
    (prompts, sample ends, padding) holds ``ignore_index``."""
    if len(unconcat_tokens) != len(rows):
        raise ValueError(f"unconcat_tokens must have one tensor per sample ({len(rows)}), got {len(unconcat_tokens)}")
    targets = torch.full((num_rows,), ignore_index, dtype=torch.long, device=device)
    for i, (row, tokens, response, total) in enumerate(zip(rows, unconcat_tokens, response_lengths, total_lengths)):
        if tokens.dim() != 1 or tokens.numel() != total:
            raise ValueError(
                f"unconcat_tokens[{i}] must be 1-D with total_lengths[{i}]={total} ids, got shape {tuple(tokens.shape)}"
            )
        targets[row] = tokens[total - response : total].to(device=device, dtype=torch.long)
    return targets


def split_rows(values: torch.Tensor, rows: Sequence[slice]) -> list[torch.Tensor]:
    """Views of ``values [T]`` at each sample's response rows."""
    return [values[row] for row in rows]


def tp_world_size(tp_group: Optional["dist.ProcessGroup"]) -> int:
    """Ranks in the tensor-parallel group (1 for None or without torch.distributed)."""
    if tp_group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(tp_group)


def parallel_reason(args: Namespace) -> Optional[str]:
    """Why vime's parallel layout in ``args`` is unsupported (Megatron's argument names), or None."""
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        return f"context parallel (context_parallel_size={cp}) splits sequences across ranks; not supported"
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if tp > 1:
        return (
            f"vocab-parallel logits (tensor_model_parallel_size={tp}): rl_kernel_core.logprob_from_logits "
            "takes no tp_group yet"
        )
    return None


def reducer_weights(
    reducer: Callable[[torch.Tensor], torch.Tensor], num_tokens: int, device: torch.device
) -> torch.Tensor:
    """The per-token weights ``w`` of a linear reducer: ``reducer(x) == (w * x).sum()``.

    vime reduces per-token values with a closure (``sum_of_sample_mean``: a sum over samples of
    masked means, or a masked token sum, with context-parallel denominators) that is linear in
    its input; its gradient at any point is ``w``. Returns ``[num_tokens]`` fp32, detached.
    """
    probe = torch.zeros(num_tokens, dtype=torch.float32, device=device, requires_grad=True)
    with torch.enable_grad():
        total = reducer(probe)
    if not isinstance(total, torch.Tensor) or not total.requires_grad:
        # no sample, or every value masked out: the reducer ignores its input
        return torch.zeros(num_tokens, dtype=torch.float32, device=device)
    (weights,) = torch.autograd.grad(total, probe)
    return weights
