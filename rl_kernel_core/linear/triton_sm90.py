"""When the Triton ``linear_logprob`` passes run as CUDA kernels for Hopper.

``native/csrc/linear_sm90.cu`` holds the gemm route's statistics pass (:mod:`.triton_stats`) and
gradient pass (:mod:`.triton_grad`) as one warp-specialized persistent kernel (TMA loads by one
producer thread, wgmma by two consumer warpgroups, the epilogue of one tile while the next tile's
operands load). It issues the wgmma instructions Triton issues for the default tiles and repeats
the epilogues' arithmetic in the order of Triton's compiled code, so its outputs have the Triton
passes' bits: which one runs changes the time, never a result (asserted bit for bit by
``tests/core/linear/test_linear_sm90.py``). :func:`serves` decides per launch, from
``LinearTuning.sm90``, the device, the operands and the tile.
"""

from __future__ import annotations

import threading
import warnings
from types import ModuleType
from typing import Optional

import torch

from rl_kernel_core.linear.triton_tile import linear, tiles
from rl_kernel_core.triton._jit import interpreting
from rl_kernel_core.triton.tuning import LINEAR_SM90_TILE

KERNELS = "linear_passes"
"""The name under which the statistics and gradient passes record their route
(:func:`rl_kernel_core.dispatch.ran`): ``"triton+sm90"`` where a pass ran the Hopper kernel, else
``"triton"``; a gradient pass over stored logits (always Triton) records none."""

_LOCK = threading.Lock()
_state: dict[str, Optional[ModuleType]] = {}


def extension() -> Optional[ModuleType]:
    """The native ``linear_logprob`` extension when it holds the ``sm_90a`` code, else None.

    The first call builds it (or loads the cached build); when it cannot be used it warns once with
    the reason, so the slower Triton passes (the same bits) never run in its place silently.
    """
    with _LOCK:
        if "ext" not in _state:
            from rl_kernel_core.native import extension as build

            ext: Optional[ModuleType] = None
            try:
                built = build("linear_logprob")
                reason = (
                    None
                    if built.linear_sm90_built()
                    else "the native linear_logprob extension was built without sm_90a (TORCH_CUDA_ARCH_LIST)"
                )
                ext = built if reason is None else None
            except ImportError as exc:
                reason = str(exc)
            if reason is not None:
                warnings.warn(
                    f"rl-kernel: linear_logprob's Hopper kernels are unavailable ({reason}); the Triton passes run instead "
                    "(the same bits, slower). rl_kernel_core.linear.chunks.tuned(sm90='off') chooses them without this warning.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            _state["ext"] = ext
        return _state["ext"]


def status() -> str:
    """One line for ``rl-kernel info`` on whether the Hopper passes can run here, building nothing."""
    from rl_kernel_core import native_build

    mode = linear().sm90
    if mode == "off":
        return "off (LinearTuning.sm90='off'): the Triton passes run"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "not used: they need a compute capability 9.0 GPU (the Triton passes run, with the same bits)"
    reason = native_build.unavailable_reason()
    if reason is not None:
        return f"unavailable: {reason}; the Triton passes run (the same bits, slower)"
    if native_build.is_built("linear_logprob"):
        return (
            f"the linear_logprob extension is built (whether with sm_90a code shows at the first linear_logprob "
            f"call); used by the gemm route's passes where LinearTuning.sm90={mode!r} allows"
        )
    return (
        "not built yet: the first linear_logprob call compiles them (about a minute), or "
        "'python -m rl_kernel_core.native build linear_logprob' ahead of time"
    )


def _tma_operand(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def serves(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[ModuleType]:
    """The extension whose kernel runs this gemm-route pass, or None for the Triton pass.

    ``kind``: ``"stats"`` or ``"grad"``; ``x``: the pass's ``hidden`` rows. Needs
    ``LinearTuning.sm90`` to allow it (``"auto"`` and ``"all"`` take every pass:
    :data:`~rl_kernel_core.triton.tuning.LINEAR_SM90`), a
    compute capability 9.0 device (compiled, not interpreted), bf16 or fp16 TMA-compatible operands
    (unit inner stride, 16-byte aligned rows and address), a bias of the same dtype, and the default
    tile of the pass (another tile has another partition or thread layout, so only the Triton pass
    gives its bits: :data:`~rl_kernel_core.triton.tuning.LINEAR_SM90_TILE`).
    """
    mode = linear().sm90
    if mode == "off" or x.device.type != "cuda" or interpreting():
        return None
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return None
    cfg = tiles(weight.dtype, weight.device, False, grad=kind == "grad")
    if (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps) != LINEAR_SM90_TILE:
        return None
    if (
        weight.dtype not in (torch.bfloat16, torch.float16)
        or x.dtype != weight.dtype
        or not (_tma_operand(x) and _tma_operand(weight))
    ):
        return None
    if bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()):
        return None
    return extension()
