"""The C++ launcher of the batch-invariant kernels (:mod:`rl_kernel_core.batch_invariant_mode.triton_launch`):
a launch it serves gives the bits Triton's launch gives, for every kernel and layout the mode
routes and for varlen_attention's forward; it serves the second call of a specialization; its plan is checked against Python's.

GPU only: the extension launches compiled cubins."""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.batch_invariant_mode import triton as tbi
from rl_kernel_core.batch_invariant_mode import triton_launch as native_launch
from rl_kernel_core.triton import tuning

pytestmark = pytest.mark.gpu


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(native_launch.SWITCH, raising=False)
    if native_launch.extension() is None:
        pytest.fail(f"the triton_launch extension is not available: {native_launch.unavailable_reason()}")
    previous = native_launch.set_enabled(True)
    yield native_launch
    native_launch.set_enabled(previous)


def _served_twice(fn):
    """fn() twice (the first may teach the launcher the specialization); the second must be served."""
    fn()
    before = native_launch.stats()["hits"]
    out = fn()
    assert native_launch.stats()["hits"] == before + 1, "the second call of a specialization was not served"
    return out


def _operands(layout: str, m: int, k: int, n: int, dtype: torch.dtype):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
    g = torch.randn(m, n, device="cuda").to(dtype)
    if layout == "fwd":  # x @ W.T
        return x, w
    if layout == "dx":  # g @ W: b_t = W.T, column-major
        return g, w.t()
    if layout == "dw":  # g.T @ x: a column-major
        return g.t(), x.t()
    if layout == "strided":  # a row slice of a wider buffer (odd row stride)
        wide = torch.randn(m, k + 3, device="cuda").to(dtype)
        return wide[:, :k], w
    raise ValueError(layout)


_MATMUL_CASES = [
    # (layout, m, k, n, dtype): pointer kernel at decode sizes, TMA from TMA_MIN_ROWS and for weight gradients
    ("fwd", 1, 256, 512, torch.bfloat16),
    ("fwd", 7, 1024, 3072, torch.bfloat16),
    ("fwd", 33, 256, 262, torch.float16),
    ("fwd", 9, 128, 200, torch.float32),
    ("strided", 5, 200, 96, torch.bfloat16),
    ("dx", 64, 512, 256, torch.bfloat16),
    ("fwd", tuning.TMA_MIN_ROWS + 37, 512, 264, torch.bfloat16),
    ("fwd", tuning.TMA_MIN_ROWS, 256, 262, torch.bfloat16),
    ("dx", tuning.TMA_MIN_ROWS + 1, 256, 512, torch.bfloat16),
    ("dw", tuning.TMA_MIN_WEIGHT_GRAD_K + 3, 384, 256, torch.bfloat16),  # few output tiles: the narrow tile
    ("dw", tuning.TMA_MIN_WEIGHT_GRAD_K + 3, 1024, 3072, torch.bfloat16),  # waves filled alike: the wide tile
]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout,m,k,n,dtype", _MATMUL_CASES)
def test_served_matmul_gives_tritons_bits(seed, launcher, layout, m, k, n, dtype, with_bias):
    a, b_t = _operands(layout, m, k, n, dtype)
    bias = torch.randn(b_t.shape[0], device="cuda").to(dtype) if with_bias else None
    tma = tbi.uses_tma(
        dtype, a.device, a.shape[0], False, k=a.shape[1], a_column_major=a.stride(0) == 1 and a.stride(1) != 1
    )
    expected = tbi.matmul_forward(a, b_t, bias, tma=tma)  # an explicit kernel: Triton's launcher
    got = _served_twice(lambda: tbi.matmul_forward(a, b_t, bias))
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
    assert torch.equal(got, expected), f"max |served - triton| {(got.float() - expected.float()).abs().max()}"


def test_explain_names_the_cpp_launch_where_it_served(seed, launcher):
    from rl_kernel_core import dispatch
    from rl_kernel_core.batch_invariant_mode.api import bi_matmul, bi_mean

    a, b_t = _operands("fwd", 64, 128, 96, torch.bfloat16)
    x = torch.randn(5, 300, device="cuda")
    for call, op in (
        (lambda: bi_matmul(a, b_t.t(), backend="triton"), "bi_matmul"),
        (lambda: bi_mean(x, -1, backend="triton"), "bi_mean"),
    ):
        _served_twice(call)
        assert dispatch.explain(op).route == "triton+cpp_launch", op
        native_launch.set_enabled(False)
        call()
        native_launch.set_enabled(True)
        assert dispatch.explain(op).route == "triton", op


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize(
    "rows,width,dtype",
    [(1, 1, torch.bfloat16), (5, 7, torch.float32), (3, 4099, torch.bfloat16), (17, 1024, torch.float16)],
)
def test_served_row_pass_gives_tritons_bits(seed, launcher, mode, rows, width, dtype):
    x = (torch.randn(rows, width, device="cuda") * 3).to(dtype)
    native_launch.set_enabled(False)
    expected = tbi._row_pass(x, mode, 1e-6)
    native_launch.set_enabled(True)
    got = _served_twice(lambda: tbi._row_pass(x, mode, 1e-6))
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "dtype,hq,hkv,d,causal",
    [(torch.bfloat16, 16, 8, 128, True), (torch.float16, 4, 4, 64, False), (torch.float32, 8, 2, 80, True)],
)
def test_served_attention_forward_gives_tritons_bits(seed, launcher, dtype, hq, hkv, d, causal):
    """varlen_attention's forward (a decode step over a KV cache: one query a sequence; or a full
    prefill), GQA, a head dim that is not a power of two: out and lse bitwise Triton's launch's."""
    from rl_kernel_core.batch_invariant_mode import triton_attention as tattn

    lens_q, lens_k = ([1, 1, 1], [5, 40, 130]) if causal else ([7, 33], [7, 33])
    cu_q = [sum(lens_q[:i]) for i in range(len(lens_q) + 1)]
    cu_k = [sum(lens_k[:i]) for i in range(len(lens_k) + 1)]
    q = torch.randn(cu_q[-1], hq, d, device="cuda").to(dtype)
    k, v = (torch.randn(cu_k[-1], hkv, d, device="cuda").to(dtype) for _ in range(2))
    native_launch.set_enabled(False)
    expected = tattn._forward(q, k, v, cu_q, cu_k, causal, 0.3)
    native_launch.set_enabled(True)
    got = _served_twice(lambda: tattn._forward(q, k, v, cu_q, cu_k, causal, 0.3))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    launch = tattn._forward_launch(dtype, hq, hkv, d, causal)
    tables = tattn._tables(q.device, launch["BLOCK_M"], tuple(cu_q), tuple(cu_k))
    assert tables is not None
    tensors = [q, k, v, got[0], got[1], *tables]
    refused = launcher.extension().remember_attention_forward(
        tensors, 0.3, launch["BLOCK_M"], launch["BLOCK_N"], causal, tables[2].shape[0], hq + 1, 0, 4, 0, [1] * 10
    )
    assert "differs from the launch Python made" in refused, refused


