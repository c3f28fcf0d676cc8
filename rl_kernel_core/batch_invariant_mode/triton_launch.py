"""C++ launches of the batch-invariant kernels' compiled Triton code (the ``triton_launch`` extension,
``native/csrc/bind_triton_launch.cpp``).

Under the batch-invariant mode each routed ``mm``/``addmm``/``mean`` launches one of
:mod:`rl_kernel_core.batch_invariant_mode.triton`'s kernels, and each attention call ``varlen_attention``'s
forward (:mod:`rl_kernel_core.batch_invariant_mode.triton_attention`); through Triton's ``JITFunction.run`` that
launch's host time was most of the mode's eager overhead, and a decode step is host-bound
(``benchmarks/results/mode_host_h200/``). The extension plans the same launch in C++ (kernel, tile, program count, tensor
descriptors), computes the specialization Triton would compute, and launches the cubin Triton
compiled for it with ``cuLaunchKernel``. A specialization it has not seen returns ``None``: the
caller launches through Triton (which compiles it if needed) and hands the compiled kernel to
:func:`remember_matmul` / :func:`remember_row_stats` / :func:`remember_attention_forward`, which check that the C++ plan is the launch
Python made (a mismatch raises) and keep the kernel for the next call. Same cubin, grid and
arguments: the bits are Triton's launch's bits (``tests/core/batch_invariant_mode/test_native_launch.py``).

Switch: ``RL_KERNEL_NATIVE_LAUNCH`` (default on; a malformed value raises ``SwitchError``). Off,
or where the extension cannot be built or used (a ``RuntimeWarning`` once, with the reason that
:func:`unavailable_reason` returns), every launch goes through Triton.
Launches made here do not call Triton's ``launch_enter_hook``/``launch_exit_hook`` (a Triton
profiler sees only the first launch of each specialization); turn the switch off to profile them.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import torch

from rl_kernel_core import native_build
from rl_kernel_core.switches import env_flag

SWITCH = "RL_KERNEL_NATIVE_LAUNCH"

_lock = threading.Lock()
_loaded = False
_ext: Any = None
_serving: Any = None  # _ext while launches are served here (set_enabled)
_reason: Optional[str] = None
_configured: set[tuple[int, torch.dtype]] = set()
_checked_kernels: set[str] = set()

# the argument kinds of the extension (``Kind`` in bind_triton_launch.cpp)
_CONSTANT, _POINTER, _INT32, _INT64, _FLOAT32, _TENSOR_DESC = range(6)
_SCALAR_KINDS = {"i32": _INT32, "i64": _INT64, "u64": _INT64, "fp32": _FLOAT32, "constexpr": _CONSTANT}


def _load() -> Any:
    global _loaded, _ext, _serving, _reason
    with _lock:
        if _loaded:
            return _ext
        if not env_flag(SWITCH, True):  # a malformed value raises SwitchError naming the variable
            _reason = f"{SWITCH}=0"
        else:
            try:
                _reason = native_build.unavailable_reason()
                if _reason is None:
                    _ext = native_build.build(native_build.LAUNCH_GROUP)
            except Exception as exc:  # a build error: Triton's own launcher serves, and the reason is said once
                _reason = f"{type(exc).__name__}: {exc}"
            if _reason is not None:
                warnings.warn(
                    f"rl-kernel: the batch-invariant kernels launch through Triton, slower on the host "
                    f"({SWITCH}=0 silences this): {_reason}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _serving = _ext
        _loaded = True
        return _ext


def extension() -> Any:
    """The loaded extension, or None where it is switched off or cannot be built (:func:`unavailable_reason`)."""
    return _ext if _loaded else _load()


def unavailable_reason() -> Optional[str]:
    """Why launches go through Triton here (the switch, the build), or None when the extension serves them."""
    extension()
    return _reason


def status() -> str:
    """One line for ``rl-kernel info`` on whether launches go from C++ here, building nothing."""
    try:
        on = env_flag(SWITCH, True)
    except ValueError as exc:  # a diagnostic reports a malformed switch and goes on
        return f"invalid: {exc}"
    if not on:
        return f"off ({SWITCH}=0): Triton launches every kernel"
    reason = native_build.unavailable_reason()
    if reason is not None:
        return f"unavailable: {reason}; Triton launches every kernel (the same bits, more host time)"
    if native_build.is_built(native_build.LAUNCH_GROUP):
        return "built: a specialization's launches go from C++ from its second launch on"
    return (
        f"not built yet: the first batch-invariant or attention launch compiles it, or "
        f"'python -m rl_kernel_core.native build {native_build.LAUNCH_GROUP}' ahead of time"
    )


def stats() -> dict[str, int]:
    """``{"kernels", "hits", "misses"}``: kernels remembered, launches served, launches not served
    (a specialization seen for the first time). Loads (builds) the extension if needed; empty where
    it is switched off or cannot be built."""
    ext = extension()
    return dict(ext.stats()) if ext is not None else {}


def set_enabled(enabled: bool) -> bool:
    """Serve launches here (True, where the extension is loaded) or leave them all to Triton
    (False, e.g. to compare the two launchers in one process); returns the previous setting."""
    global _serving
    previous = _serving is not None
    _serving = extension() if enabled else None
    return previous


def matmul(a: torch.Tensor, b_t: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``a [M, K] @ b_t.T (+ bias)`` as ``batch_invariant.matmul_forward`` computes it, from a
    remembered kernel; None where none serves this call (the caller launches through Triton)."""
    ext = _serving if _loaded else _load()
    return None if ext is None else ext.matmul(a, b_t, bias)


def row_stats(x: torch.Tensor, out: torch.Tensor, mode: int, eps: float) -> Optional[torch.Tensor]:
    """The row-statistics pass of ``batch_invariant._row_pass`` into ``out``, from a remembered
    kernel; None where none serves this call."""
    ext = _serving if _loaded else _load()
    return None if ext is None else ext.row_stats(x, out, mode, eps)


