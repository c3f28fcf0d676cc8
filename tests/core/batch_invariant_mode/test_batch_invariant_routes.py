"""The batch-invariant mode's routed ``aten`` ops against PyTorch's own (property-based).

For generated calls of every routed op (``mm``, ``addmm``, ``bmm``, ``baddbmm``, their ``out=``
and in-place forms, ``log_softmax``/``_log_softmax`` and ``mean``, ``out=`` included) over shapes
with zero sizes, 0-d tensors, strided, transposed and expanded operands, every float dtype,
beta/alpha, dims in and out of range, NaN/inf addends and bad input, the call made inside the mode
gives what the same call gives outside it: the same error type and message, the same warnings,
the ``out``/``self`` tensor itself, the same shape, strides and dtype, and values

* bit for bit where no reduction is computed (a zero size, a 0-d tensor, ``alpha=0``), which the
  mode leaves to PyTorch's kernel (unless PyTorch's result is not reproducible itself: on CPU, a
  bf16 ``baddbmm`` with ``alpha=0`` and ``beta=0`` returns uninitialised memory);
* elsewhere within the rounding bound of the op accumulated in fp32 (fp64 for fp64 inputs) and
  rounded to the output dtype, against fp64; PyTorch's own result must meet the bound too.

Inputs are made on the CPU and moved to the device (an expanded operand arrives contiguous on
CUDA). The example budget is fixed for CI; ``RL_KERNEL_HYPOTHESIS_EXAMPLES=N`` runs a longer search.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rl_kernel_core as rk
from rl_kernel_core import contract

EXAMPLES = int(os.environ.get("RL_KERNEL_HYPOTHESIS_EXAMPLES", "150"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="RL_KERNEL_HYPOTHESIS_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow],
)
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
SIZES = st.sampled_from([0, 1, 3, 33])  # 33: more rows than one tile of the torch backend
LAYOUTS = st.sampled_from(["contiguous", "contiguous", "transposed", "sliced", "expanded"])
SCALARS = st.sampled_from([1, 1, 0, 0.5, -2, 3, True])


def _tensor(shape, dtype: torch.dtype, layout: str, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` (normal values times ``scale``) laid out as ``layout``:
    contiguous, transposed (last two dims), sliced (every other element of the last dim) or
    expanded (dim 0 broadcast from size 1)."""
    shape = list(shape)

    def normal(size):
        return (torch.randn(size, generator=g) * scale).to(dtype)

    if layout == "transposed" and len(shape) >= 2:
        return normal([*shape[:-2], shape[-1], shape[-2]]).transpose(-1, -2)
    if layout == "sliced" and shape:
        return normal([*shape[:-1], 2 * shape[-1]])[..., ::2]
    if layout == "expanded" and shape:
        return normal([1, *shape[1:]]).expand(shape)
    return normal(shape)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Call:
    """One generated call: ``make()`` builds fresh inputs and returns ``(fn, args, kwargs)``;
    ``target`` names what an out=/in-place form returns (``"out"``, ``"self"`` or None);
    ``exact``: no reduction is computed (PyTorch's bits expected); ``reference(args, kwargs)``
    returns the fp64 value and the per-element error bound."""

    text: str
    make: Callable[[], tuple]
    target: Optional[str]
    exact: bool
    reference: Callable[[tuple, dict], tuple[torch.Tensor, torch.Tensor]]

    def __repr__(self) -> str:
        return self.text


OUT_KINDS = st.sampled_from(["right", "empty", "transposed", "resized", "other dtype"])


