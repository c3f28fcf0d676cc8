"""Batch-invariant mode and ops: the switch, bitwise invariance across N and row position,
accuracy against fp64 formulas written here, gradients, strided/empty inputs, bad input.

Invariance is asserted with torch.equal (bit for bit); accuracy with rl_kernel_core.contract. Ops
whose output stays in a bf16/fp16 input dtype are rounded once to that dtype after the contract's
fp32-accumulation error, so ``oracles.close_in_dtype`` adds one unit in the last place of that
dtype (``torch.finfo(dtype).eps * |expected|``) to the contract bound.
"""

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract
from rl_kernel_core.batch_invariant_mode.api import bi_linear, bi_log_softmax, bi_matmul, bi_mean
from rl_kernel_core.dispatch import BackendUnavailableError, explain
from oracles import close_in_dtype, rows_invariant

SIZES = (1, 7, 64, 300)
LOW = (torch.float32, torch.bfloat16, torch.float16)


def test_mode_switch_and_context_manager():
    rk.set_batch_invariant_mode(False)
    assert rk.is_batch_invariant() is False
    with rk.batch_invariant():
        assert rk.is_batch_invariant() is True
        with rk.batch_invariant(False):
            assert rk.is_batch_invariant() is False
        assert rk.is_batch_invariant() is True
    assert rk.is_batch_invariant() is False
    with pytest.raises(KeyError):
        with rk.batch_invariant():
            raise KeyError("inside")
    assert rk.is_batch_invariant() is False
    assert rk.set_batch_invariant_mode(True) is False
    assert rk.set_batch_invariant_mode(False) is True
    with pytest.raises(TypeError, match="enabled"):
        rk.set_batch_invariant_mode(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_matmul_and_linear_rows_are_bitwise_invariant(seed, dtype):
    k, m = 384, 1000
    a = torch.randn(max(SIZES), k).to(dtype)
    b = torch.randn(k, m).to(dtype)
    w, bias = torch.randn(m, k).to(dtype), torch.randn(m).to(dtype)
    rows_invariant(lambda t: bi_matmul(t, b), a, SIZES)
    rows_invariant(lambda t: bi_linear(t, w, bias), a, SIZES)
    with rk.batch_invariant():
        assert torch.equal(bi_matmul(a[:7], b), bi_matmul(a, b)[:7])


@pytest.mark.parametrize("width", [1000, 40000])
def test_bi_log_softmax_mean_and_rms_norm_rows_are_bitwise_invariant(seed, width):
    x = torch.randn(max(SIZES), width) * 3
    weight = torch.randn(width)
    rows_invariant(lambda t: bi_log_softmax(t), x, SIZES)
    rows_invariant(lambda t: bi_mean(t, -1), x, SIZES)
    rows_invariant(lambda t: rk.rms_norm(t, weight), x, SIZES)


def test_rows_along_another_dim_are_bitwise_invariant(seed):
    xt = torch.randn(1000, max(SIZES)) * 3  # rows are the slices x[:, j]
    mean, logp = bi_mean(xt, 0), bi_log_softmax(xt, dim=0)
    for n in SIZES:
        assert torch.equal(bi_mean(xt[:, :n], 0), mean[:n])
        assert torch.equal(bi_log_softmax(xt[:, :n], dim=0), logp[:, :n])


def test_rms_norm_leading_dims_and_mode_do_not_change_bits(seed):
    h = 256
    x = torch.randn(3, 50, h).to(torch.bfloat16)
    weight = torch.randn(h)
    flat = rk.rms_norm(x.reshape(-1, h), weight)
    assert torch.equal(rk.rms_norm(x, weight).reshape(-1, h), flat)
    with rk.batch_invariant():
        assert torch.equal(rk.rms_norm(x, weight).reshape(-1, h), flat)
    assert torch.equal(rk.rms_norm(x[1], weight), flat[50:100])


@pytest.mark.parametrize("dtype", LOW)
def test_ops_match_fp64_formulas(seed, dtype):
    n, k, m = 45, 200, 300
    a, b = torch.randn(n, k).to(dtype), torch.randn(k, m).to(dtype)
    w, bias = torch.randn(m, k).to(dtype), torch.randn(m).to(dtype)
    close_in_dtype(bi_matmul(a, b), a.double() @ b.double(), "attention", dtype, "bi_matmul")
    close_in_dtype(bi_linear(a, w, bias), a.double() @ w.double().t() + bias.double(), "attention", dtype, "bi_linear")
    x = (torch.randn(4, n, m) * 3).to(dtype)
    x64 = x.double()
    lse = x64.exp().sum(dim=1, keepdim=True).log()
    out = bi_log_softmax(x, dim=1)
    assert out.dtype == dtype and out.shape == x.shape
    close_in_dtype(out, x64 - lse, "logprob", dtype, "bi_log_softmax")
    mean = bi_mean(x, (0, 2), keepdim=True)
    assert mean.shape == (1, n, 1)
    close_in_dtype(mean, x64.sum(dim=(0, 2), keepdim=True) / (4 * m), "reduction", dtype, "bi_mean")
    weight = torch.randn(m)
    eps = 1e-5
    expected = x64 / (x64.pow(2).sum(dim=-1, keepdim=True) / m + eps).sqrt() * weight.double()
    y = rk.rms_norm(x, weight, eps)
    assert y.dtype == dtype and y.shape == x.shape
    close_in_dtype(y, expected, "reduction", dtype, "rms_norm")


def test_rms_norm_gradients(seed):
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda xx, ww: rk.rms_norm(xx, ww, 1e-6), (x, weight))
    n, h = 37, 96
    x32 = torch.randn(n, h, requires_grad=True)
    w32 = torch.randn(h, requires_grad=True)
    upstream = torch.randn(n, h)
    gx, gw = torch.autograd.grad(rk.rms_norm(x32, w32), (x32, w32), upstream)
    x64 = x32.detach().double().requires_grad_()
    w64 = w32.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    ex, ew = torch.autograd.grad(y64, (x64, w64), upstream.double())
    contract.assert_close(gx, ex, "gradient", torch.float32, name="dx")
    contract.assert_close(gw, ew, "gradient", torch.float32, name="dweight")


