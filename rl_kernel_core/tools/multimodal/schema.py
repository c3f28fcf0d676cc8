"""The multimodal batch: token ids with their modality and loss spans, media identity and the
processor that laid them out.

A :class:`MultimodalBatch` describes B sequences the way both sides of an RL step must agree on:
the rollout engine that generated them and the trainer that scores them. Per sequence it keeps
the real tokens (padding removed), so a left-padded rollout batch and a right-padded training
batch compare equal; spans index those real tokens. Batch-level tensors (``attention_mask``,
``position_ids``) keep the padded layout the model is fed.

Positions: :meth:`MultimodalBatch.from_processor` takes ``position_ids`` from the processor's
output when it has them; otherwise, when the output has ``image_grid_thw`` (Qwen2-VL and
Qwen2.5-VL processors), it lays out the 3-D rotary positions ``[3, B, L]`` the way those models'
``get_rope_index`` does for images (text tokens advance all three axes by one; an image's
tokens take ``start + (t, h, w)`` on its merged grid and advance the text position by
``max(h, w)``); otherwise the 1-D positions ``0..n-1`` of each row's real tokens. Padding
positions are 0, as transformers leaves them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from rl_kernel_core._checks import brief
from rl_kernel_core.spans import LossSpans

SPAN_KINDS: tuple[str, ...] = ("text", "image", "video", "tool")
"""What a modality span holds: text tokens, an image's placeholder tokens, a video's, or a tool
observation's text (tokens the policy did not generate)."""

MEDIA_KINDS: tuple[str, ...] = ("image", "video")


@dataclass(frozen=True)
class Span:
    """A run of ``length`` tokens from token ``start`` of one sequence's real tokens.

    ``kind`` is one of :data:`SPAN_KINDS`; ``media_index`` is the index of the media item (into the
    sequence's ``media_ids``) for image and video spans, None otherwise.
    """

    kind: str
    start: int
    length: int
    media_index: Optional[int] = None

    @property
    def end(self) -> int:
        """One past the span's last token."""
        return self.start + self.length


