"""A :class:`~rl_kernel_core.tools.multimodal.schema.MultimodalBatch` on disk, so the rollout side and
the training side (separate processes, often separate machines) can each save theirs and
``rl-kernel consistency --parity ROLLOUT TRAINING`` compare them.

The file is ``torch.save`` of plain tensors, lists, strings and ints (read back with
``weights_only=True``, so loading never runs code): ``{"format": FORMAT, "input_ids": [int64
tensors], "modality_spans": [[[kind, start, length, media_index], ...], ...], "loss_spans": (the
same), "media_ids", "vision_token_offsets", "media_cache_keys": nested lists, "attention_mask",
"position_ids": tensors, "fingerprint": {field: value}}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rl_kernel_core._checks import brief
from rl_kernel_core.tools.consistency.parity import Batch, open_regular, stored_tensor_problem
from rl_kernel_core.tools.multimodal.schema import MultimodalBatch, ProcessorFingerprint, Span

FORMAT = "rl-kernel.multimodal-batch.v1"
"""The format tag every saved multimodal batch carries."""


class NotMultimodal(ValueError):
    """The file loads but holds no multimodal batch (no :data:`FORMAT` tag): perhaps a text-only
    ``rl_kernel_core.tools.consistency.parity`` batch."""


def _span_rows(rows: list[list[Span]]) -> list[list[list[Any]]]:
    return [[[s.kind, s.start, s.length, s.media_index] for s in row] for row in rows]


def save(batch: MultimodalBatch, path: str) -> None:
    """Validate ``batch`` and write it to ``path`` in the format :func:`load` reads."""
    batch.validate()
    torch.save(
        {
            "format": FORMAT,
            "input_ids": [t.cpu() for t in batch.input_ids],
            "modality_spans": _span_rows(batch.modality_spans),
            "loss_spans": _span_rows(batch.loss_spans),
            "media_ids": batch.media_ids,
            "vision_token_offsets": batch.vision_token_offsets,
            "media_cache_keys": batch.media_cache_keys,
            "attention_mask": batch.attention_mask.cpu(),
            "position_ids": batch.position_ids.cpu(),
            "fingerprint": dataclasses.asdict(batch.fingerprint),
        },
        path,
    )


def _spans(path: str, name: str, rows: Any) -> list[list[Span]]:
    if not isinstance(rows, list):
        raise ValueError(f"{path}: {name} must be a list per sequence, got {type(rows).__name__}")
    out: list[list[Span]] = []
    for b, row in enumerate(rows):
        if not isinstance(row, list):
            raise ValueError(
                f"{path}: {name}[{b}] must be a list of [kind, start, length, media_index], got {type(row).__name__}"
            )
        out.append([])
        for i, entry in enumerate(row):
            if not isinstance(entry, list) or len(entry) != 4:
                raise ValueError(
                    f"{path}: {name}[{b}][{i}] must be [kind, start, length, media_index], got {brief(entry)}"
                )
            out[-1].append(Span(*entry))
    return out


def load(path: str) -> MultimodalBatch:
    """The batch :func:`save` wrote to ``path``, validated.

    Raises ``OSError`` when the file cannot be read, :class:`NotMultimodal` when ``torch.load``
    (``weights_only=True``) cannot load it or it carries no :data:`FORMAT` tag, and ``ValueError``
    naming the file, field and position when it is not a well-formed batch: among others a FIFO,
    device or directory in place of a file (refused before anything is read), a sparse, quantized
    or expanded tensor (a stride 0, or more elements than its storage holds), a field of the wrong
    type."""
    with open_regular(path) as f:
        try:
            with torch.serialization.safe_globals([Batch]):  # a text batch loads too, and is told apart below
                data = torch.load(f, map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as exc:  # torch.load raises KeyError, EOFError, UnpicklingError, ... for a file it cannot read
            reason = type(exc).__name__ + (f": {str(exc).strip().splitlines()[0]}" if str(exc).strip() else "")
            raise NotMultimodal(
                f"{path}: not a saved batch (torch.load with weights_only=True failed: {reason[:200]})"
            ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = brief(data.get("format")) if isinstance(data, dict) else type(data).__name__
        raise NotMultimodal(f"{path}: not a multimodal batch (format tag {FORMAT!r} expected, got {found})")
    fields = {f.name for f in dataclasses.fields(ProcessorFingerprint)}
    fingerprint = data.get("fingerprint")
    if not isinstance(fingerprint, dict) or set(fingerprint) != fields:
        keys = sorted(map(str, fingerprint)) if isinstance(fingerprint, dict) else type(fingerprint).__name__
        raise ValueError(f"{path}: fingerprint must be a dict of {sorted(fields)}, got {keys}")
    missing = [
        name
        for name in (
            "input_ids",
            "media_ids",
            "vision_token_offsets",
            "media_cache_keys",
            "attention_mask",
            "position_ids",
        )
        if name not in data
    ]
    if missing:
        raise ValueError(f"{path}: missing field {missing[0]}")
    if not isinstance(data["input_ids"], list):
        raise ValueError(
            f"{path}: input_ids must be a list of 1-D int64 tensors, got {type(data['input_ids']).__name__}"
        )
    tensors = [(f"input_ids[{b}]", t) for b, t in enumerate(data["input_ids"])]
    for name, value in [*tensors, ("attention_mask", data["attention_mask"]), ("position_ids", data["position_ids"])]:
        problem = stored_tensor_problem(value) if isinstance(value, torch.Tensor) else None
        if problem:  # validating it would materialise every element
            raise ValueError(f"{path}: {name} must be a dense tensor, {problem}")
    batch = MultimodalBatch(
        input_ids=data["input_ids"],
        modality_spans=_spans(path, "modality_spans", data.get("modality_spans")),
        loss_spans=_spans(path, "loss_spans", data.get("loss_spans")),
        media_ids=data["media_ids"],
        vision_token_offsets=data["vision_token_offsets"],
        media_cache_keys=data["media_cache_keys"],
        attention_mask=data["attention_mask"],
        position_ids=data["position_ids"],
        fingerprint=ProcessorFingerprint(**fingerprint),
    )
    try:
        batch.validate()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return batch