def _out_tensor(kind: str, shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """An ``out=`` tensor for a ``shape`` result of ``dtype``: of that shape (contiguous or
    transposed), empty, of another shape with elements (PyTorch resizes it and warns) or of another
    dtype (PyTorch refuses it)."""
    if kind == "empty":
        return torch.empty(0, dtype=dtype)
    if kind == "resized":
        return torch.zeros(5, dtype=dtype)
    if kind == "other dtype":
        return torch.empty(shape, dtype=torch.float64 if dtype != torch.float64 else torch.float32)
    return _tensor(shape, dtype, "transposed" if kind == "transposed" else "contiguous", g)


@st.composite
def product_calls(draw) -> Call:
    """``mm``, ``addmm``, ``bmm``, ``baddbmm`` (functional, ``out=``, in-place) with every kind of
    operand, addend and scalar, and the mistakes PyTorch refuses."""
    op = draw(st.sampled_from(["mm", "addmm", "bmm", "baddbmm"]))
    adds = op in ("addmm", "baddbmm")
    form = draw(st.sampled_from(["functional", "out", "in-place"] if adds else ["functional", "out"]))
    batch = [draw(st.sampled_from([0, 1, 3]))] if op in ("bmm", "baddbmm") else []
    n, k, m = draw(SIZES), draw(SIZES), draw(SIZES)
    dtype = draw(st.sampled_from(FLOATS))
    fault = draw(st.sampled_from([None] * 6 + ["inner dim", "rank", "dtype", "integer", "addend"]))
    a_layout, b_layout, bias_layout = draw(LAYOUTS), draw(LAYOUTS), draw(LAYOUTS)
    full = [*batch, n, m]
    bias_shape = draw(st.sampled_from([full, full[-1:], [1, m], [n, 1], []] if form != "in-place" else [full]))
    beta, alpha = (draw(SCALARS), draw(SCALARS)) if adds else (1, 1)
    nonfinite = draw(st.booleans())  # NaN addend with beta=0 and inf in the product with alpha=0 (both ignored)
    seed, out_kind = draw(st.integers(0, 2**31 - 1)), draw(OUT_KINDS)

    def make():
        g = torch.Generator().manual_seed(seed)
        b_dtype = {"dtype": torch.float64 if dtype != torch.float64 else torch.float32, "integer": torch.int64}.get(
            fault, dtype
        )
        a = _tensor([*batch, n, k], dtype if fault != "integer" else torch.int64, a_layout, g)
        b_shape = [*batch, k + (fault == "inner dim"), m]
        b = _tensor(b_shape[1:] if fault == "rank" else b_shape, b_dtype, b_layout, g)
        if nonfinite and alpha == 0 and a.numel() and a.is_floating_point():
            a = a.clone()
            a[(0,) * a.dim()] = float("inf")
        if not adds:
            return getattr(torch, op), [a, b], _out_kwargs()
        shape = [*bias_shape[:-1], bias_shape[-1] + 1] if fault == "addend" and bias_shape else bias_shape
        bias = _tensor(shape, dtype, bias_layout if form != "in-place" else "contiguous", g)
        if nonfinite and beta == 0:
            bias = torch.full_like(bias, float("nan"))
        kwargs = {"beta": beta, "alpha": alpha, **_out_kwargs()}
        if form == "in-place":
            return getattr(torch.Tensor, op + "_"), [bias, a, b], kwargs
        return getattr(torch, op), [bias, a, b], kwargs

    def _out_kwargs():
        if form != "out":
            return {}
        return {"out": _out_tensor(out_kind, full, dtype, torch.Generator().manual_seed(seed))}

    def reference(args, kwargs):
        *addend, a, b = [t.double() for t in args]
        prod, scale = a @ b, a.abs() @ b.abs()
        value, bound_scale = alpha * prod, abs(alpha) * scale
        if addend and beta != 0:
            value = value + beta * addend[0]
            bound_scale = bound_scale + abs(beta) * addend[0].abs()
        return value, (2 * _eps(dtype) + (k + 2) * _eps(_acc(dtype))) * bound_scale

    text = (
        f"{op} {form} batch={batch} n={n} k={k} m={m} {dtype} fault={fault} layouts={a_layout},{b_layout},"
        f"{bias_layout} bias={bias_shape} beta={beta} alpha={alpha} nonfinite={nonfinite} out={out_kind} seed={seed}"
    )
    exact = 0 in (*batch, n, k, m) or alpha == 0
    return Call(text, make, {"out": "out", "in-place": "self"}.get(form), exact, reference)


@st.composite
def log_softmax_calls(draw) -> Call:
    """``torch.log_softmax`` (and its ``out=``) and ``aten._log_softmax`` with ``half_to_float``,
    over 0-d to 3-D tensors, dims in and out of range, every dtype."""
    form = draw(st.sampled_from(["functional", "out", "half_to_float"]))
    shape = draw(st.lists(SIZES, max_size=3))
    dim = draw(st.integers(-len(shape) - 1, len(shape)))
    dtype = draw(st.sampled_from(FLOATS + [torch.int64]))
    layout, seed, out_kind = draw(LAYOUTS), draw(st.integers(0, 2**31 - 1)), draw(OUT_KINDS)

    def make():
        g = torch.Generator().manual_seed(seed)
        x = _tensor(shape, dtype, layout, g, scale=3.0)
        if form == "half_to_float":
            return torch.ops.aten._log_softmax.default, [x, dim, True], {}
        kwargs = {"out": _out_tensor(out_kind, shape, dtype, g)} if form == "out" else {}
        return torch.log_softmax, [x, dim], kwargs

    def reference(args, kwargs):
        x = args[0].double()
        value = torch.log_softmax(x, args[1])
        tol = contract.tolerance("logprob", dtype)
        # PyTorch rounds the log-sum-exp (x - value) to a bf16/fp16 input's dtype before subtracting
        return value, tol.atol + tol.rtol * value.abs() + _eps(dtype) * (x.abs() + (x - value).abs())

    exact = 0 in shape or not shape
    text = f"log_softmax {form} shape={shape} dim={dim} {dtype} layout={layout} out={out_kind} seed={seed}"
    return Call(text, make, "out" if form == "out" else None, exact, reference)


@st.composite
def mean_calls(draw) -> Call:
    """``torch.mean`` over dims (None, [], one, several, repeated, out of range), keepdim, a
    dtype (floating or not), and ``out=`` of any dtype."""
    shape = draw(st.lists(SIZES, max_size=3))
    ndim = len(shape)
    any_dim = st.integers(-ndim - 1, ndim)
    dim = draw(st.one_of(st.none(), st.just([]), any_dim, st.lists(any_dim, min_size=1, max_size=3)))
    keepdim, dtype = draw(st.booleans()), draw(st.sampled_from(FLOATS + [torch.int64]))
    to = draw(st.sampled_from([None, None, *FLOATS, torch.int64]))
    form = draw(st.sampled_from(["functional", "out"]))
    out_dtype = draw(st.sampled_from([to or dtype, *FLOATS, torch.int64]))
    layout, seed = draw(LAYOUTS), draw(st.integers(0, 2**31 - 1))

    def make():
        g = torch.Generator().manual_seed(seed)
        x = _tensor(shape, dtype, layout, g)
        kwargs = {"keepdim": keepdim}
        if to is not None:
            kwargs["dtype"] = to
        if form == "out":
            kwargs["out"] = torch.empty(0, dtype=out_dtype)
        return torch.mean, [x] if dim is None else [x, dim], kwargs

    def reference(args, kwargs):
        x = args[0].double()
        dims = dim if dim not in (None, []) else list(range(ndim))
        value = x.mean(dims, keepdim=keepdim)
        result_dtype = kwargs["out"].dtype if "out" in kwargs else (to or dtype)
        count = x.numel() // max(1, value.numel())
        acc = _acc(torch.promote_types(dtype, result_dtype))
        return value, (2 * _eps(result_dtype) + (count + 2) * _eps(acc)) * x.abs().mean(dims, keepdim=keepdim)

    # an integer out= goes to PyTorch's kernel (CUDA accepts it where the CPU refuses): its bits
    exact = 0 in shape or not shape or (form == "out" and not out_dtype.is_floating_point)
    text = f"mean {form} shape={shape} dim={dim} keepdim={keepdim} {dtype} dtype={to} out={out_dtype} layout={layout} seed={seed}"
    return Call(text, make, "out" if form == "out" else None, exact, reference)


@dataclass
class Outcome:
    result: object = None
    error: Optional[BaseException] = None
    warnings: tuple = ()
    is_target: bool = False


def _run(call: Call, inside: bool, device: str) -> Outcome:
    fn, args, kwargs = call.make()
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with rk.batch_invariant(inside):
                result = fn(*args, **kwargs)
        except Exception as error:  # compared with PyTorch's below
            return Outcome(error=error)
    target = {"out": kwargs.get("out"), "self": args[0], None: None}[call.target]
    return Outcome(result, None, tuple(w.category for w in caught), result is target)


def _tensors(result) -> tuple:
    return tuple(result) if isinstance(result, tuple) else (result,)


def _layout(t: torch.Tensor) -> tuple:
    """Shape, dtype, contiguity and the strides of the dims whose stride matters (size > 1)."""
    return tuple(t.shape), t.dtype, t.is_contiguous(), tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _check(call: Call, device: str) -> None:
    outside, inside = _run(call, False, device), _run(call, True, device)
    if outside.error is not None:
        assert inside.error is not None, f"{call}: returned where PyTorch raises {outside.error!r}"
        assert type(inside.error) is type(outside.error) and str(inside.error) == str(outside.error), (
            f"{call}: raised {inside.error!r}, PyTorch {outside.error!r}"
        )
        return
    assert inside.error is None, f"{call}: raised {inside.error!r} where PyTorch returns"
    assert inside.warnings == outside.warnings, f"{call}: warned {inside.warnings}, PyTorch {outside.warnings}"
    assert inside.is_target == outside.is_target, f"{call}: the returned tensor is not the one PyTorch returns"
    again = _run(call, False, device)
    for got, want, want_again in zip(_tensors(inside.result), _tensors(outside.result), _tensors(again.result)):
        assert _layout(got) == _layout(want), f"{call}: layout {_layout(got)}, PyTorch {_layout(want)}"
        if call.exact:
            if _same_bits(want, want_again):  # else PyTorch's result is undefined itself (uninitialised memory)
                assert _same_bits(got, want), f"{call}: not PyTorch's bits"
            continue
        _, args, kwargs = call.make()  # fresh: an in-place call wrote to its inputs
        value, bound = call.reference(args, kwargs)
        for name, t in (("mode", got), ("PyTorch", want)):
            err = (t.cpu().double() - value).abs()
            assert bool(torch.isfinite(t).all()), f"{call}: {name}'s result is not finite"
            assert bool((err <= bound).all()), (
                f"{call}: {name}'s error {float((err - bound).max()):.3g} above the bound"
            )


@DEVICES
@SETTINGS
@given(product_calls())
def test_products_match_pytorch(device, call):
    _check(call, device)


@DEVICES
@SETTINGS
@given(log_softmax_calls())
def test_log_softmax_matches_pytorch(device, call):
    _check(call, device)


@DEVICES
@SETTINGS
@given(mean_calls())
def test_mean_matches_pytorch(device, call):
    _check(call, device)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda: torch.addmm(torch.full((3,), float("nan")), torch.randn(2, 4), torch.randn(4, 3), beta=0),
            id="addmm NaN input, beta=0",
        ),
        pytest.param(
            lambda: torch.addmm(torch.ones(3), torch.full((2, 4), float("inf")), torch.randn(4, 3), alpha=0),
            id="addmm inf mat1, alpha=0",
        ),
        pytest.param(lambda: torch.mm(torch.randn(2, 0), torch.randn(0, 3)), id="mm K=0"),
        pytest.param(lambda: torch.log_softmax(torch.randn(3, 0), -1), id="log_softmax empty row"),
        pytest.param(lambda: torch.log_softmax(torch.tensor(2.0), 0), id="log_softmax 0-d"),
        pytest.param(lambda: torch.log_softmax(torch.randn(3, 4), 0).view(-1), id="log_softmax dim 0 is contiguous"),
    ],
)
def test_issue_cases_give_pytorchs_result(call):
    torch.manual_seed(0)
    expected = call()
    torch.manual_seed(0)
    with rk.batch_invariant():
        got = call()
    assert _layout(got) == _layout(expected)
    torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize(
    "call, error",
    [
        pytest.param(lambda: torch.mm(torch.randn(4), torch.randn(4, 3)), RuntimeError, id="mm 1-D"),
        pytest.param(lambda: torch.mm(torch.randn(2, 4), torch.randn(5, 3)), RuntimeError, id="mm shapes"),
        pytest.param(
            lambda: torch.addmm(torch.randn(3).double(), torch.randn(2, 4), torch.randn(4, 3)),
            RuntimeError,
            id="addmm fp64 bias",
        ),
        pytest.param(
            lambda: torch.ops.aten._log_softmax(torch.randn(3, 4).half(), -1, True),
            RuntimeError,
            id="half_to_float on CPU",
        ),
        pytest.param(lambda: torch.log_softmax(torch.randn(3, 4), 2), IndexError, id="log_softmax dim"),
        pytest.param(lambda: torch.mean(torch.randn(2, 3), (1, 1)), RuntimeError, id="mean repeated dim"),
    ],
)
def test_issue_cases_raise_pytorchs_error(call, error):
    with pytest.raises(error) as outside:
        call()
    with rk.batch_invariant(), pytest.raises(error) as inside:
        call()
    assert str(inside.value) == str(outside.value)


