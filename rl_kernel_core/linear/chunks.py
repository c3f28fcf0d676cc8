"""The backend-neutral chunk driver of ``linear_logprob`` and ``fused_linear_policy_loss``, and its tuning.

Both ops walk the rows of ``hidden [N, D]`` in chunks of a fixed height (a function of V, the
dtype and :attr:`LinearTuning.chunk_bytes`, never of N) and never hold ``[N, V]``. Per chunk a
backend's passes (a :class:`ChunkPasses`: the Triton kernels, or the native CUDA pass) form the
log-prob statistics or the logit gradient ``dl``; this module owns what is the same for every
backend: the chunking, the fixed-shape cuBLAS products (the fp32 logits of the chunked route,
``dh = dl W``, ``dW += dl^T h``), the zero padding of the last chunk (cuBLAS picks its algorithm
and split from the shape, so every chunk has the same shape) and the gradient sink. It imports no
backend: the backend hands its passes in.

Tuning is an explicit, immutable :class:`LinearTuning`. :func:`tuning` returns the one in force
(from the environment at first use: ``RL_KERNEL_WGRAD_FP32``), :func:`tuned` replaces fields
inside a ``with`` block (a context variable: other threads and tasks keep theirs). Benchmarks
and tests choose routes and tiles with it; nothing mutates a process-wide object. An op's
forward names its tuning to its backward (:func:`tuning_key`, :func:`tuning_of`), which autograd
may run on another thread: the backward recomputes the forward's logits on the forward's route.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol

import torch

from rl_kernel_core.switches import env_flag
from rl_kernel_core.tiles import TileConfig


@dataclass(frozen=True)
class LinearTuning:
    """The choices of the chunked linear ops in force; a field left None takes the Triton backend's
    default from ``rl_kernel_core/triton/tuning.py`` (its ``LINEAR_*`` tables, read through
    :func:`rl_kernel_core.linear.triton_tile.linear`).

    Both backends: ``route``, where every pass (forward, backward, loss) takes its logits from:
    ``"gemm"`` (a Triton ``tl.dot`` pass: the logits stay in registers) or ``"chunked"`` (cuBLAS
    writes an fp32 logits chunk that one pass reads; the native backend's only route). One route
    for all passes, so a row's logits have the same bits in the forward, the backward and the loss.
    ``chunk_bytes``: the budget of the per-chunk work buffer (``dl``, or the fp32 logits chunk that
    ``dl`` then overwrites), filled to the largest power-of-two number of rows that fits
    (:func:`chunk_rows`): 640 MiB gives 2048 rows of a 16-bit ``dl`` at V=128256 and 151936, and
    with powers of two a token count that is a multiple of the chunk pads no chunk
    (``benchmarks/results/linear_h200/chunk_rows/``). ``wgrad_fp32``: accumulate ``dW`` over
    chunks in an fp32 ``[V, D]`` buffer (``4 V D`` extra bytes while the gradient is formed, and
    slower) instead of in ``weight``'s dtype (one rounding per chunk).

    The Triton backend only (None: its table's value): ``stats_bytes``, the budget of the gemm-route
    forward's tile-statistics buffers (12 bytes per row and vocab tile). ``gemm_tiles`` /
    ``gemm_grad_tiles``: the gemm route's tiles for 16-bit inputs on a GPU in the statistics /
    gradient pass. ``loss_keeps_logits_from_dim``: on the gemm route with ``D`` at least this,
    ``fused_linear_policy_loss``'s statistics pass also writes each chunk's fp32 logits into a
    buffer (twice ``chunk_bytes`` for 16-bit inputs) that its gradient pass reads instead of
    forming them again: three matrix products instead of four, the same log-prob bits.
    ``sm90``: which gemm-route passes run the Hopper CUDA kernels (``native/csrc/linear_sm90.cu``,
    the same bits as the Triton passes at the default tiles) where they are available:
    ``"auto"`` those that measured faster (:func:`rl_kernel_core.linear.triton_sm90.serves`),
    ``"all"`` every one, ``"off"`` none. The choice changes the time, never the bits.
    """

    route: str = "gemm"
    chunk_bytes: int = 640 * 2**20
    stats_bytes: Optional[int] = None
    wgrad_fp32: bool = False
    gemm_tiles: Optional[TileConfig] = None
    gemm_grad_tiles: Optional[TileConfig] = None
    loss_keeps_logits_from_dim: Optional[int] = None
    sm90: Optional[str] = None

    def __post_init__(self) -> None:
        if self.route not in ("gemm", "chunked"):
            raise ValueError(f"route must be 'gemm' or 'chunked', got {self.route!r}")
        if self.sm90 not in (None, "auto", "all", "off"):
            raise ValueError(f"sm90 must be 'auto', 'all' or 'off', got {self.sm90!r}")
        for name in ("chunk_bytes", "stats_bytes", "loss_keeps_logits_from_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def route_for(self, hidden: torch.Tensor) -> str:
        """``"gemm"`` or ``"chunked"``: the route of every pass over ``hidden`` (a function of its
        device and dtype only). The chunked route needs cuBLAS to write fp32 logits from 16-bit
        operands; where this torch cannot, the gemm route runs."""
        if self.route == "chunked" and not fp32_logits_supported(hidden.device, hidden.dtype):
            return "gemm"
        return self.route


_TUNING: contextvars.ContextVar[Optional[LinearTuning]] = contextvars.ContextVar(
    "rl_kernel_linear_tuning", default=None
)
_default: Optional[LinearTuning] = None


def tuning() -> LinearTuning:
    """The :class:`LinearTuning` in force: the innermost :func:`tuned` block's, else the default
    (``wgrad_fp32`` from ``RL_KERNEL_WGRAD_FP32``, read once)."""
    global _default
    current = _TUNING.get()
    if current is not None:
        return current
    if _default is None:
        _default = LinearTuning(wgrad_fp32=env_flag("RL_KERNEL_WGRAD_FP32", False))
    return _default


@contextlib.contextmanager
def tuned(**changes) -> Iterator[LinearTuning]:
    """Run the block with :func:`tuning` replaced by a copy with ``changes`` (field names of
    :class:`LinearTuning`); yields it. Restored on exit, also on error."""
    changed = dataclasses.replace(tuning(), **changes)
    token = _TUNING.set(changed)
    try:
        yield changed
    finally:
        _TUNING.reset(token)


_BY_KEY: dict[str, LinearTuning] = {}


@torch.compiler.assume_constant_result  # a compiled graph keeps the tuning it was traced under
def tuning_key() -> str:
    """A name of :func:`tuning` that :func:`tuning_of` turns back into it (in any thread)."""
    current = tuning()
    key = repr(current)
    _BY_KEY.setdefault(key, current)
    return key


@contextlib.contextmanager
def tuning_of(key: str) -> Iterator[LinearTuning]:
    """Run the block under the tuning :func:`tuning_key` named ``key``."""
    token = _TUNING.set(_BY_KEY[key])
    try:
        yield _BY_KEY[key]
    finally:
        _TUNING.reset(token)


def chunk_rows(vocab: int, elem_bytes: int) -> int:
    """Fixed rows per chunk (a function of the vocab and dtype only, never of N): the largest power
    of two from 16 to 8192 whose ``[rows, vocab]`` buffer of ``elem_bytes``-byte elements fits
    ``tuning().chunk_bytes`` (16 when none does)."""
    rows = tuning().chunk_bytes // max(1, vocab * elem_bytes)
    return int(min(8192, 2 ** int(math.log2(max(16, rows)))))


_DTYPE_MM_OK: dict[str, bool] = {}


def _dtype_mm_supported(kind: str) -> bool:
    """Whether this torch's CUDA ``mm`` / in-place ``addmm`` take ``out_dtype=float32`` for bf16 (probed once)."""
    if kind not in _DTYPE_MM_OK:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        acc = torch.ones(16, 16, dtype=torch.float32, device="cuda")
        try:
            if kind == "mm":
                out = torch.mm(a, a, out_dtype=torch.float32)
                ok = out.dtype == torch.float32 and bool((out == 16).all())
            else:
                torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
                ok = bool((acc == 17).all())
        except (RuntimeError, TypeError):
            ok = False
        _DTYPE_MM_OK[kind] = ok
    return _DTYPE_MM_OK[kind]


def fp32_logits_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The chunked route needs cuBLAS to write fp32 logits from 16-bit operands (``mm(out_dtype=)``)."""
    if device.type != "cuda" or dtype == torch.float32:
        return True
    return _dtype_mm_supported("mm")


def mm_fp32_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out[fp32] = a @ b`` with fp32 accumulation (cuBLAS ``out_dtype`` on CUDA, upcast on CPU)."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif a.device.type == "cuda":
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool = False) -> None:
    """``acc += a @ b`` (``acc = a @ b`` with ``overwrite``: ``acc`` may hold garbage) in ``acc``'s
    dtype with fp32 products, never a full-size temporary."""
    if overwrite:
        if acc.dtype == a.dtype:
            torch.mm(a, b, out=acc)
            return
        if acc.device.type != "cuda" or _dtype_mm_supported("mm"):
            mm_fp32_into(a, b, acc)
            return
        acc.zero_()
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.device.type != "cuda":
        acc.addmm_(a.float(), b.float())
    elif _dtype_mm_supported("addmm"):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # this torch lacks addmm(out_dtype=): fp32 products over row slices of at most 64 MiB
        step = max(1, (64 * 2**20) // (4 * b.shape[1]))
        for r in range(0, a.shape[0], step):
            acc[r : r + step] += torch.mm(a[r : r + step].float(), b.float())


def canonical_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when it is strided or its base is not 16-byte aligned.

    Triton specializes a kernel on unit strides and aligned pointers, and the register layout it
    then picks sets the order of in-kernel reductions; TMA descriptors need this layout too. The
    drivers' entry points pass ``hidden`` and ``weight`` through it, so a strided view gives the
    bits of its contiguous copy (the public ops already pass contiguous tensors: no copy)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class StatsPass(Protocol):
    """A backend's statistics pass over one chunk (see :class:`ChunkPasses`)."""

    def __call__(self, chunk: Chunk, lp: torch.Tensor, ent: Optional[torch.Tensor], lse: torch.Tensor) -> None: ...


class GradPass(Protocol):
    """A backend's gradient pass over one chunk (see :class:`ChunkPasses`)."""

    def __call__(
        self,
        chunk: Chunk,
        lse: torch.Tensor,
        ent: Optional[torch.Tensor],
        g_lp: torch.Tensor,
        g_ent: Optional[torch.Tensor],
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ChunkPasses:
    """A backend's per-chunk passes, handed to the driver, which calls them for every chunk.

    ``stats(chunk, lp, ent, lse)`` writes ``lp``, ``lse`` and (unless None) ``ent`` (fp32 ``[n]``
    views) for the ``n`` rows of a :class:`Chunk`. ``grad(chunk, lse, ent, g_lp, g_ent)`` returns
    ``dl`` of ``n`` rows on the fixed ``[rows, V]`` shape from the saved ``lse``/``ent`` and fp32
    ``g_lp``/``g_ent``: it writes ``chunk.buf.dl[:n]`` and returns :meth:`ChunkBuffers.padded_dl`. ``scratch(hidden, weight, route, rows)``: the backend's
    own work buffers, allocated once per pass (``buf.scratch``). ``stats_rows(hidden, weight,
    route)``: the rows per chunk of a forward that holds neither ``dl`` nor a logits chunk
    (:func:`chunk_rows` when None).
    """

    stats: StatsPass
    grad: GradPass
    scratch: Optional[Callable[[torch.Tensor, torch.Tensor, str, int], Any]] = None
    stats_rows: Optional[Callable[[torch.Tensor, torch.Tensor, str], int]] = None


class ChunkBuffers:
    """The fixed-size work buffers of one forward, backward or loss pass, reused for every chunk.

    ``rows`` is the chunk height. On the chunked route ``logits`` is the fp32 ``[rows, V]`` chunk
    cuBLAS writes (:meth:`source`) and ``dl`` overwrites it in place; with ``keep_logits`` (gemm
    route; ``keeps_logits`` records it) ``logits`` is the same buffer, written by the statistics
    pass and read by the gradient pass; otherwise ``dl`` (when needed) is a ``[rows, V]`` buffer in
    ``hidden``'s dtype. ``scratch`` holds what ``passes.scratch`` allocated (None without it).
    """

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        route: str,
        passes: ChunkPasses,
        need_dl: bool,
        keep_logits: bool = False,
    ) -> None:
        vocab, dim = weight.shape
        dev, dt = hidden.device, hidden.dtype
        self.route = route
        self.keeps_logits = keep_logits
        self.logits: Optional[torch.Tensor] = None
        self.h_pad: Optional[torch.Tensor] = None
        self._dl: Optional[torch.Tensor] = None
        if keep_logits and route != "gemm":
            raise ValueError(f"keep_logits: only the gemm route keeps its logits, got route {route!r}")
        if route == "chunked" or keep_logits:
            self.rows = chunk_rows(vocab, hidden.element_size() if keep_logits else 4)
            self.logits = torch.empty(self.rows, vocab, dtype=torch.float32, device=dev)
            if route == "chunked":
                self.h_pad = torch.empty(self.rows, dim, dtype=dt, device=dev)
            self._dl = self.logits if dt == torch.float32 else self.logits.view(dt)[:, :vocab]
        elif need_dl:
            self.rows = chunk_rows(vocab, hidden.element_size())
            self._dl = torch.empty(self.rows, vocab, dtype=dt, device=dev)
        elif passes.stats_rows is not None:
            self.rows = passes.stats_rows(hidden, weight, route)
        else:
            self.rows = chunk_rows(vocab, hidden.element_size())
        self.scratch: Any = None if passes.scratch is None else passes.scratch(hidden, weight, route, self.rows)

    @property
    def dl(self) -> torch.Tensor:
        """The ``[rows, V]`` logit-gradient buffer of a pass built with ``need_dl`` (or on the chunked route)."""
        if self._dl is None:
            raise RuntimeError("these chunk buffers hold no dl: build them with need_dl=True")
        return self._dl

    def source(self, hidden: torch.Tensor, weight: torch.Tensor, r0: int, n: int) -> torch.Tensor:
        """What the pass reads for rows ``[r0, r0+n)``: hidden rows, or (chunked route) their fp32
        logits computed by cuBLAS on the fixed ``[rows, D]`` shape, zero-padded."""
        if self.h_pad is None or self.logits is None:  # not the chunked route
            return hidden[r0 : r0 + n]
        self.h_pad[:n].copy_(hidden[r0 : r0 + n])
        if n < self.rows:
            self.h_pad[n:].zero_()
        mm_fp32_into(self.h_pad, weight.t(), self.logits)
        return self.logits

    def padded_dl(self, n: int) -> torch.Tensor:
        """``self.dl`` with its rows past ``n`` zeroed, once a pass has written its first ``n`` rows."""
        if n < self.rows:
            self.dl[n:].zero_()
        return self.dl

    def chunk(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        targets: torch.Tensor,
        r0: int,
        n: int,
        inv_temp: float,
        ignore_index: int,
    ) -> Chunk:
        """The :class:`Chunk` of rows ``[r0, r0+n)`` of ``hidden`` and ``targets`` (all ``N`` rows)."""
        x = self.source(hidden, weight, r0, n)
        return Chunk(self, x, weight, bias, targets[r0 : r0 + n], n, inv_temp, ignore_index)


@dataclass(frozen=True)
class Chunk:
    """What a pass reads for ``n`` rows: ``x`` (what :meth:`ChunkBuffers.source` returned), ``weight``
    ``[V, D]``, ``bias`` ``[V]`` or None, the rows' ``targets`` ``[n]``, the scale and the ignored id,
    and the pass's buffers ``buf``."""

    buf: ChunkBuffers
    x: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    targets: torch.Tensor
    n: int
    inv_temp: float
    ignore_index: int


def forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    inv_temp: float,
    ignore_index: int,
    route: str,
    want_entropy: bool,
    passes: ChunkPasses,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(logprob, entropy or None, lse)``, fp32 ``[N]``, by ``passes``' statistics pass."""
    n_rows = hidden.shape[0]
    lp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(lp) if want_entropy else None
    lse = torch.empty_like(lp)
    buf = ChunkBuffers(hidden, weight, route, passes, need_dl=False)
    for r0 in range(0, n_rows, buf.rows):
        n = min(buf.rows, n_rows - r0)
        sl = slice(r0, r0 + n)
        chunk = buf.chunk(hidden, weight, bias, targets, r0, n, inv_temp, ignore_index)
        passes.stats(chunk, lp[sl], None if ent is None else ent[sl], lse[sl])
    return lp, ent, lse


class Sink(Protocol):
    """What :func:`linear_backward` hands each chunk's ``dl`` to: a :class:`GradSink`, or a
    vocab-parallel sink that all-reduces ``dh``."""

    def add(self, dl: torch.Tensor, r0: int, n: int) -> None: ...

    def grads(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]: ...


class GradSink:
    """Consumes each chunk's ``dl``: ``dh`` rows, the ``dW`` accumulator and ``db``."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, need_h: bool, need_w: bool, need_b: bool) -> None:
        self.hidden, self.weight = hidden, weight
        self.dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        acc_dtype = torch.float32 if tuning().wgrad_fp32 else weight.dtype
        # the first chunk writes dW (no zero fill: a 1 GiB pass for a 128256 x 4096 head)
        self.dw = torch.empty(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        self._dw_written = False
        self.db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        self._dh_tmp: Optional[torch.Tensor] = None

    def add(self, dl: torch.Tensor, r0: int, n: int) -> None:
        """Consume ``dl [rows, V]`` (rows past ``n`` zero) belonging to hidden rows ``[r0, r0+n)``."""
        rows = dl.shape[0]
        if self.dh is not None:
            if n == rows:
                torch.mm(dl, self.weight, out=self.dh[r0 : r0 + n])
            else:  # the same [rows, D] product shape as every other chunk: a row's dh must not depend on N
                if self._dh_tmp is None:
                    self._dh_tmp = torch.empty(rows, self.weight.shape[1], dtype=self.dh.dtype, device=dl.device)
                torch.mm(dl, self.weight, out=self._dh_tmp)
                self.dh[r0 : r0 + n].copy_(self._dh_tmp[:n])
        if self.dw is not None:
            addmm_acc_(self.dw, dl[:n].t(), self.hidden[r0 : r0 + n], overwrite=not self._dw_written)
            self._dw_written = True
        if self.db is not None:
            self.db += dl[:n].sum(dim=0, dtype=torch.float32)

    def grads(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(dh, dW, db)`` in the inputs' dtypes (None where not needed)."""
        if self.dw is not None and not self._dw_written:  # no rows
            self.dw.zero_()
        dh, dw, db = (
            None if g is None else g.to(like.dtype)
            for g, like in ((self.dh, self.hidden), (self.dw, self.weight), (self.db, self.weight))
        )
        return dh, dw, db


def linear_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    route: str,
    passes: ChunkPasses,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_logprob``'s forward custom-op body on one process: ``(logprob [N], entropy [N] or
    [0], lse [N])`` fp32 by ``passes`` on ``route``."""
    lp, ent, lse = forward_stats(
        canonical_layout(hidden),
        canonical_layout(weight),
        bias,
        targets,
        1.0 / temperature,
        ignore_index,
        route,
        return_entropy,
        passes,
    )
    return lp, (lp.new_empty(0) if ent is None else ent), lse


class BackwardArgs(NamedTuple):
    """The arguments of ``linear_logprob``'s backward custom op, in its schema's order
    (:data:`rl_kernel_core.linear.opdef.LINEAR_BACKWARD_SCHEMA`)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    targets: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    grad_logprob: Optional[torch.Tensor]
    grad_entropy: Optional[torch.Tensor]
    temperature: float
    ignore_index: int
    tp_group: Optional[str]
    tuning: str
    need_hidden_grad: bool
    need_weight_grad: bool
    need_bias_grad: bool


def linear_backward(
    args: BackwardArgs, route: str, passes: ChunkPasses, sink: Optional[Sink] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_logprob``'s backward custom-op body: ``(dh, dW, db)`` in the inputs' dtypes, ``[0]``
    where not asked for. Per chunk it recomputes the logits, forms ``dl`` (``passes``' gradient pass)
    and hands it to ``sink``, which replaces the single-process :class:`GradSink` (vocab parallel)."""
    hidden, weight = canonical_layout(args.hidden), canonical_layout(args.weight)
    lse, grad_logprob, grad_entropy = args.lse, args.grad_logprob, args.grad_entropy
    g_lp = torch.zeros_like(lse) if grad_logprob is None else grad_logprob.to(torch.float32).contiguous()
    g_ent = None if grad_entropy is None else grad_entropy.to(torch.float32).contiguous()
    ent = None if g_ent is None else args.entropy
    sink = sink or GradSink(hidden, weight, args.need_hidden_grad, args.need_weight_grad, args.need_bias_grad)
    n_rows = hidden.shape[0]
    buf = ChunkBuffers(hidden, weight, route, passes, need_dl=True)
    for r0 in range(0, n_rows, buf.rows):
        n = min(buf.rows, n_rows - r0)
        sl = slice(r0, r0 + n)
        chunk = buf.chunk(hidden, weight, args.bias, args.targets, r0, n, 1.0 / args.temperature, args.ignore_index)
        dl = passes.grad(
            chunk, lse[sl], None if ent is None else ent[sl], g_lp[sl], None if g_ent is None else g_ent[sl]
        )
        sink.add(dl, r0, n)
    empty = hidden.new_empty(0)
    dh, dw, db = (empty.clone() if g is None else g for g in sink.grads())
    return dh, dw, db
