"""Processor-layout parity: does the training side feed the model what the rollout side did?

A rollout engine and a trainer each run a processor over the same conversation; if one inserts
a different number of image tokens for an image, places them elsewhere, lays out the 3-D rotary
positions differently or scores other tokens, every log-prob, ratio and KL compared between the
two is meaningless, silently. :func:`compare` lists the differences between two
:class:`~rl_kernel_core.tools.multimodal.schema.MultimodalBatch` es, first one first; :func:`check`
raises on the first.

Order of the checks (the first line names the root cause where one explains the rest): the
processor fingerprint, the sequence count, then sequence by sequence: image-token insertion
(per media item: kind, start and token count), the real-token count (attention mask), token
ids, position ids (1-D or 3-D, on the real tokens), loss spans, media ids and media cache keys.
At most one line per check and sequence. ``vision_token_offsets`` are not compared: they
depend on the batch's composition, and follow from the spans compared.
"""

from __future__ import annotations

import dataclasses

import torch

from rl_kernel_core.tools.multimodal.schema import MEDIA_KINDS, MultimodalBatch, Span


class ParityError(ValueError):
    """The rollout and training batches disagree; the message is the first difference."""


def _validated(name: str, batch: MultimodalBatch) -> None:
    if not isinstance(batch, MultimodalBatch):
        raise TypeError(f"{name} must be a MultimodalBatch, got {type(batch).__name__}")
    try:
        batch.validate()
    except ValueError as exc:
        raise ValueError(f"{name} batch: {exc}") from None


def _describe(span: Span) -> str:
    return f"{span.kind} at {span.start}, {span.length} tokens"


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    """Index of the first differing element of two 1-D tensors of one length, or -1."""
    diff = (a != b).nonzero()
    return int(diff[0]) if diff.numel() else -1


def _sequence(b: int, rollout: MultimodalBatch, training: MultimodalBatch) -> list[str]:
    lines = []
    media_r = [s for s in rollout.modality_spans[b] if s.kind in MEDIA_KINDS]
    media_t = [s for s in training.modality_spans[b] if s.kind in MEDIA_KINDS]
    for i, (r, t) in enumerate(zip(media_r, media_t)):
        if r != t:
            count = f" ({r.length} vs {t.length} {r.kind} tokens)" if r.length != t.length else ""
            lines.append(f"modality_spans[{b}] {r.kind} {i}: rollout {_describe(r)} vs training {_describe(t)}{count}")
            break
    else:
        if len(media_r) != len(media_t):
            lines.append(f"modality_spans[{b}]: rollout {len(media_r)} media items vs training {len(media_t)}")
    n_r, n_t = rollout.input_ids[b].shape[0], training.input_ids[b].shape[0]
    if n_r != n_t:
        lines.append(f"attention_mask[{b}]: rollout {n_r} real tokens vs training {n_t}")
    n = min(n_r, n_t)
    at = _first_difference(rollout.input_ids[b][:n], training.input_ids[b][:n].to(rollout.input_ids[b].device))
    if at >= 0:
        lines.append(
            f"input_ids[{b}][{at}]: rollout {int(rollout.input_ids[b][at])} vs training {int(training.input_ids[b][at])}"
        )
    elif n_r != n_t:
        lines.append(f"input_ids[{b}][{n}]: one side ends there (rollout {n_r} tokens vs training {n_t})")
    pos_r, pos_t = rollout.real_positions(b), training.real_positions(b).to(rollout.position_ids.device)
    if pos_r.dim() != pos_t.dim():
        lines.append(
            f"position_ids[{b}]: rollout {'3-D' if pos_r.dim() == 2 else '1-D'} vs training "
            f"{'3-D' if pos_t.dim() == 2 else '1-D'} positions"
        )
    else:
        at = _first_difference(
            pos_r.reshape(-1, pos_r.shape[-1])[:, :n].T.reshape(-1),
            pos_t.reshape(-1, pos_t.shape[-1])[:, :n].T.reshape(-1),
        )
        if at >= 0:
            token = at // (3 if pos_r.dim() == 2 else 1)
            lines.append(
                f"position_ids[{b}][{token}]: rollout {pos_r[..., token].tolist()} vs training {pos_t[..., token].tolist()}"
            )
    for i in range(max(len(rollout.loss_spans[b]), len(training.loss_spans[b]))):
        spans = [side.loss_spans[b][i] if i < len(side.loss_spans[b]) else None for side in (rollout, training)]
        if spans[0] != spans[1]:
            said = ["none" if s is None else _describe(s) for s in spans]
            lines.append(f"loss_spans[{b}][{i}]: rollout {said[0]} vs training {said[1]}")
            break
    for name in ("media_ids", "media_cache_keys"):
        for i, (r, t) in enumerate(zip(getattr(rollout, name)[b], getattr(training, name)[b])):
            if r != t:
                lines.append(f"{name}[{b}][{i}]: rollout {r!r} vs training {t!r}")
                break
    return lines


def compare(rollout: MultimodalBatch, training: MultimodalBatch) -> list[str]:
    """The differences between a rollout batch and a training batch, first one first; empty
    when they agree. Both are validated first (``ValueError`` naming the side, field and
    position when one is malformed). Padding side may differ: sequences compare on their real
    tokens."""
    _validated("rollout", rollout)
    _validated("training", training)
    lines = []
    for field in dataclasses.fields(rollout.fingerprint):
        r, t = getattr(rollout.fingerprint, field.name), getattr(training.fingerprint, field.name)
        if r != t:
            lines.append(f"fingerprint.{field.name}: rollout {r!r} vs training {t!r}")
    if len(rollout) != len(training):
        lines.append(f"sequence count: rollout {len(rollout)} vs training {len(training)}")
    for b in range(min(len(rollout), len(training))):
        lines += _sequence(b, rollout, training)
    return lines


def check(rollout: MultimodalBatch, training: MultimodalBatch) -> None:
    """Raise :class:`ParityError` with the first difference :func:`compare` finds; return None
    when the two batches agree."""
    lines = compare(rollout, training)
    if lines:
        raise ParityError(lines[0])