def test_strided_inputs_give_the_same_bits(seed):
    storage = torch.randn(128, 70)
    strided = storage.t()[:, 3:67]  # [70, 64], non-contiguous
    dense = strided.contiguous()
    weight = torch.randn(64)
    b = torch.randn(64, 50)
    assert torch.equal(rk.rms_norm(strided, weight), rk.rms_norm(dense, weight))
    assert torch.equal(bi_matmul(strided, b), bi_matmul(dense, b))
    assert torch.equal(bi_matmul(dense, b.t().contiguous().t()), bi_matmul(dense, b))
    assert torch.equal(bi_log_softmax(strided), bi_log_softmax(dense))


def test_empty_rows(seed):
    assert rk.rms_norm(torch.randn(0, 16), torch.randn(16)).shape == (0, 16)
    assert bi_matmul(torch.randn(2, 0, 8), torch.randn(8, 5)).shape == (2, 0, 5)
    assert bi_mean(torch.randn(0, 4), -1).shape == (0,)


def test_dispatch_records_torch_and_refuses_unavailable_backends(seed):
    x, weight = torch.randn(4, 8), torch.randn(8)
    rk.rms_norm(x, weight, backend="torch")
    assert explain("rms_norm").backend == "torch"
    bi_matmul(x, torch.randn(8, 3))
    assert explain("bi_matmul").backend == "torch"
    with pytest.raises(BackendUnavailableError, match="rms_norm"):
        rk.rms_norm(x, weight, backend="triton")


