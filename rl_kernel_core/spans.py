"""Compact loss spans: which token rows of a ``[B, T]`` layout are scored, held as an index so the
LM head only ever sees those rows.

In an image-text RL batch most positions are image placeholders and prompt tokens; the policy
is scored on the assistant's text alone. A dense mask makes every position pay for its
``[V]`` logits and then throws them away. :class:`LossSpans` gathers the scored rows into a
compact ``[N_scored, ...]`` tensor (what :func:`rl_kernel_core.linear_logprob` and
:func:`rl_kernel_core.fused_linear_policy_loss` then score) and scatters results and
gradients back to exactly those rows. The public ops take it as ``loss_spans=`` in place of a
dense mask.

The span table lives on the host (the dataloader knows it, as verl knows ``cu_seqlens``): its
spans are checked there, one Python step per span (never per row), and the row index is built
from them on the device with a few vectorised ops (no host list of rows, no copy of one); gathering
and scattering never read a value back (no host sync, no data-dependent shapes). Gather and
scatter are copies to distinct rows (``index_select`` / ``index_copy``, no atomics):
deterministic, forward and backward. Spans covering more than :data:`MAX_ROWS` rows in all are
refused (``ValueError`` naming the span), as is a layout whose flat row ids do not fit in int64.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from rl_kernel_core._checks import brief

IntSequence = Union[Sequence[int], torch.Tensor]

MAX_ROWS = 2**31 - 1
"""The most scored rows one :class:`LossSpans` holds (its index and padded slots take 16 bytes a
row on the device; a ``[B, T]`` layout with more scored rows than this has terabytes of hidden
states)."""

_MAX_FLAT = 2**63 - 1  # the flat row ids ``b * T + t`` are int64


class _MoveRows(torch.autograd.Function):
    """``out[dst] = src[src_index]`` into ``dst_rows`` zero rows (``dst`` None: ``out = src[src_index]``);
    the backward moves the gradient the other way. Indices are distinct, so both are plain copies."""

    @staticmethod
    def forward(
        ctx, src: torch.Tensor, src_index: torch.Tensor, dst: Optional[torch.Tensor], dst_rows: int
    ) -> torch.Tensor:
        ctx.save_for_backward(src_index, dst)
        ctx.src_rows = src.shape[0]
        picked = src.index_select(0, src_index)
        if dst is None:
            return picked
        return src.new_zeros((dst_rows, *src.shape[1:])).index_copy_(0, dst, picked)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        src_index, dst = ctx.saved_tensors
        picked = grad if dst is None else grad.index_select(0, dst)
        out = grad.new_zeros((ctx.src_rows, *grad.shape[1:])).index_copy_(0, src_index, picked)
        return out, None, None, None


def _listed(name: str, value: object, what: str) -> list:
    """``value``'s items as a list (any iterable but a string or a tensor); ``TypeError`` naming ``name`` else."""
    if not isinstance(value, (str, bytes, torch.Tensor)):
        try:
            return list(value)  # type: ignore[call-overload]
        except TypeError:
            pass
    raise TypeError(
        f"{name} must be {what}, got {brief(value) if isinstance(value, torch.Tensor) else type(value).__name__}"
    )


def _host_ints(name: str, value: IntSequence) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a 1-D integer tensor or a list of ints, got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return [int(x) for x in value.tolist()]
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}[{i}] must be an int, got {type(x).__name__}")
        out.append(x)
    return out


