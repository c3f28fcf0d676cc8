"""Per-token log-probs of a fixed set of sequences through :class:`~rl_kernel_core.tools.consistency.model.TinyDecoder`
in each layout: packed (training-style varlen), padded (left or right) and incremental decoding over a
KV cache (rollout-style). Each function returns one fp32 tensor per sequence, ``[L_b - 1]``: the
log-prob of token t+1 given tokens 0..t.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from rl_kernel_core.tools.consistency import parity
from rl_kernel_core.tools.consistency.model import KVCache, TinyDecoder
from rl_kernel_core.tools.consistency.probe import DriftProbe

IGNORE = -100


def _offsets(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def selected_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits.float())`` at ``targets`` (``[...]`` int; negative ids give a value that
    callers discard), fp32 ``[...]``. Written as a model's own code would be, so the mode's routing
    of ``_log_softmax`` decides whether it is batch-invariant (a library row reduction may split a
    long row differently for different row counts)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)


def _selected(model: TinyDecoder, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return selected_logprobs(model.lm_head(hidden), targets)


def _forward(model: TinyDecoder, probe: Optional[DriftProbe], keys: list, *args, **kwargs) -> torch.Tensor:
    """``model(*args, **kwargs)``, telling ``probe`` which (sequence, position) each row holds."""
    if probe is not None:
        probe.rows(keys)
    return model(*args, **kwargs)


def packed_inputs(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The packed layout of ``seqs`` (1-D token ids on one device): ``(ids [T], positions [T],
    targets [T], cu_seqlens)``; a token's target is the next token of its sequence, ``IGNORE`` at
    each sequence's end. Built without waiting for the device."""
    lengths = [len(s) for s in seqs]
    cu = _offsets(lengths)
    ids = torch.cat(list(seqs))
    positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths])
    ends = torch.tensor([end - 1 for end in cu[1:]]).to(ids.device, non_blocking=True)
    targets = ids.roll(-1).index_fill_(0, ends, IGNORE)
    return ids, positions, targets, cu


def packed_logprobs(
    model: TinyDecoder, seqs: Sequence[torch.Tensor], probe: Optional[DriftProbe] = None
) -> list[torch.Tensor]:
    """One forward over the sequences packed back to back (``cu_seqlens`` layout)."""
    ids, positions, targets, cu = packed_inputs(seqs)
    keys = [(b, t) for b in range(len(seqs)) for t in range(cu[b + 1] - cu[b])]
    lp = _selected(model, _forward(model, probe, keys, ids, positions, cu), targets)
    return [lp[cu[b] : cu[b + 1] - 1] for b in range(len(seqs))]


def padded_logprobs(
    model: TinyDecoder, seqs: Sequence[torch.Tensor], side: str = "right", probe: Optional[DriftProbe] = None
) -> list[torch.Tensor]:
    """One forward over a ``[B, L]`` padded batch: dense layers see the pad rows, attention the real tokens."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    batch = parity.from_sequences(list(seqs), side, [0] * len(seqs), pad_id=0)
    width = batch.input_ids.shape[1]
    mask = batch.attention_mask.flatten()
    rows = mask.nonzero().squeeze(1)
    cu = _offsets([len(s) for s in seqs])
    targets = torch.full_like(batch.input_ids, IGNORE)
    targets[:, :-1] = batch.input_ids[:, 1:].masked_fill(batch.loss_mask[:, :-1] == 0, IGNORE)
    keys = [
        (i // width, int(p)) if m else None for i, (m, p) in enumerate(zip(mask.tolist(), batch.position_ids.flatten()))
    ]
    hidden = _forward(model, probe, keys, batch.input_ids.flatten(), batch.position_ids.flatten(), cu, rows=rows)
    lp = _selected(model, hidden, targets.flatten()).view(len(seqs), width)
    return [lp[b][batch.loss_mask[b].bool()] for b in range(len(seqs))]


def decode_logprobs(
    model: TinyDecoder,
    seqs: Sequence[torch.Tensor],
    prompt_len: int,
    probe: Optional[DriftProbe] = None,
    first_index: int = 0,
) -> list[torch.Tensor]:
    """Rollout-style: prefill each sequence's first ``prompt_len`` tokens into a KV cache, then feed the
    rest one token per step (all sequences in one batch per step), reading each step's log-prob.
    ``first_index`` numbers the sequences for ``probe`` (when they are a slice of a larger set)."""
    lengths = [len(s) for s in seqs]
    if min(lengths) <= prompt_len or prompt_len < 1:
        raise ValueError(f"prompt_len must be in [1, shortest length {min(lengths)}), got {prompt_len}")
    cache = KVCache(len(model.layers))
    prompt = [s[:prompt_len] for s in seqs]
    targets = torch.cat([s[1 : prompt_len + 1] for s in seqs])
    keys = [(first_index + b, t) for b in range(len(seqs)) for t in range(prompt_len)]
    positions = torch.arange(prompt_len, device=targets.device).repeat(len(seqs))
    hidden = _forward(model, probe, keys, torch.cat(prompt), positions, _offsets([prompt_len] * len(seqs)), cache=cache)
    lp = _selected(model, hidden, targets)
    out: list[list[torch.Tensor]] = [[lp[b * prompt_len : (b + 1) * prompt_len]] for b in range(len(seqs))]
    for t in range(prompt_len, max(lengths) - 1):
        active = [b for b, n in enumerate(lengths) if n - 1 > t]
        ids = torch.stack([seqs[b][t] for b in active])
        cu = _offsets([1 if b in active else 0 for b in range(len(seqs))])
        keys = [(first_index + b, t) for b in active]
        hidden = _forward(model, probe, keys, ids, torch.full((len(active),), t, device=ids.device), cu, cache=cache)
        step = _selected(model, hidden, torch.stack([seqs[b][t + 1] for b in active]))
        for i, b in enumerate(active):
            out[b].append(step[i : i + 1])
    return [torch.cat(parts) for parts in out]


def fixed_sequences(vocab: int, count: int, min_len: int, max_len: int, seed: int) -> list[torch.Tensor]:
    """``count`` token sequences of lengths in ``[min_len, max_len]``, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g)
    return [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]


def max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference between two lists of per-sequence log-probs."""
    return max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
