"""bi_matmul: the Triton persistent matmul's edge inputs, ``auto``'s pick on CUDA inside the mode,
and the tile it takes per device.

Its accuracy and row invariance are checked together with bi_linear's (``test_bi_linear.py``).
Cases run on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test) and on CUDA
(``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode.api import bi_linear, bi_matmul, bi_mean

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


def test_empty_and_fp64_inputs(device):
    b = torch.randn(8, 5, device=device)
    assert bi_matmul(torch.randn(0, 8, device=device), b, backend="triton").shape == (0, 5)
    assert torch.isnan(bi_mean(torch.randn(3, 0, device=device), -1, backend="triton")).all()
    with pytest.raises(rk.BackendUnavailableError, match="fp64"):
        bi_matmul(torch.randn(2, 8, device=device, dtype=torch.float64), b.double(), backend="triton")


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda_inside_the_mode(seed, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RL_KERNEL_BACKEND", raising=False)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    with rk.batch_invariant():
        torch.nn.functional.linear(x, w)
    assert dispatch.explain("bi_matmul").backend == "triton"


@pytest.mark.gpu
def test_output_past_two_to_the_31_elements(seed, monkeypatch):
    """The LM head's logits in the mode (16384 x 151936 = 2.5e9 elements): the last rows land
    where they should (int32 offsets wrapped there and wrote out of bounds: an illegal memory
    access in verl's actor under the mode on the H200), bitwise equal to the same rows alone."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m, n, k = 16384, 151936, 64
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    assert m * n > 2**31
    out = bi_matmul(a, b, backend="triton")
    tail = bi_matmul(a[-3:], b, backend="triton")
    assert torch.equal(out[-3:], tail)
    assert torch.equal(out[:2], bi_matmul(a[:2], b, backend="triton"))


def test_matmul_tile_fits_the_devices_shared_memory(monkeypatch):
    """The 16-bit tile's pipeline needs 192 KiB of shared memory per block: an H100 (227 KiB) takes
    it, an A100 (163 KiB) the compact tile; fp32 keeps its one tile. Decided per dtype and device."""
    from rl_kernel_core.batch_invariant_mode import triton as tbi
    from rl_kernel_core.triton import tuning

    device = torch.device("cuda", 0)
    try:
        for smem, expected in ((232448, tuning.MATMUL_TILES), (166912, tuning.COMPACT_MATMUL_TILES)):
            monkeypatch.setattr(tbi, "shared_memory_per_block", lambda _device, smem=smem: smem)
            tbi.matmul_tile.cache_clear()
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                assert tbi.matmul_tile(dtype, device) == expected[dtype]
    finally:
        tbi.matmul_tile.cache_clear()  # the real device's answer next time
    assert tuning.MATMUL_TILES[torch.bfloat16] != tuning.COMPACT_MATMUL_TILES[torch.bfloat16]
    for dtype, tma_tile in tuning.TMA_MATMUL_TILES.items():  # the same blocks and k steps as the pointer kernel's
        assert tma_tile[:3] == tuning.MATMUL_TILES[dtype][:3]


def _odd_layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x`` with the same values as row-major, column-major and a view whose base is one element
    past a 16-byte boundary (a layout the TMA kernel must copy first)."""
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
    shifted.copy_(x)
    return {"row_major": x.contiguous(), "column_major": x.t().contiguous().t(), "unaligned": shifted}


@pytest.mark.parametrize("shape", [(37, 29, 45), (40, 64, 72), (300, 1000, 520)])
def test_the_operands_layout_does_not_change_a_bit(seed, triton_device, shape):
    """The same values give the same bits whatever the operands' strides and alignment: the trainer
    multiplies by ``W.T`` views and gradients by transposed activations, the rollout by
    contiguous weights. K=29 pads rows to 16 bytes; (40, 64, 72) reads column-major operands
    through transposed descriptors; (300, 1000, 520), compiled only, spans several tiles and k
    steps, and its column-major ``a`` (300-element columns) is copied first."""
    n, k, m = shape
    if triton_device.type == "cpu" and n * k * m > 10**6:
        pytest.skip("several tiles: compiled only (the interpreter takes minutes)")
    a = torch.randn(n, k, device=triton_device).to(torch.bfloat16)
    b = torch.randn(k, m, device=triton_device).to(torch.bfloat16)
    expected = bi_matmul(a, b, backend="triton")
    for a_name, a_view in _odd_layouts(a).items():
        for b_name, b_view in _odd_layouts(b).items():
            got = bi_matmul(a_view, b_view, backend="triton")
            assert torch.equal(got, expected), f"a {a_name}, b {b_name}: {(got.float() - expected.float()).abs().max()}"


def test_a_weight_gradient_takes_the_tile_that_fills_the_sms():
    """``tma_tile``: a weight gradient (column-major ``a``) whose 128x256 tiles leave SMs idle takes
    the narrow tile; where both fill their waves alike the wide one stays; every other product keeps
    the wide tile whatever its shape (132 program slots: an H100/H200)."""
    from rl_kernel_core.triton import tuning
    from rl_kernel_core.batch_invariant_mode.triton import tma_tile

    wide, narrow = tuning.TMA_MATMUL_TILES[torch.bfloat16], tuning.TMA_WEIGHT_GRAD_NARROW_TILES[torch.bfloat16]
    assert narrow[2] == wide[2]  # the same k steps: the same bits
    # Qwen3-0.6B's q_proj (64 wide tiles, 128 narrow), k_proj (32, 64), then gate_proj and down_proj
    assert tma_tile(torch.bfloat16, 2048, 1024, True, 132) == narrow
    assert tma_tile(torch.bfloat16, 1024, 1024, True, 132) == narrow
    assert tma_tile(torch.bfloat16, 3072, 1024, True, 132) == wide  # 96 of 132 and 192 of 264 slots
    assert tma_tile(torch.bfloat16, 1024, 3072, True, 132) == wide
    assert tma_tile(torch.bfloat16, 4096, 4096, True, 132) == wide  # 512 and 1024 tiles: a tie
    assert tma_tile(torch.bfloat16, 2048, 1024, False, 132) == wide


@pytest.mark.parametrize("layout", ["fwd", "dx", "dw"])
def test_the_tma_and_pointer_kernels_give_the_same_bits(seed, triton_device, layout):
    """The row count picks the kernel (``TMA_MIN_ROWS``; for a weight gradient the summed rows,
    ``TMA_MIN_WEIGHT_GRAD_K``), so both must give every element the same bits, in each layout of a
    training step (``fwd`` ``x @ W.T``, ``dx`` ``g @ W``, ``dw`` ``g.T @ x``); and a batch that
    crosses the threshold gives its rows the bits they get alone. Compiled: Qwen3-1.7B's MLP
    widths, several tiles and k steps."""
    from rl_kernel_core.triton import tuning
    from rl_kernel_core.batch_invariant_mode.triton import matmul_forward, uses_tma

    cuda = triton_device.type == "cuda"
    if cuda and not uses_tma(torch.bfloat16, triton_device, tuning.TMA_MIN_ROWS):
        pytest.skip("the TMA kernel needs Hopper or later")
    rows, k, n = (tuning.TMA_MIN_ROWS + 37, 2048, 6144) if cuda else (tuning.TMA_MIN_ROWS_INTERPRETED + 5, 40, 48)
    x = torch.randn(rows, k, device=triton_device).to(torch.bfloat16)
    g = torch.randn(rows, n, device=triton_device).to(torch.bfloat16)
    w = (torch.randn(n, k, device=triton_device) * k**-0.5).to(torch.bfloat16)
    a, b_t = {"fwd": (x, w), "dx": (g, w.t()), "dw": (g.t(), x.t())}[layout]
    tma, pointer = matmul_forward(a, b_t, None, tma=True), matmul_forward(a, b_t, None, tma=False)
    assert torch.equal(tma, pointer), f"{layout}: max |tma - pointer| {(tma.float() - pointer.float()).abs().max()}"
    if layout == "dw":  # dw's rows are W's, its reduction the batch: not a batch-invariant product
        if cuda:  # a layer with fewer output tiles takes the narrow tile: the same k steps, the same bits
            narrow = matmul_forward(a, b_t, None, tile=tuning.TMA_WEIGHT_GRAD_NARROW_TILES[torch.bfloat16], tma=True)
            assert torch.equal(narrow, tma), f"max |narrow - wide| {(narrow.float() - tma.float()).abs().max()}"
        k_min = tuning.TMA_MIN_WEIGHT_GRAD_K if cuda else tuning.TMA_MIN_ROWS_INTERPRETED
        assert uses_tma(torch.bfloat16, triton_device, 5, k=k_min, a_column_major=True)
        assert not uses_tma(torch.bfloat16, triton_device, 5, k=k_min - 1, a_column_major=True)
        assert not uses_tma(torch.bfloat16, triton_device, 5, k=k_min, a_column_major=False)
        assert torch.equal(matmul_forward(a, b_t, None), tma)
    else:
        assert uses_tma(torch.bfloat16, triton_device, a.shape[0]) and not uses_tma(torch.bfloat16, triton_device, 5)
        full = matmul_forward(a, b_t, None)
        assert torch.equal(full[:5], matmul_forward(a[:5], b_t, None))
        assert torch.equal(full[-5:], matmul_forward(a[-5:], b_t, None))


def test_the_cpu_reference_computes_every_row_alike(seed):
    """The torch backend's products give a row the same bits at every place in a call, over drawn
    shapes where the CPU library's GEMM would round rows by their place in the tile (narrow and odd
    M, odd K) and both layouts of the right operand; ``bi_linear`` likewise."""
    import random

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for draw in range(24):
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.float16])
        k = rng.choice([rng.randint(1, 40), rng.randint(41, 600)])
        m = rng.choice([rng.randint(1, 40), rng.randint(41, 3000)])
        n = rng.randint(2, 80)
        a = torch.randn(n, k, generator=gen).to(dtype)
        weight = torch.randn(m, k, generator=gen).to(dtype)
        b = weight.t() if rng.random() < 0.5 else weight.t().contiguous()
        perm = torch.randperm(n, generator=gen)
        for name, op in (
            ("bi_matmul", lambda x: bi_matmul(x, b, backend="torch")),
            ("bi_linear", lambda x: bi_linear(x, weight, backend="torch")),
        ):
            whole = op(a)
            shuffled = op(a[perm])
            i = rng.randrange(n)
            single = op(a[i : i + 1])
            context = f"seed {seed}, draw {draw}: {name} {dtype} N={n} K={k} M={m}, b contiguous={b.is_contiguous()}"
            assert torch.equal(shuffled, whole[perm]), context
            assert torch.equal(single[0], whole[i]), context