_BAD = [
    ("rms_norm int x", lambda: rk.rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.randn(4)), TypeError, "x"),
    ("rms_norm empty H", lambda: rk.rms_norm(torch.randn(2, 0), torch.randn(0)), ValueError, "x"),
    ("rms_norm weight shape", lambda: rk.rms_norm(torch.randn(2, 4), torch.randn(5)), ValueError, "weight"),
    ("rms_norm weight 2-D", lambda: rk.rms_norm(torch.randn(2, 4), torch.randn(1, 4)), ValueError, "weight"),
    (
        "rms_norm weight device",
        lambda: rk.rms_norm(torch.randn(2, 4), torch.randn(4, device="meta")),
        ValueError,
        "weight",
    ),
    ("rms_norm eps", lambda: rk.rms_norm(torch.randn(2, 4), torch.randn(4), eps=-1e-6), ValueError, "eps"),
    ("bi_matmul K", lambda: bi_matmul(torch.randn(2, 4), torch.randn(5, 3)), ValueError, "b"),
    ("bi_matmul dtype", lambda: bi_matmul(torch.randn(2, 4), torch.randn(4, 3, dtype=torch.float64)), TypeError, "b"),
    ("bi_matmul 0-d", lambda: bi_matmul(torch.tensor(1.0), torch.randn(1, 3)), ValueError, "a"),
    ("bi_linear bias", lambda: bi_linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4)), ValueError, "bias"),
    ("bi_linear weight K", lambda: bi_linear(torch.randn(2, 4), torch.randn(3, 5)), ValueError, "weight"),
    ("bi_log_softmax dim range", lambda: bi_log_softmax(torch.randn(2, 4), dim=2), ValueError, "dim"),
    ("bi_log_softmax dim type", lambda: bi_log_softmax(torch.randn(2, 4), dim=1.0), TypeError, "dim"),  # type: ignore[arg-type]
    ("bi_mean repeated dim", lambda: bi_mean(torch.randn(2, 4), (1, -1)), ValueError, "dim"),
    ("bi_mean keepdim", lambda: bi_mean(torch.randn(2, 4), 1, keepdim=1), TypeError, "keepdim"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("case", _BAD, ids=[c[0] for c in _BAD])
def test_bad_input_names_the_argument(case):
    _, call, error, name = case
    with pytest.raises(error, match=name):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_are_bitwise_invariant(seed, dtype):
    k, m = 896, 4096
    a = torch.randn(max(SIZES), k, device="cuda").to(dtype)
    b = torch.randn(k, m, device="cuda").to(dtype)
    weight = torch.randn(k, device="cuda")
    rows_invariant(lambda t: bi_matmul(t, b), a, SIZES)
    rows_invariant(lambda t: rk.rms_norm(t, weight), a, SIZES)
    rows_invariant(lambda t: bi_log_softmax(t), a @ b, SIZES)
    rows_invariant(lambda t: bi_mean(t, -1), a, SIZES)


# ---- routing of a model's aten ops while the mode is on ----


def _first_rows_match(fn, x, sizes=(1, 3, 8, 37)):
    """fn(x[:n]) equals fn(x)[:n] bit for bit for every n."""
    full = fn(x)
    return all(torch.equal(fn(x[:n]), full[:n]) for n in sizes)


def _routed_calls():
    """Functions of a batch x whose rows must be batch-invariant under the mode."""
    w = torch.randn(96, 200)
    b = torch.randn(96)
    w3 = torch.randn(200, 64)
    return {
        "F.linear": lambda x: torch.nn.functional.linear(x, w),
        "F.linear+bias": lambda x: torch.nn.functional.linear(x, w, b),
        "matmul 3-D": lambda x: torch.matmul(x.unsqueeze(1).expand(-1, 3, -1).contiguous(), w3),
        "bmm": lambda x: torch.bmm(x.view(x.shape[0], 4, 50), torch.ones(x.shape[0], 50, 8) * w3[:50, :8]),
        "log_softmax": lambda x: torch.log_softmax(x * 3, dim=-1),
        "mean": lambda x: x.pow(2).mean(-1, keepdim=True),
        "F.rms_norm": lambda x: torch.nn.functional.rms_norm(x, (200,), b.new_ones(200) + 0.1, 1e-6),
        "mm out=": lambda x: torch.mm(x, w.T, out=torch.empty(0)),
        "addmm out=": lambda x: torch.addmm(b, x, w.T, beta=0.5, alpha=2, out=torch.empty(0)),
        "addmm_": lambda x: b.repeat(x.shape[0], 1).addmm_(x, w.T),
        "baddbmm": lambda x: torch.baddbmm(
            b[:8], x.view(x.shape[0], 4, 50), torch.ones(x.shape[0], 50, 8) * w3[:50, :8]
        ),
        "log_softmax out=": lambda x: torch.log_softmax(x * 3, -1, out=torch.empty(0)),
        "mean out=": lambda x: torch.mean(x.pow(2), -1, keepdim=True, out=torch.empty(0)),
    }


@pytest.mark.parametrize("name", list(_routed_calls()))
def test_mode_routes_torch_ops_to_batch_invariant_rows(seed, name):
    fn = _routed_calls()[name]
    x = torch.randn(64, 200)
    with rk.batch_invariant():
        assert _first_rows_match(fn, x), f"{name}: a row changed with the batch size inside the mode"
        inside = fn(x)
    outside = fn(x)
    # Same values up to rounding, so the route computes the same function.
    torch.testing.assert_close(inside, outside, atol=1e-4, rtol=1e-4)


def test_mode_routes_matmul_drift_that_exists_outside(seed):
    """The CPU GEMM's bits depend on N outside the mode for some shape; the mode removes it."""
    w = torch.randn(1024, 512)
    x = torch.randn(300, 512)
    fn = lambda t: t @ w.T
    outside_varies = not _first_rows_match(fn, x, sizes=(1, 7, 64))
    with rk.batch_invariant():
        assert _first_rows_match(fn, x, sizes=(1, 7, 64))
    if not outside_varies:
        pytest.skip("this machine's GEMM happened to be batch-invariant for these shapes")


@pytest.mark.parametrize("op", ["linear_logprob", "logprob_from_logits", "sample"])
def test_rl_kernel_ops_give_a_row_the_same_bits_at_any_batch_size_in_the_mode(seed, op):
    """rl-kernel's own ops on the torch backend in the mode: a row's log-prob (and entropy, and
    drawn token) is bitwise the same in a call over N rows and over any slice holding it."""
    n, d, v = 67, 64, 3001
    hidden = torch.randn(n, d)
    weight = torch.randn(v, d) * d**-0.5
    logits = (torch.randn(n, v) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,))
    seeds = torch.randint(-(2**62), 2**62, (n,))
    calls = {
        "linear_logprob": lambda rows: rk.linear_logprob(
            hidden[rows], weight, targets[rows], return_entropy=True, backend="torch"
        ),
        "logprob_from_logits": lambda rows: rk.logprob_from_logits(
            logits[rows], targets[rows], temperature=0.7, return_entropy=True, backend="torch"
        ),
        "sample": lambda rows: rk.sample(
            logits[rows], temperature=0.9, top_k=40, top_p=0.9, seeds=seeds[rows], backend="torch"
        ),
    }
    with rk.batch_invariant():
        full = calls[op](slice(None))
        for rows in (slice(0, 1), slice(n - 5, n), slice(3, 40)):
            for whole, part in zip(full, calls[op](rows)):
                assert torch.equal(whole[rows], part), f"{op}: rows {rows} changed with the batch"