class LossSpans:
    """The scored rows of a ``[num_seqs, seq_len]`` token layout, compact.

    Attributes:
        num_seqs, seq_len: the layout (B, T). A packed batch (one stream of all sequences'
            tokens, ``[N_total]``) is ``num_seqs=1, seq_len=N_total``.
        index: ``[N_scored]`` int64, the scored rows' flat ids ``b * T + t``, sequence by
            sequence, ascending: the compact order.
        cu_seqlens: ``[B + 1]`` int64 on the host, cumulative scored rows per sequence
            (sequence b's rows are ``index[cu_seqlens[b]:cu_seqlens[b + 1]]``).
        max_seqlen: the most scored rows of one sequence.
    """

    def __init__(self, rows: list[list[int]], seq_len: int, device: Optional[Union[str, torch.device]] = None) -> None:
        """``rows[b]``: sequence b's scored rows, ascending, each in ``[0, seq_len)``, unchecked;
        :meth:`from_pairs` and :meth:`from_cu_offsets` check their spans and build it from them
        (without a list of rows)."""
        counts = [len(r) for r in rows]
        width, first = max(counts, default=0), 0
        runs = []
        for b, n in enumerate(counts):  # one run per sequence: row p is its (p - first)-th scored row
            runs.append((b * seq_len, b * width - first, n))
            first += n
        self._set(runs, counts, seq_len, device)
        flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)
        self.index += flat - torch.arange(flat.shape[0], device=flat.device)  # b * seq_len + rows[b][p - first]

    def _set(
        self,
        runs: list[tuple[int, int, int]],
        counts: list[int],
        seq_len: int,
        device: Optional[Union[str, torch.device]],
    ) -> None:
        """Fill the fields from runs of consecutive scored rows in compact order and the rows per
        sequence (host). A run ``(index_base, slot_base, length)`` of compact rows ``p`` has flat id
        ``index_base + p`` and padded slot ``slot_base + p``; both are expanded on ``device``."""
        self.num_seqs, self.seq_len = len(counts), seq_len
        self.cu_seqlens = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
        self.max_seqlen = max(counts, default=0)
        table = torch.tensor(runs, dtype=torch.int64, device=device).reshape(-1, 3)
        total = sum(counts)
        position = torch.arange(total, device=table.device)
        index_base, slot_base, length = table.unbind(1)
        self.index = torch.repeat_interleave(index_base, length, output_size=total).add_(position)
        self._padded_slot = torch.repeat_interleave(slot_base, length, output_size=total).add_(position)

    @classmethod
    def _from_runs(
        cls, runs: list[tuple[int, int, int]], num_seqs: int, seq_len: int, device: Optional[Union[str, torch.device]]
    ) -> "LossSpans":
        """Spans given as checked ``(sequence, start, length)`` runs, in compact order (sequence
        ascending, then start), each of length >= 1; the rows are expanded on ``device``."""
        counts = [0] * num_seqs
        for b, _, length in runs:
            counts[b] += length
        width = max(counts, default=0)
        first = [0] * num_seqs  # each sequence's first compact row
        for b in range(1, num_seqs):
            first[b] = first[b - 1] + counts[b - 1]
        bases, compact = [], 0
        for b, start, length in runs:  # row start + (p - compact) of sequence b; slot p - first[b] of row b
            bases.append((b * seq_len + start - compact, b * width - first[b], length))
            compact += length
        out = object.__new__(cls)
        out._set(bases, counts, seq_len, device)
        return out

    @property
    def device(self) -> torch.device:
        return self.index.device

    @property
    def total(self) -> int:
        """N_scored, the number of scored rows."""
        return self.index.shape[0]

    @classmethod
    def from_pairs(
        cls,
        pairs: Sequence[Sequence[tuple[int, int]]],
        seq_len: int,
        *,
        device: Optional[Union[str, torch.device]] = None,
    ) -> "LossSpans":
        """Spans given per sequence as ``(start, length)`` pairs over its ``seq_len`` rows.

        ``pairs[b]`` lists sequence b's spans, in order, not overlapping, each inside ``[0,
        seq_len)``; a sequence may have none. Raises ``ValueError`` naming ``pairs[b][i]`` (or
        ``seq_len``), also when the spans cover more than :data:`MAX_ROWS` rows in all or the
        layout's flat row ids ``b * seq_len + t`` would not fit in int64."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}")
        pairs = _listed("pairs", pairs, "a list per sequence of (start, length) pairs")
        if len(pairs) * seq_len > _MAX_FLAT + 1:
            raise ValueError(
                f"seq_len: {len(pairs)} sequences of {seq_len} rows make {len(pairs) * seq_len} flat row ids "
                f"(b * seq_len + t), more than int64 holds ({_MAX_FLAT + 1})"
            )
        runs: list[tuple[int, int, int]] = []
        total = 0
        for b, spans in enumerate(pairs):
            low = 0
            spans = _listed(f"pairs[{b}]", spans, "a list of (start, length) pairs")
            for i, pair in enumerate(spans):
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise ValueError(f"pairs[{b}][{i}] must be a (start, length) pair, got {brief(pair)}")
                start, length = _host_ints(f"pairs[{b}][{i}]", pair)
                if start < low or length < 1 or start + length > seq_len:
                    raise ValueError(
                        f"pairs[{b}][{i}]: span (start {start}, length {length}) must have length >= 1 and lie in "
                        f"[{low}, {seq_len}) (inside the sequence, after the previous span)"
                    )
                total += length
                if total > MAX_ROWS:
                    raise ValueError(
                        f"pairs[{b}][{i}]: span (start {start}, length {length}) brings the scored rows to "
                        f"{total}, more than the {MAX_ROWS} a LossSpans holds"
                    )
                runs.append((b, start, length))
                low = start + length
        return cls._from_runs(runs, len(pairs), seq_len, device)

    @classmethod
    def from_cu_offsets(
        cls,
        starts: IntSequence,
        cu_offsets: IntSequence,
        seq_len: int,
        *,
        device: Optional[Union[str, torch.device]] = None,
    ) -> "LossSpans":
        """One span per sequence, in ``cu_seqlens`` form: sequence b's scored rows are
        ``[starts[b], starts[b] + cu_offsets[b + 1] - cu_offsets[b])``, which land at compact rows
        ``[cu_offsets[b], cu_offsets[b + 1])``.

        ``starts [B]`` and ``cu_offsets [B + 1]`` (``cu_offsets[0] == 0``, non-decreasing) are
        lists or integer tensors, read on the host (one copy back when they live on a GPU)."""
        s = _host_ints("starts", starts)
        cu = _host_ints("cu_offsets", cu_offsets)
        if len(cu) != len(s) + 1 or (cu and cu[0] != 0):
            raise ValueError(
                f"cu_offsets must hold len(starts) + 1 = {len(s) + 1} entries starting at 0, got {brief(cu)}"
            )
        pairs = []
        for b, start in enumerate(s):
            length = cu[b + 1] - cu[b]
            if length < 0:
                raise ValueError(f"cu_offsets must be non-decreasing, got {cu[b]} then {cu[b + 1]} at {b}")
            pairs.append([(start, length)] if length else [])
        return cls.from_pairs(pairs, seq_len, device=device)

    def to(self, device: Union[str, torch.device]) -> "LossSpans":
        """These spans with their index on ``device``."""
        out = object.__new__(LossSpans)
        out.__dict__.update(self.__dict__)
        out.index, out._padded_slot = self.index.to(device), self._padded_slot.to(device)
        return out

    def check_layout(self, name: str, t: torch.Tensor, trailing: int) -> None:
        """``t``'s dims before its last ``trailing`` must flatten to ``[B, T]`` = these spans'
        layout (the last of them T), on the spans' device; raises naming ``name``."""
        lead = t.shape[: t.dim() - trailing]
        rows = 1
        for n in lead[:-1]:
            rows *= n
        if not lead or lead[-1] != self.seq_len or rows != self.num_seqs:
            raise ValueError(
                f"{name} must have leading shape [..., T] with B = {self.num_seqs} sequences of T = "
                f"{self.seq_len} (loss_spans' layout), got {tuple(t.shape)}"
            )
        if t.device != self.device:
            raise ValueError(f"loss_spans must be on {name}'s device {t.device}, got {self.device} (LossSpans.to)")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` → ``[N_scored, ...]``, the scored rows in compact order;
        differentiable: the gradient reaches exactly those rows (the others get 0)."""
        flat = x.reshape(self.num_seqs * self.seq_len, *x.shape[2:])
        return _MoveRows.apply(flat, self.index, None, 0)

    def gather_padded(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T, ...]`` → (``[B, W, ...]``, ``valid [B, W]`` bool): each sequence's scored rows
        packed to the front of a row of ``W = max_seqlen`` slots, zeros after them;
        differentiable like :meth:`gather`."""
        flat = x.reshape(self.num_seqs * self.seq_len, *x.shape[2:])
        width = self.max_seqlen
        out = _MoveRows.apply(flat, self.index, self._padded_slot, self.num_seqs * width)
        valid = torch.zeros(self.num_seqs * width, dtype=torch.bool, device=x.device).index_fill_(
            0, self._padded_slot, True
        )
        return out.reshape(self.num_seqs, width, *x.shape[2:]), valid.reshape(self.num_seqs, width)

    def scatter(self, compact: torch.Tensor) -> torch.Tensor:
        """``[N_scored, ...]`` → ``[B, T, ...]`` with the values at the scored rows and 0 elsewhere;
        differentiable (the gradient of the compact values is gathered back)."""
        rows = self.num_seqs * self.seq_len
        out = _MoveRows.apply(compact, torch.arange(self.total, device=compact.device), self.index, rows)
        return out.reshape(self.num_seqs, self.seq_len, *compact.shape[1:])

    def dense_mask(self) -> torch.Tensor:
        """``[B, T]`` bool, True at the scored rows (on the spans' device)."""
        mask = torch.zeros(self.num_seqs * self.seq_len, dtype=torch.bool, device=self.device)
        return mask.index_fill_(0, self.index, True).reshape(self.num_seqs, self.seq_len)
