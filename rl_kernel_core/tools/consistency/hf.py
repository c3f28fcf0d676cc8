"""The ``rl-kernel consistency`` run's two layouts over a Hugging Face ``transformers`` model: one
padded training forward and a rollout over a KV cache, each giving per-sequence log-probs. The
model follows the batch-invariant mode through
:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention`.
"""

from __future__ import annotations

import torch

from rl_kernel_core.tools.consistency.chain import selected_logprobs as _selected_logprobs


def _keys(rows: list[int], mask: torch.Tensor, positions: torch.Tensor) -> list:
    return [
        (rows[b], int(p)) if m else None
        for b in range(mask.shape[0])
        for m, p in zip(mask[b].tolist(), positions[b].tolist())
    ]


def training_logprobs(model, batch, probe=None) -> list[torch.Tensor]:
    """One forward over a padded :class:`~rl_kernel_core.tools.consistency.parity.Batch`; per sequence the
    log-probs of the next token at its loss-mask positions (fp32)."""
    if probe is not None:
        probe.rows(_keys(list(range(batch.input_ids.shape[0])), batch.attention_mask, batch.position_ids))
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits
    lp = _selected_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
    return [lp[b][batch.loss_mask[b, :-1].bool()] for b in range(lp.shape[0])]


def rollout_logprobs(
    model, seqs: list[torch.Tensor], prompt_len: int, batch_size: int, pad_id: int, probe=None
) -> list[torch.Tensor]:
    """Rollout-style, ``batch_size`` sequences at a time: left-padded prompts (sequence b's first
    ``prompt_len - b % 3`` tokens, at least 1) prefilled into a ``DynamicCache``, then the rest fed one
    token per step; per sequence the log-probs of tokens 1.. (fp32). Rows that have ended keep
    receiving ``pad_id`` (attended, discarded) so the others keep their batch."""
    from transformers import DynamicCache

    out: list[torch.Tensor] = []
    for first in range(0, len(seqs), batch_size):
        group = seqs[first : first + batch_size]
        idx = list(range(first, first + len(group)))
        plen = [max(1, min(prompt_len - b % 3, len(s) - 1)) for b, s in zip(idx, group)]
        width = max(plen)
        device = group[0].device
        ids = torch.full((len(group), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for r, (s, p) in enumerate(zip(group, plen)):
            ids[r, width - p :] = s[:p]
            mask[r, width - p :] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0) * mask
        cache = DynamicCache(config=model.config)
        if probe is not None:
            probe.rows(_keys(idx, mask, pos))
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
        ).logits
        parts = []
        for r, (s, p) in enumerate(zip(group, plen)):
            parts.append([_selected_logprobs(logits[r, width - p :], s[1 : p + 1])])
        steps = max(len(s) - p for s, p in zip(group, plen)) - 1
        next_pos = pos[:, -1:] + 1
        for t in range(steps):
            tok = torch.tensor(
                [int(s[p + t]) if p + t < len(s) - 1 else pad_id for s, p in zip(group, plen)], device=device
            )
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if probe is not None:
                probe.rows(
                    [
                        (i, int(next_pos[r])) if p + t < len(s) - 1 else None
                        for r, (i, s, p) in enumerate(zip(idx, group, plen))
                    ]
                )
            logits = model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            ).logits
            for r, (s, p) in enumerate(zip(group, plen)):
                if p + t < len(s) - 1:
                    parts[r].append(_selected_logprobs(logits[r, -1:], s[p + t + 1 : p + t + 2]))
            next_pos = next_pos + 1
        out.extend(torch.cat(p) for p in parts)
    return out