def test_routing_table_names_each_op():
    from rl_kernel_core.batch_invariant_mode import api as invariance

    names = {str(op) for op in invariance.ROUTED_OPS}
    for op in (
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten._log_softmax.default",
        "aten.mean.dim",
        "aten._fused_rms_norm.default",
        "aten.mm.out",
        "aten.addmm.out",
        "aten.addmm_.default",
        "aten.bmm.out",
        "aten.baddbmm.default",
        "aten.baddbmm.out",
        "aten.baddbmm_.default",
        "aten._log_softmax.out",
        "aten.mean.out",
        "aten.silu.default",
        "aten.silu.out",
        "aten.silu_.default",
    ):
        assert op in names


def test_fused_rms_norm_route_matches_torch(seed):
    x = torch.randn(10, 6, 32)
    w = torch.randn(32)
    expected = torch.ops.aten._fused_rms_norm(x, [32], w, 1e-5)
    with rk.batch_invariant():
        got = torch.ops.aten._fused_rms_norm(x, [32], w, 1e-5)
        assert torch.equal(torch.ops.aten._fused_rms_norm(x[:1], [32], w, 1e-5)[0], got[0][:1])
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)


def _routed_cpu_kernel(op: str) -> bool:
    """Whether aten ``op``'s CPU kernel is currently the mode's route."""
    table = torch._C._dispatch_dump_table(op)
    return any(line.startswith("CPU:") and "batch_invariant_mode/api.py" in line for line in table.splitlines())


def test_routing_is_restored_on_exit_nesting_and_exceptions(seed):
    assert not _routed_cpu_kernel("aten::mm")
    with rk.batch_invariant():
        assert _routed_cpu_kernel("aten::mm") and _routed_cpu_kernel("aten::mean.dim")
        with rk.batch_invariant():
            assert _routed_cpu_kernel("aten::mm")
        assert _routed_cpu_kernel("aten::mm")
    assert not _routed_cpu_kernel("aten::mm") and not _routed_cpu_kernel("aten::mean.dim")
    with pytest.raises(ValueError):
        with rk.batch_invariant():
            raise ValueError("inside")
    assert not _routed_cpu_kernel("aten::mm") and not rk.is_batch_invariant()


def test_mode_touches_no_other_op_and_no_dispatch_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    with rk.batch_invariant():
        assert not _get_current_dispatch_mode_stack()
        assert not _routed_cpu_kernel("aten::add.Tensor") and not _routed_cpu_kernel("aten::mul.Tensor")