@dataclass(frozen=True)
class ProcessorFingerprint:
    """What makes two processors lay out the same conversation the same way.

    ``processor_class``: the processor's class name; ``transformers_version``; ``image_token_id``:
    the placeholder token an image expands into; ``patch_size`` (pixels per patch side) and
    ``merge_size`` (patches merged per side into one LM token), None where the processor has no
    such setting; ``chat_template_sha256``: sha256 of the chat template text (of its JSON, sorted,
    when the processor holds several named templates), None without one.
    """

    processor_class: str
    transformers_version: str
    image_token_id: int
    patch_size: Optional[int]
    merge_size: Optional[int]
    chat_template_sha256: Optional[str]

    @classmethod
    def of(cls, processor: Any) -> "ProcessorFingerprint":
        """The fingerprint of a transformers processor (``ProcessorMixin``: a tokenizer plus an
        image processor). Raises ``ValueError`` when it has no image token."""
        import transformers

        tokenizer = getattr(processor, "tokenizer", None)
        image_processor = getattr(processor, "image_processor", None)
        token_id = getattr(processor, "image_token_id", None)
        token = getattr(processor, "image_token", None)
        if token_id is None and token is not None and tokenizer is not None:
            token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(
                f"processor: {type(processor).__name__} has no image token id (image_token_id or image_token "
                f"known to its tokenizer), got {token_id!r}"
            )
        template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = json.dumps(template, sort_keys=True, default=repr)
        if template is not None and not isinstance(template, str):
            raise ValueError(
                f"processor: chat_template must be a str or a dict of named templates, got {type(template).__name__}"
            )
        return cls(
            processor_class=type(processor).__name__,
            transformers_version=transformers.__version__,
            image_token_id=token_id,
            patch_size=_setting(image_processor, processor, "patch_size"),
            merge_size=_setting(image_processor, processor, "merge_size"),
            chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if template else None,
        )

    def check(self) -> None:
        """Each field's type and range: ``ValueError`` naming the first wrong one (e.g.
        ``fingerprint.image_token_id: must be an int in [0, 2**63), got str '4'``)."""
        for name in ("processor_class", "transformers_version"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"fingerprint.{name}: must be a str, got {_found(getattr(self, name))}")
        token = self.image_token_id
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63:
            raise ValueError(f"fingerprint.image_token_id: must be an int in [0, 2**63), got {_found(token)}")
        for name in ("patch_size", "merge_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31):
                raise ValueError(f"fingerprint.{name}: must be None or an int in [1, 2**31), got {_found(value)}")
        if self.chat_template_sha256 is not None and not isinstance(self.chat_template_sha256, str):
            raise ValueError(
                f"fingerprint.chat_template_sha256: must be None or a str, got {_found(self.chat_template_sha256)}"
            )


def _found(value: object) -> str:
    """What an error message says it got: its type and value, on one line (a tensor: dtype and shape)."""
    return brief(value) if isinstance(value, torch.Tensor) else f"{type(value).__name__} {brief(value)}"


def _setting(image_processor: Any, processor: Any, name: str) -> Optional[int]:
    """An int setting of the image processor, else of the processor (LLaVA keeps ``patch_size`` there)."""
    for owner in (image_processor, processor):
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


SpanLike = Union[Span, Sequence[int]]


@dataclass
class MultimodalBatch:
    """B sequences of image-text tokens with their layout.

    Per sequence b (lists of length B):

    * ``input_ids[b]``: ``[n_b]`` int64, the real tokens (padding removed).
    * ``modality_spans[b]``: :class:`Span` s covering ``[0, n_b)`` in order, no gaps: text runs
      and one span per media item (its placeholder tokens, ``media_index`` 0, 1, ... in order).
    * ``loss_spans[b]``: ``"text"`` spans of the tokens whose log-prob is scored (e.g. the
      assistant's answer), in order, not overlapping, outside media spans, ``start >= 1`` (token
      0 has no preceding position to predict it).
    * ``media_ids[b]``: an id per media item (the caller's, e.g. a dataset key).
    * ``vision_token_offsets[b]``: per media item, the row of its first token in the batch's
      concatenated vision embeddings (the vision tower's merged output, media in sequence order),
      i.e. the running sum of the media spans' lengths over the batch.
    * ``media_cache_keys[b]``: per media item, ``"sha256:<hex>"`` of its preprocessed pixels and
      grid, so two sides (or a vision-embedding cache) can tell whether they saw the same pixels.

    Batch level: ``attention_mask [B, L]`` int (1 on real tokens, one contiguous run per row:
    left or right padding), ``position_ids [B, L]`` or ``[3, B, L]`` int64 (3-D rotary positions,
    Qwen2-VL's mrope: temporal, height, width), ``fingerprint`` the processor's
    :class:`ProcessorFingerprint`.
    """

    input_ids: list[torch.Tensor]
    modality_spans: list[list[Span]]
    loss_spans: list[list[Span]]
    media_ids: list[list[str]]
    vision_token_offsets: list[list[int]]
    media_cache_keys: list[list[str]]
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    fingerprint: ProcessorFingerprint

    def __len__(self) -> int:
        return len(self.input_ids)

    def real_positions(self, b: int) -> torch.Tensor:
        """Sequence ``b``'s position ids on its real tokens: ``[n_b]`` or ``[3, n_b]``."""
        real = self.attention_mask[b].bool()
        return self.position_ids[b][real] if self.position_ids.dim() == 2 else self.position_ids[:, b][:, real]

    def padded_input_ids(self, pad_token_id: int) -> torch.Tensor:
        """``[B, L]`` int64 token ids in the ``attention_mask`` layout, ``pad_token_id`` on padding."""
        out = torch.full(self.attention_mask.shape, pad_token_id, dtype=torch.int64, device=self.attention_mask.device)
        for b, ids in enumerate(self.input_ids):
            out[b][self.attention_mask[b].bool()] = ids.to(out.device)
        return out

    def scored_rows(self) -> LossSpans:
        """The loss spans as :class:`~rl_kernel_core.spans.LossSpans` over the padded ``[B, L]``
        rows of the model's output, shifted by one: the row that predicts a scored token is the
        one before it. Pass it as ``loss_spans=`` with ``hidden [B, L, D]`` and next-token
        ``targets [B, L]`` (``targets[b, p]`` = the token at padded position ``p + 1``)."""
        pairs = []
        for b, spans in enumerate(self.loss_spans):
            first = int(self.attention_mask[b].nonzero()[0]) if spans else 0
            pairs.append([(first + s.start - 1, s.length) for s in spans])
        return LossSpans.from_pairs(pairs, self.attention_mask.shape[1], device=self.attention_mask.device)

    @classmethod
    def from_processor(
        cls,
        processor: Any,
        encoded: Mapping[str, Any],
        *,
        loss_spans: Sequence[Sequence[SpanLike]],
        media_ids: Optional[Sequence[Sequence[str]]] = None,
    ) -> "MultimodalBatch":
        """The batch a transformers processor's output describes.

        Args:
            processor: the processor that produced ``encoded`` (e.g. ``Qwen2VLProcessor``).
            encoded: its output (``BatchFeature`` or dict, ``return_tensors="pt"``): ``input_ids
                [B, L]``, ``attention_mask [B, L]`` (all ones when absent), and for images
                ``pixel_values`` with ``image_grid_thw [num_images, 3]`` (Qwen2-VL: patches
                ``[sum t·h·w, C·T·P·P]``) or ``pixel_values [num_images, ...]`` (one image
                per contiguous run of image tokens); optional ``position_ids [B, L]`` or
                ``[3, B, L]``. Video inputs are refused (not covered; docs/multimodal.md), as is an
                ``image_grid_thw`` whose sides h, w are not multiples of the processor's merge size.
            loss_spans: per sequence, the scored token runs as :class:`Span` s or
                ``(start, length)`` pairs over that sequence's real tokens.
            media_ids: per sequence, an id per image in order; None uses the media cache keys.

        Returns:
            The validated batch. Raises ``ValueError`` naming the field and position where the
            processor output and the arguments disagree.
        """
        fingerprint = ProcessorFingerprint.of(processor)
        try:
            fingerprint.check()
        except ValueError as exc:
            raise ValueError(f"processor: {type(processor).__name__}'s {exc}") from None
        if not isinstance(encoded, Mapping):
            raise ValueError(
                f"encoded: must be the processor's output (a BatchFeature or dict), got {type(encoded).__name__}"
            )
        for key in ("video_grid_thw", "pixel_values_videos"):
            if key in encoded:
                raise ValueError(
                    f"encoded[{key!r}]: video inputs are not covered by MultimodalBatch yet (images only; "
                    "see docs/multimodal.md)"
                )
        ids = _int_tensor("encoded['input_ids']", encoded.get("input_ids"), 2)
        mask = encoded.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else _int_tensor("encoded['attention_mask']", mask, 2)
        if mask.shape != ids.shape:
            raise ValueError(
                f"encoded['attention_mask'] must have input_ids' shape {tuple(ids.shape)}, got {tuple(mask.shape)}"
            )
        _zeros_and_ones("encoded['attention_mask']", mask)
        grid = encoded.get("image_grid_thw")
        grid = None if grid is None else _grid(grid, fingerprint.merge_size or 1)
        num = ids.shape[0]
        loss_spans = _per_sequence("loss_spans", loss_spans, num, "a list of Span or (start, length) pairs")
        if media_ids is not None:
            media_ids = _per_sequence("media_ids", media_ids, num, "a list of ids, one per image")

        rows = [ids[b][mask[b].bool()].to(torch.int64).cpu() for b in range(ids.shape[0])]
        modality = _media_spans(rows, fingerprint, grid)
        keys = _cache_keys(modality, encoded.get("pixel_values"), grid)
        offsets: list[list[int]] = []
        running = 0
        for spans in modality:
            offsets.append([])
            for span in spans:
                if span.kind in MEDIA_KINDS:
                    offsets[-1].append(running)
                    running += span.length
        if "position_ids" in encoded:
            positions = _int_tensor("encoded['position_ids']", encoded["position_ids"], None).to(torch.int64)
        elif grid is not None:
            positions = _mrope_positions(modality, mask, grid, fingerprint.merge_size or 1)
        else:
            positions = ((mask.cumsum(-1) - 1).clamp(min=0) * mask).to(torch.int64)
        batch = cls(
            input_ids=rows,
            modality_spans=modality,
            loss_spans=[
                [_as_span(f"loss_spans[{b}][{i}]", s) for i, s in enumerate(spans)]
                for b, spans in enumerate(loss_spans)
            ],
            media_ids=[list(m) for m in media_ids] if media_ids is not None else [list(k) for k in keys],
            vision_token_offsets=offsets,
            media_cache_keys=keys,
            attention_mask=mask.to(torch.int64),
            position_ids=positions,
            fingerprint=fingerprint,
        )
        batch.validate()
        return batch

    def validate(self) -> None:
        """Check every field against the others; raise ``ValueError`` naming the first wrong
        field and position (e.g. ``loss_spans[2][0]: start 40 + length 9 exceeds the sequence
        length 45``)."""
        if not isinstance(self.input_ids, (list, tuple)):
            raise ValueError(
                f"input_ids: must be a list of 1-D int64 tensors, one per sequence, got {_found(self.input_ids)}"
            )
        num = len(self.input_ids)
        for name in ("modality_spans", "loss_spans", "media_ids", "vision_token_offsets", "media_cache_keys"):
            value = getattr(self, name)
            if not isinstance(value, list) or len(value) != num:
                found = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
                raise ValueError(
                    f"{name}: must be a list with one entry per sequence ({num}, as input_ids), got {found}"
                )
        if not isinstance(self.fingerprint, ProcessorFingerprint):
            raise ValueError(f"fingerprint: must be a ProcessorFingerprint, got {type(self.fingerprint).__name__}")
        self.fingerprint.check()
        mask = _int_tensor("attention_mask", self.attention_mask, 2)
        if mask.shape[0] != num:
            raise ValueError(f"attention_mask: must have one row per sequence ({num}), got shape {tuple(mask.shape)}")
        _zeros_and_ones("attention_mask", mask)
        positions = _int_tensor("position_ids", self.position_ids, None)
        expected = [tuple(mask.shape), (3, *mask.shape)]
        if tuple(positions.shape) not in expected:
            raise ValueError(
                f"position_ids: must have shape {expected[0]} or {expected[1]} (attention_mask's layout), "
                f"got {tuple(positions.shape)}"
            )
        media_running = 0
        for b in range(num):
            media_running = self._validate_sequence(b, mask[b], media_running)

    def _validate_sequence(self, b: int, mask_row: torch.Tensor, media_running: int) -> int:
        ids = self.input_ids[b]
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dtype != torch.int64
            or ids.dim() != 1
            or ids.layout != torch.strided
        ):
            found = (
                f"{ids.dtype} tensor of shape {tuple(ids.shape)}{_layout(ids)}"
                if isinstance(ids, torch.Tensor)
                else type(ids).__name__
            )
            raise ValueError(f"input_ids[{b}]: must be a 1-D int64 tensor, got {found}")
        n = ids.shape[0]
        real = mask_row.nonzero().flatten().tolist()
        if len(real) != n:
            raise ValueError(f"attention_mask[{b}]: {len(real)} real tokens, but input_ids[{b}] holds {n}")
        if real and real != list(range(real[0], real[0] + n)):
            raise ValueError(
                f"attention_mask[{b}]: padding between real tokens (real positions {real[0]}..{real[-1]} hold {n})"
            )
        media = [s for s in _spans(f"modality_spans[{b}]", self.modality_spans[b]) if s.kind in MEDIA_KINDS]
        cursor, seen = 0, 0
        for i, span in enumerate(self.modality_spans[b]):
            where = f"modality_spans[{b}][{i}]"
            _check_span(where, span, n)
            if span.start != cursor:
                raise ValueError(
                    f"{where}: starts at {span.start}, expected {cursor} (spans cover the sequence in order, no gaps)"
                )
            cursor = span.end
            if span.kind in MEDIA_KINDS:
                if span.media_index != seen:
                    raise ValueError(f"{where}: media_index must be {seen} (media in order), got {span.media_index}")
                seen += 1
                if span.kind == "image":
                    wrong = (ids[span.start : span.end] != self.fingerprint.image_token_id).nonzero()
                    if wrong.numel():
                        t = span.start + int(wrong[0])
                        raise ValueError(
                            f"{where}: token {t} is {int(ids[t])}, not the image token "
                            f"{self.fingerprint.image_token_id}"
                        )
            elif span.media_index is not None:
                raise ValueError(f"{where}: a {span.kind} span has no media, got media_index {span.media_index}")
        if cursor != n:
            raise ValueError(f"modality_spans[{b}]: cover tokens [0, {cursor}), expected the whole sequence [0, {n})")
        for name, kind in (("media_ids", str), ("vision_token_offsets", int), ("media_cache_keys", str)):
            value = getattr(self, name)[b]
            if not isinstance(value, list) or len(value) != len(media):
                found = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
                raise ValueError(f"{name}[{b}]: must hold one entry per media item ({len(media)}), got {found}")
            for i, entry in enumerate(value):
                if isinstance(entry, bool) or not isinstance(entry, kind):
                    raise ValueError(
                        f"{name}[{b}][{i}]: must be {'a str' if kind is str else 'an int'}, got {_found(entry)}"
                    )
        for i, span in enumerate(media):
            if self.vision_token_offsets[b][i] != media_running:
                raise ValueError(
                    f"vision_token_offsets[{b}][{i}]: must be {media_running} (media tokens before it in the "
                    f"batch), got {self.vision_token_offsets[b][i]}"
                )
            media_running += span.length
        end = 0
        for i, span in enumerate(_spans(f"loss_spans[{b}]", self.loss_spans[b])):
            where = f"loss_spans[{b}][{i}]"
            _check_span(where, span, n)
            if span.kind != "text":
                raise ValueError(f"{where}: loss spans score text tokens, got kind {span.kind!r}")
            if span.media_index is not None:
                raise ValueError(f"{where}: a loss span has no media, got media_index {span.media_index}")
            if span.start < max(1, end):
                raise ValueError(
                    f"{where}: start {span.start} must be >= {max(1, end)} (token 0 is never scored; spans in "
                    "order, not overlapping)"
                )
            end = span.end
            for m in self.modality_spans[b]:  # media and tool observations are not the policy's tokens
                if m.kind != "text" and span.start < m.end and m.start < span.end:
                    what = m.kind if m.media_index is None else f"{m.kind} {m.media_index}"
                    raise ValueError(
                        f"{where}: tokens [{span.start}, {span.end}) overlap {what} at [{m.start}, {m.end})"
                    )
        return media_running