def attention_forward(
    tensors: list[torch.Tensor], scale: float, block: tuple[int, int], causal: bool
) -> Optional[torch.Tensor]:
    """``varlen_attention``'s forward launch (``attention._forward``) from a remembered kernel:
    ``tensors`` are q, k, v, out, lse and the four int32 tables, ``block`` its ``(BLOCK_M, BLOCK_N)``;
    returns out, or None where none serves this call."""
    ext = _serving if _loaded else _load()
    return None if ext is None else ext.attention_forward(tensors, scale, block[0], block[1], causal)


def configure_matmul(
    device: torch.device,
    dtype: torch.dtype,
    pointer_tile: tuple[int, int],
    tma_tile: tuple[int, int],
    tma_narrow_tile: tuple[int, int],
    tma_capable: bool,
    tma_min_rows: int,
    tma_min_weight_grad_k: int,
    program_slots: int,
) -> None:
    """Give the extension ``matmul_forward``'s tiles (``(BLOCK_M, BLOCK_N)``: the pointer kernel's, the
    TMA kernel's and its narrow weight-gradient tile) and kernel rule for ``(device, dtype)`` (once each)."""
    ext = extension()
    if ext is None or (device.index, dtype) in _configured:
        return
    ext.configure_matmul(
        torch.empty(0, dtype=dtype, device=device),
        list(pointer_tile),
        list(tma_tile),
        list(tma_narrow_tile),
        tma_capable,
        tma_min_rows,
        tma_min_weight_grad_k,
        program_slots,
    )
    _configured.add((device.index, dtype))


def _launch_record(
    kernel_name: str, jit_params: list, compiled
) -> Optional[tuple[int, int, int, list[int], list[list[int]]]]:
    """``(function, num_warps, shared, kinds, layouts)`` of a compiled kernel for the extension, or
    None where its launch needs what the extension does not do (clusters, scratch, PDL, descriptors
    not lowered to TMA). Checks once per kernel that the extension passes the kernel's runtime
    arguments in its order."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    names = _ext.argument_names()[kernel_name]
    if kernel_name not in _checked_kernels:
        runtime = [p.name for p in jit_params if not p.is_constexpr]
        if runtime != names:
            raise RuntimeError(
                f"native/csrc/bind_triton_launch.cpp passes {kernel_name}'s arguments as {names}, "
                f"the kernel takes {runtime}: update the C++ plan with the kernel"
            )
        _checked_kernels.add(kernel_name)
    md = compiled.metadata
    if (
        getattr(md, "num_ctas", 1) != 1
        or md.launch_pdl
        or md.launch_cooperative_grid
        or md.global_scratch_size
        or md.profile_scratch_size
    ):
        return None
    signature = compiled.src.signature
    kinds = []
    for name in names:
        ty = signature[name]
        if ty.startswith("*"):
            kinds.append(_POINTER)
        elif ty.startswith("tensordesc"):
            kinds.append(_TENSOR_DESC)
        elif ty in _SCALAR_KINDS:
            kinds.append(_SCALAR_KINDS[ty])
        else:
            return None
    metas = list(getattr(md, "tensordesc_meta", None) or [])
    if kinds.count(_TENSOR_DESC) != len(metas) or any(m is None or m.get("fp4_padded") for m in metas):
        return None
    layouts = [
        [m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]], *m["block_size"]] for m in metas
    ]
    return compiled.function, md.num_warps, md.shared, kinds, layouts


def remember_matmul(
    kernel,
    compiled,
    a: torch.Tensor,
    b_t: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    tma: bool,
    grid: int,
    block: tuple[int, int],
) -> None:
    """Keep ``compiled`` (what ``kernel[(grid,)](...)`` returned for this call, with tile
    ``block = (BLOCK_M, BLOCK_N)``) for its specialization."""
    if _serving is None or compiled is None:
        return
    record = _launch_record(kernel.__name__, kernel.flavour(False).params, compiled)
    if record is not None:
        _check_kept(kernel.__name__, _ext.remember_matmul(a, b_t, bias, out, tma, grid, list(block), *record))


def remember_row_stats(kernel, compiled, x: torch.Tensor, out: torch.Tensor, mode: int, eps: float) -> None:
    """Keep the row-statistics kernel Python launched for this call's specialization."""
    if _serving is None or compiled is None:
        return
    record = _launch_record(kernel.__name__, kernel.flavour(False).params, compiled)
    if record is not None:
        function, num_warps, shared, kinds, _ = record
        _check_kept(kernel.__name__, _ext.remember_row_stats(x, out, mode, eps, function, num_warps, shared, kinds))


def remember_attention_forward(
    kernel,
    compiled,
    tensors: list[torch.Tensor],
    scale: float,
    block: tuple[int, int],
    causal: bool,
    grid: tuple[int, int],
) -> None:
    """Keep the attention forward kernel Python launched on ``grid`` for this call's specialization."""
    if _serving is None or compiled is None:
        return
    record = _launch_record(kernel.__name__, kernel.flavour(False).params, compiled)
    if record is not None:
        function, num_warps, shared, kinds, _ = record
        _check_kept(
            kernel.__name__,
            _ext.remember_attention_forward(
                tensors, scale, block[0], block[1], causal, grid[0], grid[1], function, num_warps, shared, kinds
            ),
        )


def _check_kept(kernel_name: str, outcome: str) -> None:
    """Raise where the extension refused a kernel for a reason other than having no plan for the call."""
    if outcome not in ("kept", "unplanned"):
        raise RuntimeError(f"rl-kernel's C++ launcher refused {kernel_name}: {outcome}")