def test_mode_routes_other_threads_and_inference_mode(seed, monkeypatch):
    import threading

    from rl_kernel_core.batch_invariant_mode import api as invariance

    routed = []

    def recording_route(a, b):
        routed.append(threading.current_thread().name)
        return bi_matmul(a, b)

    monkeypatch.setitem(invariance.ROUTED_OPS, torch.ops.aten.mm.default, recording_route)
    a, b = torch.randn(40, 24), torch.randn(24, 16)
    results = {}

    def other_thread():
        with torch.inference_mode():
            results["mm"] = a @ b

    with rk.batch_invariant():
        worker = threading.Thread(target=other_thread, name="worker")
        worker.start()
        worker.join()
        with invariance.routing_suspended():
            results["suspended"] = a @ b
        with rk.batch_invariant(False):
            results["opted out"] = a @ b
    assert routed == ["worker"]
    assert torch.equal(results["mm"], bi_matmul(a, b))


def test_mode_refuses_a_torch_without_get_kernel(monkeypatch):
    monkeypatch.delattr(torch.library, "get_kernel")
    with pytest.raises(RuntimeError, match=r"needs torch>=2\.9"):
        rk.set_batch_invariant_mode(True)
    assert not rk.is_batch_invariant() and not _routed_cpu_kernel("aten::mm")