def test_out_in_place_and_baddbmm_forms_are_routed(monkeypatch):
    from rl_kernel_core.batch_invariant_mode import api as invariance

    aten = torch.ops.aten
    forms = {
        aten.mm.out: lambda a, b, c: torch.mm(a, b, out=torch.empty(0)),
        aten.addmm.out: lambda a, b, c: torch.addmm(c[0], a, b, out=torch.empty(0)),
        aten.addmm_.default: lambda a, b, c: c.clone().addmm_(a, b),
        aten.bmm.out: lambda a, b, c: torch.bmm(a[None], b[None], out=torch.empty(0)),
        aten.baddbmm.default: lambda a, b, c: torch.baddbmm(c, a[None], b[None]),
        aten.baddbmm.out: lambda a, b, c: torch.baddbmm(c, a[None], b[None], out=torch.empty(0)),
        aten.baddbmm_.default: lambda a, b, c: c[None].clone().baddbmm_(a[None], b[None]),
        aten._log_softmax.out: lambda a, b, c: torch.log_softmax(a, -1, out=torch.empty(0)),
        aten.mean.out: lambda a, b, c: torch.mean(a, -1, out=torch.empty(0)),
    }
    routed = []
    for op in forms:
        route = invariance.ROUTED_OPS[op]

        def recording(*args, _op=op, _route=route, **kwargs):
            routed.append(_op)
            return _route(*args, **kwargs)

        monkeypatch.setitem(invariance.ROUTED_OPS, op, recording)
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    c = torch.randn(5, 3)
    with rk.batch_invariant():
        for call in forms.values():
            call(a, b, c)
    assert routed == list(forms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpu_silu_bits_do_not_depend_on_the_elements_place(dtype):
    # PyTorch's CPU silu computes a contiguous range's tail (range % vector step) and the pieces of a
    # thread split with scalar code that rounds unlike its vector code: a tensor-parallel rank's
    # half-width MLP gate (a strided [T, I/2] view of its gate/up output) rounded some elements unlike
    # the trainer's full-width [B, L, I] gate (fp32 at TP 2, vLLM harness seed 1608617430 draw 6)
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(7, 168, 192, generator=gen) * 3).to(dtype)
    gate = gate_up[..., :96]
    with rk.batch_invariant():
        full = torch.nn.functional.silu(gate.contiguous())
        for lo, hi in ((0, 48), (48, 96), (5, 77), (0, 33)):
            assert torch.equal(torch.nn.functional.silu(gate[..., lo:hi]), full[..., lo:hi]), (lo, hi)
            assert torch.equal(torch.nn.functional.silu(gate[2:3, :5, lo:hi].contiguous()), full[2:3, :5, lo:hi])
        in_place = gate.clone()
        torch.nn.functional.silu(in_place, inplace=True)
        out = torch.empty(0, dtype=dtype)
        torch.ops.aten.silu.out(gate, out=out)
        routed = torch.nn.functional.silu(gate)
        big = torch.randn(5, 40000, generator=gen).to(dtype)  # a range PyTorch splits among threads
        big_full = torch.nn.functional.silu(big)
        big_row = torch.nn.functional.silu(big[3:4, 123:])
    assert torch.equal(in_place, full) and torch.equal(out, full)
    assert torch.equal(big_row, big_full[3:4, 123:])
    plain = torch.nn.functional.silu(gate)
    assert routed.dtype == plain.dtype and routed.shape == plain.shape and routed.stride() == plain.stride()
    torch.testing.assert_close(routed.double(), plain.double(), rtol=4 * torch.finfo(dtype).eps, atol=0)


