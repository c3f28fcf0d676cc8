"""Tensor parallelism's row-parallel sum, defined once for the rollout engine and the trainer.

A row-parallel linear (a decoder layer's ``o_proj`` and ``down_proj``) at tensor parallel size N
splits its input features into N contiguous slices: rank r multiplies slice r by the weight's
matching columns, rounds its product to the model dtype, and the ranks' partial products are summed
across ranks. A collective library's all-reduce adds three or more partials in an order of its own
(ring, tree, chunking by message size), and each order rounds differently; two partials round once
whatever the order.

Under the batch-invariant mode both sides use :func:`rank_order_sum`: the engine after gathering the
ranks' partials (``rl_kernel_vllm.tensor_parallel``), the trainer on one process over its own slices
(:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_row_parallel_split`). :func:`check_split` is the one check
of which sizes a model admits, for both.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def rank_order_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ranks' partials summed in a fixed order.

    ``parts``: N >= 1 tensors of one shape and one floating dtype (bf16, fp16, fp32 or fp64), rank
    r's partial at index r. Returns a tensor of that shape and dtype:
    ``round(((p0 + p1) + p2) + ... + p[N-1])``, each partial widened to float32 (float64 stays
    float64), added in ascending rank order with a float32 (float64) rounding after each addition,
    and the result rounded once to the parts' dtype (round to nearest even throughout). The bits
    depend on the partials' values and rank order only, never on the device, shapes or how many
    elements are reduced. For two partials this is the correctly rounded ``p0 + p1`` that any
    two-rank all-reduce returns (the model-dtype addition), and for float32 partials the float32
    left fold. ``parts`` are not modified."""
    if len(parts) == 0:
        raise ValueError("parts: expected at least one rank's partial, got none")
    first = parts[0]
    if not first.is_floating_point():
        raise TypeError(f"parts: expected floating tensors, got dtype {first.dtype}")
    for r, p in enumerate(parts):
        if p.shape != first.shape or p.dtype != first.dtype or p.device != first.device:
            raise ValueError(
                f"parts[{r}]: expected shape {tuple(first.shape)}, dtype {first.dtype} on {first.device} "
                f"(as parts[0]), got shape {tuple(p.shape)}, dtype {p.dtype} on {p.device}"
            )
    acc = first.to(torch.promote_types(first.dtype, torch.float32), copy=True)
    for p in parts[1:]:
        acc.add_(p)  # widened exactly, then one float32 rounding
    return acc.to(first.dtype)


def check_split(config: Any, parts: Any, what: str = "parts") -> None:
    """Refuse a tensor parallel size ``parts`` that ``config`` (a transformers text config) does not
    admit (None: no config, ``parts`` alone is checked): ``parts`` must be an integer >= 1 dividing ``num_attention_heads`` (each rank holds whole
    query heads, so ``o_proj``'s slices are whole heads) and ``intermediate_size`` (``down_proj``'s
    input) where the config has them. ``what`` names ``parts`` in the error.

    Raises ``ValueError`` (``TypeError`` for a non-integer) in one line naming ``what``, the config
    field, and both values."""
    if type(parts) is not int:  # True or 2.0 would pass the comparisons below
        raise TypeError(f"{what}: expected an integer >= 1, got {parts!r} ({type(parts).__name__})")
    if parts < 1:
        raise ValueError(f"{what}: expected an integer >= 1, got {parts}")
    for field in ("num_attention_heads", "intermediate_size"):
        size = getattr(config, field, None)
        if isinstance(size, int) and size % parts:
            raise ValueError(
                f"{what}={parts} does not divide the model's {field}={size} (each rank takes an equal contiguous slice)"
            )


def text_config(config: Any) -> Any:
    """``config``'s text config (a multimodal model's language part), else ``config`` (None stays None)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config
