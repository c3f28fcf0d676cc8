"""verl's padded rollout batch: the tensors its trainer holds for a worker call.

Before a worker call verl's trainer (0.9.x) holds, per sequence, the prompt left-padded and the
response right-padded to fixed lengths, and turns them into its no-padding layout with
``verl.workers.utils.padding.left_right_2_no_padding``. The tests and benchmarks that drive verl's
workers directly build that batch with :func:`padded_rollout`. Layout only: no verl import.
"""

from __future__ import annotations

import torch


def padded_rollout(
    prompts: torch.Tensor, responses: torch.Tensor, prompt_len: torch.Tensor, response_len: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The padded batch of ``B`` sequences as verl's trainer holds it.

    Args:
        prompts: ``[B, P]`` int64 token ids; only the last ``prompt_len[i]`` of row ``i`` are kept.
        responses: ``[B, R]`` int64 token ids; only the first ``response_len[i]`` of row ``i`` are kept.
        prompt_len: ``[B]`` int64 in ``1..P``.
        response_len: ``[B]`` int64 in ``1..R``.

    Returns:
        ``input_ids`` ``[B, P + R]`` (padding 0), ``attention_mask`` and ``position_ids`` of the
        same shape (positions count from 0 at each sequence's first token, 0 on left padding),
        ``response_mask`` ``[B, R]``, ``prompts`` ``[B, P]`` and ``responses`` ``[B, R]`` with
        their padding zeroed. Masks are int64, as verl's are.
    """
    p, r = prompts.shape[1], responses.shape[1]
    for name, lengths, most in (("prompt_len", prompt_len, p), ("response_len", response_len, r)):
        if lengths.shape != prompts.shape[:1] or int(lengths.min()) < 1 or int(lengths.max()) > most:
            raise ValueError(
                f"{name}: expected shape {tuple(prompts.shape[:1])} with values in 1..{most}, got shape "
                f"{tuple(lengths.shape)} with values {int(lengths.min())}..{int(lengths.max())}"
            )
    prompt_mask = (torch.arange(p)[None] >= (p - prompt_len)[:, None]).long()
    response_mask = (torch.arange(r)[None] < response_len[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    prompts, responses = prompts * prompt_mask, responses * response_mask
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "prompts": prompts,
        "responses": responses,
    }