def test_the_mode_serves_a_decode_step_with_the_same_bits(seed, launcher):
    """A routed linear + RMSNorm-style mean, as transformers' decode issues them, with and without the launcher."""
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(1024, 3072, bias=True, device="cuda", dtype=torch.bfloat16)

    def step():
        with rk.batch_invariant(), torch.no_grad():
            h = lin(x)
            return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)

    native_launch.set_enabled(False)
    expected = step()
    native_launch.set_enabled(True)
    step()
    before = native_launch.stats()["hits"]
    got = step()
    assert native_launch.stats()["hits"] >= before + 2  # the addmm and the mean
    assert torch.equal(got, expected)


def test_served_launches_captured_in_a_cuda_graph_replay_the_eager_bits(seed, launcher):
    """The vLLM adapter captures the mode's decode as CUDA graphs: the C++ launches go to the
    capturing stream (their outputs into the graph's pool) and a replay on new inputs gives the
    eager bits."""
    lin = torch.nn.Linear(1024, 3072, bias=True, device="cuda", dtype=torch.bfloat16)

    def forward(x):
        h = lin(x)
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)

    static_in = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    fresh = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    with rk.batch_invariant(), torch.no_grad():
        expected = forward(fresh)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        before = native_launch.stats()["hits"]
        with torch.cuda.graph(graph):
            static_out = forward(static_in)
        assert native_launch.stats()["hits"] >= before + 2  # the addmm and the mean, captured from C++
    static_in.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected)


def test_a_plan_that_differs_from_pythons_launch_raises(seed, launcher):
    """remember_* re-plans the call and refuses a kernel launched with another kernel choice, grid
    or tile, or whose arguments do not fit the plan's; a call no plan serves keeps nothing."""
    a = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    b_t = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    out = tbi.matmul_forward(a, b_t, None)
    ext = native_launch.extension()
    tile = list(tbi.matmul_tile(torch.bfloat16, a.device)[:2])
    assert "differs from the launch Python made" in ext.remember_matmul(
        a, b_t, None, out, True, 1, tile, 0, 8, 0, [1] * 14, []
    )
    grid = min(-(-512 // tile[1]), torch.cuda.get_device_properties(0).multi_processor_count)
    refused = ext.remember_matmul(a, b_t, None, out, False, grid, [64, 64], 0, 8, 0, [1] * 14, [])
    assert "differs from the launch Python made" in refused and "tile 64x64)" in refused, refused
    assert (
        ext.remember_matmul(a, b_t, None, out, False, grid, tile, 0, 8, 0, [1, 1, 1], [])
        == "the compiled kernel takes 3 arguments, the plan passes 14"
    )
    assert "argument 4 of the plan does not match" in ext.remember_matmul(
        a, b_t, None, out, False, grid, tile, 0, 8, 0, [1] * 14, []
    )
    assert ext.remember_matmul(a.cpu(), b_t, None, out, False, grid, tile, 0, 8, 0, [1] * 14, []) == "unplanned"
    with pytest.raises(RuntimeError, match="C\\+\\+ launcher refused _persistent_matmul_kernel: the C\\+\\+ plan"):
        native_launch._check_kept(
            "_persistent_matmul_kernel", ext.remember_matmul(a, b_t, None, out, True, 1, tile, 0, 8, 0, [1] * 14, [])
        )


def test_switched_off_every_launch_goes_through_triton(seed, monkeypatch):
    """RL_KERNEL_NATIVE_LAUNCH=0 in a fresh process: no extension, the reason names the switch, results unchanged."""
    import subprocess
    import sys

    code = (
        "import torch; from rl_kernel_core.batch_invariant_mode import triton_launch as n, triton as b;"
        "a = torch.randn(3, 64, device='cuda', dtype=torch.bfloat16);"
        "b.matmul_forward(a, a, None); b.matmul_forward(a, a, None);"
        "print(n.extension() is None, n.unavailable_reason(), n.stats())"
    )
    env = {**__import__("os").environ, native_launch.SWITCH: "0"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"True {native_launch.SWITCH}=0 {{}}"
