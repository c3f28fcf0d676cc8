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
from rl_kernel_core.invariance import bi_matmul, bi_mean

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
    from rl_kernel_core.triton import batch_invariant as tbi
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