# ---- torch.compile: compiled code runs eagerly inside the mode ----


def _marking_backend(compiled: list):
    """A torch.compile backend whose graphs add 1000 to every output, so a result shows whether
    compiled code ran; ``compiled`` counts the graphs it was handed."""

    def backend(graph, example_inputs):
        compiled.append(graph)

        def run(*args):
            return tuple(t + 1000 for t in graph(*args))

        return run

    return backend


def _small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 64), torch.nn.RMSNorm(64), torch.nn.Linear(64, 30), torch.nn.LogSoftmax(-1)
    )


def test_compiled_code_runs_eagerly_in_the_mode_and_compiled_after(seed):
    model = _small_model()
    x = torch.randn(37, 40)
    compiled: list[object] = []
    fast = torch.compile(model, backend=_marking_backend(compiled))
    with torch.no_grad():
        outside = fast(x)
        assert len(compiled) == 1 and torch.allclose(outside - 1000, model(x), atol=1e-5)
        with rk.batch_invariant():
            eager = model(x)
            assert torch.equal(fast(x), eager), "a compiled model in the mode differs from the eager model in the mode"
            assert torch.equal(fast(x[:5]), eager[:5])
            fresh = torch.compile(_small_model(), backend=_marking_backend(compiled))
            assert torch.equal(fresh(x), eager) and len(compiled) == 1, "code compiled inside the mode"
        assert torch.equal(fast(x), outside), "the compiled code is used again after the mode"


def test_entering_the_mode_inside_a_compiled_function_raises(seed):
    @torch.compile(backend="eager")
    def step(x):
        with rk.batch_invariant():
            return x @ x.T

    with pytest.raises(Exception, match="set_stance"):
        step(torch.randn(3, 4))
    assert not rk.is_batch_invariant()
    with rk.batch_invariant():  # the mode's state is whole
        assert rk.is_batch_invariant()
    assert not rk.is_batch_invariant()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_inductor_model_in_the_mode_gives_the_eager_bits(seed, dtype):
    model = _small_model().to("cuda", dtype)
    x = torch.randn(37, 40, device="cuda", dtype=dtype)
    fast = torch.compile(model)
    with torch.no_grad():
        fast(x)  # compiled outside the mode
        with rk.batch_invariant():
            assert torch.equal(fast(x), model(x))
            assert torch.equal(fast(x[:5]), fast(x)[:5])
