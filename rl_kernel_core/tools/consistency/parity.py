"""Input parity precheck: before any log-prob comparison, check that a rollout batch and a training
batch feed the model the same thing.

A log-prob drift between a rollout engine and a trainer is only a numerics question once both saw
the same token ids at the same positions with the same masks; a shifted position id, a different
pad or BOS token or a loss mask off by one gives drift that no kernel fixes. :func:`check` compares
two :class:`Batch` es sequence by sequence on their real tokens (so a left-padded rollout batch and
a right-padded training batch can agree) and returns the first mismatch, named by field, sequence
and token, or None.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass, field
from typing import BinaryIO, Optional

import torch


@dataclass
class Batch:
    """One side's model inputs, ``[B, L]`` each (int tensors).

    ``attention_mask``: 1 on real tokens. ``position_ids``: each real token's position.
    ``loss_mask``: 1 where the log-prob of the *next* token is compared (or trained on).
    ``padding_side``: ``"left"`` or ``"right"``. ``special_tokens``: e.g. ``{"pad": 0, "eos": 2}``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    padding_side: str
    special_tokens: dict = field(default_factory=dict)

    def sequences(self) -> list[torch.Tensor]:
        """Each row's real tokens, in order."""
        return [row[m.bool()] for row, m in zip(self.input_ids, self.attention_mask)]


@dataclass(frozen=True)
class Mismatch:
    """The first difference found: which check, where, and the two values."""

    check: str
    where: str
    left: object
    right: object

    def __str__(self) -> str:
        return f"{self.check} differs at {self.where}: {self.left!r} vs {self.right!r}"


def _padding_problem(batch: Batch) -> Optional[str]:
    """Why ``batch``'s masks do not match its declared padding side, or None."""
    if batch.padding_side not in ("left", "right"):
        return f"padding_side must be 'left' or 'right', got {batch.padding_side!r}"
    for b, m in enumerate(batch.attention_mask.tolist()):
        real = [i for i, x in enumerate(m) if x]
        if not real:
            continue
        if real != list(range(real[0], real[-1] + 1)):
            return f"row {b} has padding between real tokens"
        if batch.padding_side == "left" and real[-1] != len(m) - 1:
            return f"row {b} is declared left-padded but has padding on the right"
        if batch.padding_side == "right" and real[0] != 0:
            return f"row {b} is declared right-padded but has padding on the left"
    return None


def check(a: Batch, b: Batch, names: tuple[str, str] = ("rollout", "training")) -> Optional[Mismatch]:
    """The first input mismatch between batches ``a`` and ``b``, or None when they agree.

    Order of checks: shapes and row count, special tokens, each batch's padding against its
    declared side, then per sequence: length (attention mask), token ids, position ids, loss mask.
    """
    for name, batch in zip(names, (a, b)):
        for f in ("input_ids", "attention_mask", "position_ids", "loss_mask"):
            t = getattr(batch, f)
            if t.dim() != 2 or t.shape != batch.input_ids.shape:
                return Mismatch("shape", f"{name}.{f}", tuple(t.shape), tuple(batch.input_ids.shape))
    if a.input_ids.shape[0] != b.input_ids.shape[0]:
        return Mismatch("sequence count", "batch", a.input_ids.shape[0], b.input_ids.shape[0])
    for key in sorted(set(a.special_tokens) | set(b.special_tokens)):
        if a.special_tokens.get(key) != b.special_tokens.get(key):
            return Mismatch("special token", key, a.special_tokens.get(key), b.special_tokens.get(key))
    for name, batch in zip(names, (a, b)):
        problem = _padding_problem(batch)
        if problem:
            return Mismatch("padding side", name, batch.padding_side, problem)
    for s in range(a.input_ids.shape[0]):
        real_a, real_b = a.attention_mask[s].bool(), b.attention_mask[s].bool()
        if int(real_a.sum()) != int(real_b.sum()):
            return Mismatch("attention mask", f"sequence {s} (real token count)", int(real_a.sum()), int(real_b.sum()))
        for check_name, fa, fb in (
            ("token ids", a.input_ids, b.input_ids),
            ("position ids", a.position_ids, b.position_ids),
            ("loss mask", a.loss_mask, b.loss_mask),
        ):
            va, vb = fa[s][real_a], fb[s][real_b]
            diff = (va != vb).nonzero()
            if diff.numel():
                t = int(diff[0])
                return Mismatch(check_name, f"sequence {s}, token {t}", int(va[t]), int(vb[t]))
    return None


def from_sequences(
    seqs: list[torch.Tensor], side: str, loss_from: list[int], pad_id: int, special_tokens: Optional[dict] = None
) -> Batch:
    """A padded :class:`Batch` of ``seqs`` with positions 0.. on the real tokens and the loss mask
    set from token ``loss_from[b]`` of sequence b to its second-to-last token."""
    width = max(len(s) for s in seqs)
    device = seqs[0].device
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        start = width - len(s) if side == "left" else 0
        ids[b, start : start + len(s)] = s
        mask[b, start : start + len(s)] = 1
        loss[b, start + loss_from[b] : start + len(s) - 1] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0) * mask
    return Batch(ids, mask, positions, loss, side, dict(special_tokens or {"pad": pad_id}))


_TENSOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "loss_mask")


def _unreadable(path: str, exc: BaseException) -> ValueError:
    """The error for a file ``torch.load`` cannot read as a batch, naming the file and the reason
    (:func:`load` raises it)."""
    reason = type(exc).__name__ + (f": {str(exc).strip().splitlines()[0]}" if str(exc).strip() else "")
    return ValueError(
        f"{path}: not a batch written by rl_kernel_core.tools.consistency.parity.save or "
        f"rl_kernel_core.tools.multimodal.storage.save (torch.load with weights_only=True failed: {reason[:200]})"
    )


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for binary reading, when it is a regular file. A FIFO, a device or a
    directory is refused with ``ValueError`` naming the file and what it is, without waiting for a
    writer (the file is opened non-blocking and checked before anything is read); ``OSError`` when
    it cannot be opened. The batch loaders read through it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a directory"
                if stat.S_ISDIR(mode)
                else "a character device"
                if stat.S_ISCHR(mode)
                else "a block device"
                if stat.S_ISBLK(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "not a file"
            )
            raise ValueError(f"{path}: must be a regular file holding a saved batch, got {kind}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def stored_tensor_problem(value: torch.Tensor) -> Optional[str]:
    """Why a tensor read from a file is not a plain dense one, or None: a sparse (or other
    non-strided) layout, a quantized dtype, or an expanded view (a stride 0 on a dim of size > 1,
    more elements than its storage holds, or an extent past its storage): reading such a tensor
    element by element costs more memory than the file holds (a few KB can describe terabytes).
    Phrased to follow ``"<field> must be a dense tensor, "``; the batch loaders use it."""
    if value.layout != torch.strided:
        return f"got layout {str(value.layout).replace('torch.', '')} (save .to_dense())"
    if value.is_quantized:
        return f"got a quantized {str(value.dtype).replace('torch.', '')} tensor"
    stored = value.untyped_storage().nbytes() // value.element_size()
    shape, strides = tuple(value.shape), tuple(value.stride())
    extent = value.storage_offset() + sum((n - 1) * s for n, s in zip(shape, strides)) + 1 if value.numel() else 0
    if any(s == 0 and n > 1 for n, s in zip(shape, strides)) or value.numel() > stored or extent > stored:
        return (
            f"got shape {shape} over {stored} stored elements (strides {strides}: an expanded view; save .contiguous())"
        )
    return None


def save(batch: Batch, path: str) -> None:
    """Write ``batch`` to ``path`` (``torch.save`` of a dict of its fields), for :func:`load`."""
    torch.save(asdict(batch), path)


def load(path: str) -> Batch:
    """A :class:`Batch` from ``path``: what :func:`save` writes (a dict written by ``torch.save``
    with the integer tensors ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask``
    (``[B, L]``, dense), the string ``padding_side`` and optionally ``special_tokens``
    (``{name: int id}``), as one's own rollout or trainer code can write it), or ``torch.save`` of
    a :class:`Batch` itself. Raises ``ValueError`` naming the file and the missing or wrong field
    (a sparse, quantized or expanded tensor too: :func:`stored_tensor_problem`), or saying why the
    file is not such a batch (not a regular file: :func:`open_regular`); ``OSError`` when it cannot
    be read."""
    with open_regular(path) as f:
        try:
            with torch.serialization.safe_globals([Batch]):
                data = torch.load(f, map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as exc:  # torch.load raises KeyError, EOFError, UnpicklingError, ... for a file it cannot read
            raise _unreadable(path, exc) from None
    if isinstance(data, Batch):
        data = asdict(data)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of batch fields, got {type(data).__name__}")
    for name in _TENSOR_FIELDS:
        value = data.get(name)
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
            found = (
                "missing"
                if value is None
                else (f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__)
            )
            raise ValueError(f"{path}: {name} must be an integer tensor [B, L], got {found}")
        problem = stored_tensor_problem(value)
        if problem:  # checking it would materialise every element
            raise ValueError(f"{path}: {name} must be a dense tensor, {problem}")
    if not isinstance(data.get("padding_side"), str):
        raise ValueError(f"{path}: padding_side must be 'left' or 'right', got {data.get('padding_side')!r}")
    special = data.get("special_tokens", {})
    if not isinstance(special, dict):
        raise ValueError(f"{path}: special_tokens must be a dict of name -> token id, got {type(special).__name__}")
    for key, token in special.items():
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"{path}: special_tokens[{key!r}] must be an int token id, got {type(token).__name__}")
    return Batch(
        **{name: data[name] for name in _TENSOR_FIELDS}, padding_side=data["padding_side"], special_tokens=dict(special)
    )
