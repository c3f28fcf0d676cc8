"""Token sampling with vLLM's filters, per-row seeds that make a row's draw independent of its
batch, and the log-prob a trainer recomputes.

Public op: :func:`sample`. It validates its arguments, keeps numbers as Python numbers and turns
per-row tensors into the dtypes below on ``logits``' device, draws per-row seeds from
``generator`` (or the global RNG) when none are given, returns empty results for B = 0 without
calling a backend, and otherwise runs the implementation chosen by
:func:`rl_kernel_core.dispatch.select`.

Backend contract (what ``@dispatch.register("sample", backend)`` implementations receive; each
parameter is a Python number for the whole batch or a ``[B]`` tensor)::

    impl(logits, temperature, seeds, positions, top_k, top_p, min_p) -> (tokens [B] int64, logprobs [B] fp32)

    logits      [B, V]  float32 / bfloat16 / float16 / float64, B >= 1, V >= 1, contiguous
    temperature float or [B] float64, finite, >= 0 (0: greedy)
    seeds       [B]     int64: the caller's, or one per row drawn from ``generator`` (or the
                        global RNG) when the caller gave none
    positions   None (0), int or [B] int64
    top_k       None (no top-k), int or [B] int64, in [1, V]
    top_p       None (no top-p), float or [B] float64, in (0, 1]
    min_p       None (no min-p), float or [B] float32, in [0, 1)

``dispatch.select`` passes the same arguments to a backend's ``supports`` predicate, except
``seeds``: there it is the caller's tensor, or None when the caller gave none (so a backend whose
draws are not keyed on each row's seed alone can refuse exactly the calls that carry seeds).

The semantics every backend must reproduce are stated in :mod:`rl_kernel_core.sampling.reference`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union, overload

import torch

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.batch_invariant_mode.api import is_batch_invariant
from rl_kernel_core.logprob.api import logprob_from_logits
from rl_kernel_core.sampling import reference as _reference  # noqa: F401  (registers the torch backend)

Param = Union[int, float, torch.Tensor, None]

_INT64 = torch.iinfo(torch.int64)


def _row_tensor(
    name: str, value: torch.Tensor, logits: torch.Tensor, dtypes: tuple[torch.dtype, ...], out_dtype: torch.dtype
) -> torch.Tensor:
    """A ``[B]`` tensor parameter checked (dtype, rank, device, shape) and cast to ``out_dtype``."""
    b = logits.shape[0]
    _checks.tensor(name, value, dtypes=dtypes, ndim=1)
    _checks.same_device("logits", logits, **{name: value})
    _checks.shape(name, value, (b,), f"[B={b}]")
    return value.to(out_dtype)


@overload
def _number(name: str, value: object, integer: Literal[True]) -> int: ...
@overload
def _number(name: str, value: object, integer: bool) -> Union[int, float]: ...
def _number(name: str, value: object, integer: bool) -> Union[int, float]:
    """``value`` as a Python int (``integer``; it must fit in int64) or a finite-or-infinite float."""
    kind = int if integer else (int, float)
    if not isinstance(value, kind) or isinstance(value, bool):
        expected = "an int or an int64/int32 tensor [B]" if integer else "a number or a float tensor [B]"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if integer:
        if not _INT64.min <= value <= _INT64.max:
            raise ValueError(f"{name} must fit in int64 [{_INT64.min}, {_INT64.max}], got {value}")
        return int(value)
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"{name} must be representable as a float, got an int of {int(value).bit_length()} bits"
        ) from None


def _in_range(
    name: str,
    value: Union[int, float, torch.Tensor],
    lo: float,
    hi: float,
    lo_open: bool,
    hi_open: bool,
    temperature: bool = False,
) -> None:
    """Every value in the interval (NaN never is) and, for a ``temperature``, 0 or in
    ``[SMALLEST_TEMPERATURE, LARGEST_TEMPERATURE]`` (:mod:`rl_kernel_core._checks`); a tensor costs
    one device->host sync."""
    smallest_nonzero = _checks.SMALLEST_TEMPERATURE if temperature else 0.0
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return
        stats = [value.min(), value.max()]
        if smallest_nonzero:
            stats.append(torch.where(value != 0, value.abs(), float("inf")).min())
        low, high, *rest = torch.stack(stats).to(torch.float64).tolist()
        small = rest[0] if rest else float("inf")
    else:
        low = high = float(value)
        small = abs(low) if low != 0 else float("inf")
    ok = (low > lo if lo_open else low >= lo) and (high < hi if hi_open else high <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        found = f"{value}" if not isinstance(value, torch.Tensor) else f"values in [{low}, {high}]"
        raise ValueError(f"{name} must lie in {interval}, got {found}")
    if temperature and (small < _checks.SMALLEST_TEMPERATURE or high > _checks.LARGEST_TEMPERATURE):
        bad = small if small < _checks.SMALLEST_TEMPERATURE else high
        found = f"{value!r}" if not isinstance(value, torch.Tensor) else f"a value of {bad!r}"
        raise ValueError(f"{name} must be 0 or {_checks.temperature_bounds(name)}, got {found}")


def _validated(
    name: str,
    value: Param,
    logits: torch.Tensor,
    *,
    integer: bool,
    lo: float,
    hi: float,
    lo_open: bool,
    hi_open: bool,
    out_dtype: torch.dtype,
    temperature: bool = False,
) -> Union[int, float, torch.Tensor, None]:
    """``value`` checked (type, dtype, shape, device, range): None, a Python number, or a ``[B]``
    tensor of ``out_dtype`` on logits' device. Numbers stay numbers, so a backend can pass them to
    its kernel as scalars instead of launching a fill per parameter."""
    if value is None:
        return None
    out: Union[int, float, torch.Tensor]
    if isinstance(value, torch.Tensor):
        dtypes = _checks.INDEX_DTYPES if integer else _checks.FLOAT_DTYPES
        out = _row_tensor(name, value, logits, dtypes, out_dtype)
    else:
        out = value = _number(name, value, integer)
    _in_range(name, value, lo, hi, lo_open, hi_open, temperature)
    return out


def _positions(positions: Union[int, torch.Tensor, None], logits: torch.Tensor) -> Union[int, torch.Tensor, None]:
    if positions is None:
        return None
    if isinstance(positions, torch.Tensor):
        return _row_tensor("positions", positions, logits, _checks.INDEX_DTYPES, torch.int64)
    return _number("positions", positions, integer=True)


def _seeds(
    seeds: Optional[torch.Tensor], generator: Optional[torch.Generator], logits: torch.Tensor
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """``(the caller's seeds or None, the [B] int64 seeds the backend draws with)``."""
    b = logits.shape[0]
    if seeds is not None:
        if generator is not None:
            raise ValueError(
                "generator must be None when seeds are given (the seeds alone decide the draw), got a torch.Generator"
            )
        _checks.tensor("seeds", seeds, dtypes=(torch.int64,), ndim=1)
        _checks.same_device("logits", logits, seeds=seeds)
        _checks.shape("seeds", seeds, (b,), f"[B={b}]")
        return seeds, seeds
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != logits.device.type:
            raise ValueError(f"generator must be on logits' device type {logits.device.type}, got {generator.device}")
    return None, torch.randint(
        _INT64.min, _INT64.max, (b,), generator=generator, device=logits.device, dtype=torch.int64
    )


def sample(
    logits: torch.Tensor,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    min_p: Union[float, torch.Tensor, None] = None,
    seeds: Optional[torch.Tensor] = None,
    positions: Union[int, torch.Tensor, None] = None,
    generator: Optional[torch.Generator] = None,
    backend: Optional[str] = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` and return it with its log-prob.

    Filtering follows vLLM (V1 sampler and Model Runner V2): temperature, then min-p, then top-k,
    then top-p, each on what the previous kept (top-k/top-p ties at the threshold are kept). The
    exact definitions are in :mod:`rl_kernel_core.sampling.reference`.

    Args:
        logits: ``[B, V]`` float32/bfloat16/float16/float64 (upcast to fp32; fp64 is rounded to fp32).
        temperature: 0 or a number in ``[2**-126, 2**126]`` (about 1.18e-38 to 8.51e37: the
            temperature and ``1 / temperature`` are normal fp32 numbers), or a float tensor ``[B]``
            of such values; a row with temperature 0 is greedy (argmax of its logits, the first
            index among ties; filters do not apply). A temperature so small that
            ``fp32(l) * fp32(1 / T)`` overflows to +inf for some logit leaves that row without a
            distribution (see Returns); use 0 for greedy.
        top_k: None, an int >= 1 (fitting in int64) or an int64/int32 tensor ``[B]`` of values
            >= 1; a value >= V keeps every token.
        top_p: None, a number in (0, 1] or a float tensor ``[B]``; 1 keeps every token.
        min_p: None, a number in [0, 1) or a float tensor ``[B]``; 0 keeps every token.
        seeds: int64 ``[B]``, or None. With seeds, row ``b``'s token depends only on
            ``logits[b]``, its parameters, ``seeds[b]`` and ``positions[b]`` (never on B, its
            place in the batch or the other rows), bit for bit, and is the same on every device up
            to the last bit of a log.
        positions: None (position 0), an int, or an int64/int32 tensor ``[B]``: the step or
            sequence position that keys the noise together with the seed, so one request seed
            gives independent draws at successive positions (vLLM Model Runner V2 keys its Gumbel
            noise on ``(seed, position)`` the same way).
        generator: used only without ``seeds``: one seed per row is drawn from it (or from the
            global RNG of ``logits``' device when None), then sampling proceeds as with seeds
            (the ``flashinfer`` backend seeds FlashInfer's Philox stream with the first of them).
        backend: ``"auto"`` (or None: ``RL_KERNEL_BACKEND``, default auto), ``"native"``,
            ``"triton"``, ``"torch"`` or ``"flashinfer"`` (FlashInfer's samplers, only when named
            or preferred, and only without ``seeds``: see :mod:`rl_kernel_core.sampling.flashinfer_supports`); see
            :mod:`rl_kernel_core.dispatch`.

    Returns:
        ``(tokens, logprobs)``: ``tokens`` int64 ``[B]``; ``logprobs`` fp32 ``[B]``, the sampled
        token's log-prob under the FULL tempered distribution ``log_softmax(fp32(logits) / T)``
        before any top-k/top-p/min-p filtering (what a trainer recomputes from the same logits);
        greedy rows use ``T = 1``; under the batch-invariant mode those of
        :func:`rl_kernel_core.logprob_from_logits` in the mode (``log_softmax(fp32(logits) / T)`` by
        PyTorch's division and the mode's log-sum-exp: a trainer's own formulation gets them).
        Nothing is differentiable. A row whose tempered logits hold no
        distribution (every entry -inf, a NaN, or a +inf, from the logits or from overflow at a
        tiny temperature) gets token 0 and log-prob NaN on every backend, so the NaN reaches
        whatever consumes the log-prob; no error is raised, since finding such rows before the
        draw would cost a pass over the logits and a host sync.

    Raises:
        TypeError: a wrong type or dtype (names the argument, expected and found).
        ValueError: a wrong shape, device, value range, an empty vocab, meta ``logits``, or both
            ``seeds`` and ``generator``. Tensor parameters are range-checked with one host sync each.
        rl_kernel_core.BackendUnavailableError: an explicit ``backend`` cannot run these inputs.
    """
    _checks.tensor("logits", logits, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    _checks.needs_data("logits", logits, "the draw reads its values")
    b, v = logits.shape
    if v == 0:
        raise ValueError(f"logits must have at least one vocab column, got shape {tuple(logits.shape)}")
    temp = _validated(
        "temperature",
        temperature,
        logits,
        integer=False,
        lo=0.0,
        hi=float("inf"),
        lo_open=False,
        hi_open=True,
        out_dtype=torch.float64,
        temperature=True,
    )
    k = _validated(
        "top_k", top_k, logits, integer=True, lo=1, hi=float("inf"), lo_open=False, hi_open=True, out_dtype=torch.int64
    )
    p = _validated(
        "top_p", top_p, logits, integer=False, lo=0.0, hi=1.0, lo_open=True, hi_open=False, out_dtype=torch.float64
    )
    mp = _validated(
        "min_p", min_p, logits, integer=False, lo=0.0, hi=1.0, lo_open=False, hi_open=True, out_dtype=torch.float32
    )
    given, s = _seeds(seeds, generator, logits)
    pos = _positions(positions, logits)
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device), torch.empty(
            0, dtype=torch.float32, device=logits.device
        )
    logits = logits.contiguous()
    if k is not None:
        k = k.clamp(max=v) if isinstance(k, torch.Tensor) else min(k, v)
    impl = dispatch.select("sample", backend, logits.device, logits, temp, given, pos, k, p, mp)
    with torch.no_grad():
        tokens, logprobs = impl(logits, temp, s, pos, k, p, mp)
        if is_batch_invariant():
            assert temp is not None, "sample's temperature is validated to a number or a tensor"
            logprobs = _mode_logprobs(logits, tokens, temp)
        return _without_distribution(tokens, logprobs)


def _mode_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temp: Union[int, float, torch.Tensor]) -> torch.Tensor:
    """The sampled tokens' log-probs ``[B]`` under the batch-invariant mode's definition
    (:func:`rl_kernel_core.logprob_from_logits` in the mode, one call per distinct temperature; greedy
    rows at T = 1), so a trainer's formulation in the mode gets these bits."""
    if not isinstance(temp, torch.Tensor):
        return _as_tensor(logprob_from_logits(logits, tokens, temperature=float(temp) if temp > 0 else 1.0))
    temps = torch.where(temp > 0, temp, torch.ones_like(temp)).tolist()
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for t in sorted(set(temps)):
        rows = torch.tensor([i for i, x in enumerate(temps) if x == t], device=logits.device)
        out[rows] = _as_tensor(logprob_from_logits(logits[rows], tokens[rows], temperature=t)).float()
    return out


def _as_tensor(result: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), "logprob_from_logits without return_entropy returns one tensor"
    return result


def _without_distribution(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token 0 and log-prob NaN for the rows whose tempered logits hold no distribution.

    Such a row (every entry -inf, or a NaN, or a +inf, including one from ``l / T`` overflowing
    fp32) has a log-sum-exp of NaN, +inf or -inf on every backend, so its log-prob is not finite
    there, while a row with a distribution always gets a finite one; which token each backend
    draws from such a row differs, so it is replaced by one they all return. Costs two ``[B]``
    ops and no sync."""
    bad = ~torch.isfinite(logprobs)
    return tokens.masked_fill(bad, 0), logprobs.masked_fill(bad, float("nan"))