def _spans(where: str, spans: object) -> list[Span]:
    if not isinstance(spans, list):
        raise ValueError(f"{where}: must be a list of Span, got {type(spans).__name__}")
    for i, span in enumerate(spans):
        if not isinstance(span, Span):
            raise ValueError(f"{where}[{i}]: must be a Span, got {_found(span)}")
    return spans


def _check_span(where: str, span: Span, n: int) -> None:
    if not isinstance(span.kind, str) or span.kind not in SPAN_KINDS:
        raise ValueError(f"{where}: kind must be one of {list(SPAN_KINDS)}, got {brief(span.kind)}")
    for name in ("start", "length"):
        value = getattr(span, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {name} must be an int, got {type(value).__name__}")
    index = span.media_index
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        raise ValueError(f"{where}: media_index must be None or an int, got {type(index).__name__}")
    if span.start < 0 or span.length < 1:
        raise ValueError(f"{where}: start must be >= 0 and length >= 1, got start {span.start}, length {span.length}")
    if span.end > n:
        raise ValueError(f"{where}: start {span.start} + length {span.length} exceeds the sequence length {n}")


def _as_span(where: str, value: SpanLike) -> Span:
    if isinstance(value, Span):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Span("text", value[0], value[1])
    raise ValueError(f"{where}: must be a Span or a (start, length) pair, got {_found(value)}")


def _layout(value: torch.Tensor) -> str:
    return "" if value.layout == torch.strided else f", layout {str(value.layout).replace('torch.', '')}"


def _int_tensor(name: str, value: object, ndim: Optional[int]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex() or value.is_quantized:
        found = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: must be an integer tensor, got {found}")
    if value.layout != torch.strided:
        raise ValueError(
            f"{name}: must be a dense (strided) tensor, got layout {str(value.layout).replace('torch.', '')}"
        )
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: must be {ndim}-D, got shape {tuple(value.shape)}")
    return value


def _zeros_and_ones(name: str, mask: torch.Tensor) -> None:
    """An attention mask holds 0 (padding) and 1 (real tokens) only."""
    wrong = ((mask != 0) & (mask != 1)).nonzero()
    if wrong.numel():
        at = wrong[0].tolist()
        raise ValueError(f"{name}: must hold 0 and 1 only, got {int(mask[tuple(at)])} at {at}")


def _per_sequence(name: str, value: object, num: int, what: str) -> list[list]:
    """``value`` as a list of ``num`` lists (each entry a list or tuple), or ``ValueError`` naming ``name``."""
    if not isinstance(value, (list, tuple)) or len(value) != num:
        found = f"{len(value)} entries" if isinstance(value, (list, tuple)) else _found(value)
        raise ValueError(f"{name} must hold one list per sequence ({num}), got {found}")
    for b, entry in enumerate(value):
        if not isinstance(entry, (list, tuple)):
            raise ValueError(f"{name}[{b}]: must be {what}, got {_found(entry)}")
    return [list(entry) for entry in value]


def _grid(value: object, merge: int) -> torch.Tensor:
    """``encoded['image_grid_thw']``: ``[num_images, 3]`` of (t, h, w) patches, each >= 1, the
    sides h and w multiples of the merge size."""
    name = "encoded['image_grid_thw']"
    grid = _int_tensor(name, value, 2)
    if grid.shape[1] != 3:
        raise ValueError(f"{name}: must have shape [num_images, 3] (t, h, w per image), got {tuple(grid.shape)}")
    for k, (t, h, w) in enumerate(grid.tolist()):
        if min(t, h, w) < 1 or max(t, h, w) >= 2**31:
            raise ValueError(f"{name}[{k}]: (t, h, w) must each be in [1, 2**31), got {[t, h, w]}")
        if h % merge or w % merge:
            raise ValueError(
                f"{name}[{k}]: the sides h and w must be multiples of the processor's merge_size {merge}, "
                f"got (t, h, w) = {[t, h, w]}"
            )
    return grid


def _media_spans(
    rows: list[torch.Tensor], fingerprint: ProcessorFingerprint, grid: Optional[torch.Tensor]
) -> list[list[Span]]:
    """Each row's text runs and image spans: runs of the image token, split by ``grid``'s token
    counts (``t·h·w / merge²`` per image, images in batch order) when given, else one image per run."""
    merge = fingerprint.merge_size or 1
    counts = None if grid is None else [int(t * h * w) // (merge * merge) for t, h, w in grid.tolist()]
    image = 0
    out = []
    for b, row in enumerate(rows):
        spans: list[Span] = []
        is_image = row == fingerprint.image_token_id
        change = (is_image[1:] != is_image[:-1]).nonzero().flatten().add(1).tolist()
        bounds = [0, *change, row.shape[0]] if row.shape[0] else [0]
        for start, end in zip(bounds[:-1], bounds[1:]):
            if not bool(is_image[start]):
                spans.append(Span("text", start, end - start))
                continue
            at = start
            while at < end:
                if counts is None:
                    need = end - at
                elif image >= len(counts):
                    raise ValueError(
                        f"input_ids[{b}][{at}]: image tokens beyond the {len(counts)} images of image_grid_thw"
                    )
                else:
                    need = counts[image]
                if at + need > end:
                    raise ValueError(
                        f"input_ids[{b}][{at}]: image {image} needs {need} image tokens (image_grid_thw "
                        f"{grid[image].tolist() if grid is not None else None} / merge {merge}²), the run holds "
                        f"{end - at}"
                    )
                index = sum(s.kind == "image" for s in spans)
                spans.append(Span("image", at, need, index))
                at += need
                image += 1
        out.append(spans)
    if counts is not None and image != len(counts):
        raise ValueError(
            f"encoded['image_grid_thw']: {len(counts)} images, but the input ids hold the tokens of {image}"
        )
    return out


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _cache_keys(
    modality: list[list[Span]], pixels: Optional[torch.Tensor], grid: Optional[torch.Tensor]
) -> list[list[str]]:
    """Per image, the digest of its pixel rows (and grid): Qwen2-VL's patches ``[sum t·h·w, ...]``
    split by ``grid``, else ``pixels[k]`` for image k."""
    total = sum(s.kind == "image" for spans in modality for s in spans)
    if total == 0:
        return [[] for _ in modality]
    if not isinstance(pixels, torch.Tensor) or pixels.dim() < 1 or pixels.layout != torch.strided:
        found = (
            f"shape {tuple(pixels.shape)}{_layout(pixels)}"
            if isinstance(pixels, torch.Tensor)
            else type(pixels).__name__
        )
        raise ValueError(
            f"encoded['pixel_values']: must be a dense tensor of at least 1 dim for the {total} images, got {found}"
        )
    if grid is not None:
        sizes = [int(t * h * w) for t, h, w in grid.tolist()]
        if sum(sizes) != pixels.shape[0]:
            raise ValueError(
                f"encoded['pixel_values']: {pixels.shape[0]} patch rows, but image_grid_thw needs {sum(sizes)}"
            )
        items = [
            (pixels[o - n : o], grid[k]) for k, (n, o) in enumerate(zip(sizes, torch.tensor(sizes).cumsum(0).tolist()))
        ]
    else:
        if pixels.shape[0] != total:
            raise ValueError(f"encoded['pixel_values']: {pixels.shape[0]} images, but the input ids hold {total}")
        items = [(pixels[k], torch.tensor(pixels.shape[1:])) for k in range(total)]
    keys = iter(_digest(*item) for item in items)
    return [[next(keys) for s in spans if s.kind == "image"] for spans in modality]


def _mrope_positions(modality: list[list[Span]], mask: torch.Tensor, grid: torch.Tensor, merge: int) -> torch.Tensor:
    """``[3, B, L]`` rotary positions of Qwen2-VL's ``get_rope_index`` for image-text rows."""
    positions = torch.zeros((3, *mask.shape), dtype=torch.int64)
    image = 0
    for b, spans in enumerate(modality):
        parts, cursor = [], 0
        for span in spans:
            if span.kind != "image":
                parts.append(torch.arange(cursor, cursor + span.length).expand(3, -1))
                cursor += span.length
                continue
            t, h, w = grid[image].tolist()
            gh, gw = h // merge, w // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cursor)
            cursor += max(gh, gw)
            image += 1
        if parts:
            positions[:, b, mask[b].bool().cpu()] = torch.cat(parts, dim=1)
    return positions.to(mask.device)