def test_mode_keeps_gradients(seed):
    x = torch.randn(5, 40, requires_grad=True)
    w = torch.randn(30, 40, requires_grad=True)

    def loss():
        return torch.log_softmax(torch.nn.functional.linear(x, w), -1).mean()

    expected = torch.autograd.grad(loss(), (x, w))
    with rk.batch_invariant():
        got = torch.autograd.grad(loss(), (x, w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_mode_leaves_integer_ops_alone():
    a = torch.arange(12).view(3, 4)
    with rk.batch_invariant():
        assert torch.equal(a @ a.T, torch.tensor([[14, 38, 62], [38, 126, 214], [62, 214, 366]]))


# ---- the mode under threads ----


def _on_thread(fn):
    """Run ``fn`` on a new thread and return its result (re-raising its exception here)."""
    import threading

    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as error:  # handed to the calling thread
            result["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_mode_blocks_on_several_threads_keep_a_count():
    """Overlapping blocks on two threads: the mode stays on until the last one exits; a thread
    inside batch_invariant(False) runs without it while the other thread's block holds it."""
    import threading

    step = [threading.Event() for _ in range(3)]
    seen = {}

    def other():
        with rk.batch_invariant():
            step[0].set()
            step[1].wait()
            seen["other, after main left"] = rk.is_batch_invariant()
        step[2].set()

    thread = threading.Thread(target=other)
    with rk.batch_invariant():
        thread.start()
        step[0].wait()
    assert rk.is_batch_invariant(), "main left its block: the other thread's block still holds the mode"
    with rk.batch_invariant(False):
        assert not rk.is_batch_invariant()
        assert _on_thread(rk.is_batch_invariant), "a thread's batch_invariant(False) turned the mode off for another"
    step[1].set()
    step[2].wait()
    thread.join()
    assert seen == {"other, after main left": True}
    assert not rk.is_batch_invariant()


def test_set_batch_invariant_mode_refuses_to_contradict_the_threads_block():
    with rk.batch_invariant():
        with pytest.raises(RuntimeError, match=r"set_batch_invariant_mode\(False\).*batch_invariant\(False\)"):
            rk.set_batch_invariant_mode(False)
        with rk.batch_invariant(False):
            with pytest.raises(RuntimeError, match=r"set_batch_invariant_mode\(True\)"):
                rk.set_batch_invariant_mode(True)
        assert rk.set_batch_invariant_mode(True) is False  # agrees with the block: the switch holds it too
    assert rk.is_batch_invariant()
    assert rk.set_batch_invariant_mode(False) is True
    assert not rk.is_batch_invariant()


def test_registrations_stay_while_another_thread_lives_and_pass_calls_through(seed):
    import threading

    a, b = torch.randn(40, 24), torch.randn(24, 16)
    release = threading.Event()
    idle = threading.Thread(target=release.wait)
    idle.start()
    try:
        with rk.batch_invariant():
            pass
        assert not rk.is_batch_invariant() and _routed_cpu_kernel("aten::mm")
        assert torch.equal(
            a @ b, torch.ops.aten.mm.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), a, b)
        )
    finally:
        release.set()
        idle.join()
    with rk.batch_invariant():
        pass
    assert not _routed_cpu_kernel("aten::mm"), "alone again, leaving the mode removes the registrations"


def test_mode_entered_and_left_on_one_thread_while_others_compute(seed):
    """Stress: one thread enters and leaves the mode over and over while two others run routed ops.
    No call fails, and each result is bit for bit either PyTorch's or the batch-invariant one."""
    import threading
    import time

    a, b, bias = torch.randn(16, 32), torch.randn(32, 24), torch.randn(24)
    x = torch.randn(16, 40) * 3
    calls = {
        "mm": lambda: torch.mm(a, b),
        "addmm": lambda: torch.addmm(bias, a, b),
        "log_softmax": lambda: torch.log_softmax(x, -1),
    }
    allowed = {name: {fn().numpy().tobytes()} for name, fn in calls.items()}
    with rk.batch_invariant():
        for name, fn in calls.items():
            allowed[name].add(fn().numpy().tobytes())
    stop = threading.Event()
    failures, rounds = [], [0, 0]

    def compute(worker):
        try:
            while not stop.is_set():
                for name, fn in calls.items():
                    if fn().numpy().tobytes() not in allowed[name]:
                        failures.append(f"{name}: bits neither PyTorch's nor the mode's")
                rounds[worker] += 1
        except Exception as error:
            failures.append(repr(error))

    workers = [threading.Thread(target=compute, args=(i,), daemon=True) for i in range(2)]
    # for 3 s at least: the registration races this guards against crashed within 50 to 1,100 toggles
    toggles, start = 0, time.monotonic()
    try:
        for worker in workers:
            worker.start()
        while (
            (time.monotonic() < start + 3 or toggles < 300 or min(rounds) < 100)
            and not failures
            and time.monotonic() < start + 60
        ):
            with rk.batch_invariant():
                torch.mm(a, b)
            toggles += 1
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert not failures, failures[:3]
    assert min(rounds) >= 100, f"the workers ran only {rounds} rounds"
    assert not rk.is_batch_invariant()


def test_mode_state_is_per_context_with_out_of_order_exits(seed):
    """asyncio tasks and generators interleaving batch_invariant blocks on one thread, while another
    thread holds the mode: every context sees its own innermost open block, and all closed leaves the
    state of before (issue: per-thread state restored out of order)."""
    import asyncio
    import threading

    from rl_kernel_core.batch_invariant_mode.api import batch_invariant, is_batch_invariant, set_batch_invariant_mode

    holding, release = threading.Event(), threading.Event()

    def holder():
        with batch_invariant():
            holding.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    holding.wait(30)
    try:
        assert is_batch_invariant()  # the other thread holds it

        def gen(enabled):
            with batch_invariant(enabled):
                yield is_batch_invariant()
                yield is_batch_invariant()

        off, on = gen(False), gen(True)
        assert next(off) is False and next(on) is True
        assert next(off) is True  # the generators share this context: the later block is innermost
        off.close()  # closed out of order: the open True block stays innermost
        assert is_batch_invariant() and next(on) is True
        on.close()
        assert is_batch_invariant()
        set_batch_invariant_mode(False)  # no block open in this context: allowed (it raised before)

        async def task(enabled, gate_in, gate_out, seen):
            with batch_invariant(enabled):
                gate_in.set()
                await gate_out.wait()
                seen.append((enabled, is_batch_invariant()))

        async def main():
            a_in, a_out, b_in, b_out = (asyncio.Event() for _ in range(4))
            seen: list = []
            ta = asyncio.create_task(task(False, a_in, a_out, seen))
            tb = asyncio.create_task(task(True, b_in, b_out, seen))
            await a_in.wait()
            await b_in.wait()
            a_out.set()  # the first task's block closes first
            await ta
            b_out.set()
            await tb
            return seen

        assert asyncio.run(main()) == [(False, False), (True, True)]
        assert is_batch_invariant()
    finally:
        release.set()
        t.join()
    assert not is_batch_invariant()


def test_entering_the_mode_while_compiling_is_a_one_line_error(seed):
    from rl_kernel_core.batch_invariant_mode.api import batch_invariant

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        with batch_invariant():
            return x + 1

    with pytest.raises(Exception, match="inside a function torch.compile is tracing"):
        f(torch.ones(2))
    assert not rk.is_batch_invariant()
