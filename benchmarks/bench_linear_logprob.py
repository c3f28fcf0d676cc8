"""Benchmark ``linear_logprob`` and ``fused_linear_policy_loss`` (triton backend) against the public baselines.

Everything runs in one process on one GPU, on the same inputs (bf16 unless ``--dtype``):

* ``linear_logprob`` forward+backward (upstream gradient non-uniform, as an RL loss sends) and
  forward-only under ``torch.no_grad()``: ours; eager ``log_softmax((h @ W.T).float()).gather``;
  eager in row chunks under activation checkpointing; the peers below; the floor is one cuBLAS
  ``h @ W.T`` of the same run (``x_floor``: a row's median over the floor's; ours' rows add
  ``paired_x_floor``, the median ratio with the GEMM timed alternately, which clock drift over a
  long run does not move).
* ``fused_linear_policy_loss`` forward+backward (GRPO: token-mean, clip 0.2, no KL term) against
  Liger's ``LigerFusedLinearGRPOLoss``; the floor is the three cuBLAS products logits, dh, dW
  (``x_floor3``); ours' rows add ``paired_x_floor`` against one GEMM ``h @ W.T`` (issue 20's unit).
* accuracy: max |error| and ``||error|| / ||reference||`` of log-probs, dh and dW against an
  fp64 reference, measured on the first ``--acc-rows`` rows of the same inputs (fp64 ``[N, V]``
  logits at the full N would not fit), for ours and every baseline.
* memory: peak allocation during one call beyond the inputs and beyond the returned outputs
  (gradients), at N from 4096 to 131072.
* batch invariance: a row's log-prob computed inside batches of different N, for eager
  (cuBLAS) and ours; max |difference| (ours must be 0).
* ``--part tiles``: the gemm-route tile shapes, forward-only, to choose ``LinearTuning.gemm_tiles``.

Peers (each one's module imported once before anything is timed; one that cannot be imported
gives one ``error`` row per (peer, shape) with the exception text and ``unavailable``; a call that
fails at a shape gives an ``error`` row for it), as read in the released wheels' sources:

* ``liger_flce``: Liger-Kernel's Triton path, ``LigerFusedLinearCrossEntropyLoss(reduction="none")``
  (liger-kernel 0.8.5 ``liger_kernel/transformers/fused_linear_cross_entropy.py``: it passes
  ``ce_impl=None``, so ``liger_kernel/ops/fused_linear_cross_entropy.py`` runs its Triton
  ``liger_cross_entropy_kernel`` whether or not the CuTe DSL is installed).
* ``liger_cute``: Liger-Kernel's CuTe-DSL SM90 path (the ``cutedsl`` extra: nvidia-cutlass-dsl),
  ``LigerFusedScaledCrossEntropySM90Function.apply(h, W, t)`` of
  ``liger_kernel/ops/cutedsl/ops/fused_scaled_cross_entropy_sm90.py`` (0.8.5): per-token NLL
  ``[N]`` fp32, backward takes the per-token upstream gradient; bf16 and compute capability 9.0
  only (it raises otherwise). It is what ``LigerFusedLinearScaledCrossEntropyFunction`` of
  ``liger_kernel/ops/fused_linear_scaled_cross_entropy.py`` picks on a 9.0 device; called directly
  so that no other device gets that front end's eager fallback timed under this name.
* ``liger_cute_flce``: Liger-Kernel's CuTe-DSL SM90 fused linear cross-entropy,
  ``liger_fused_linear_cross_entropy_sm90(h, W, t, reduction="sum")`` of
  ``liger_kernel/ops/cutedsl/ops/fused_linear_cross_entropy_sm90.py`` (0.8.5): reduction
  ``mean``/``sum`` only (a scalar), N a multiple of 128 and V of 256 (it raises otherwise); its
  forward also computes dh ("gradient-in-forward"), so its forward row is not a forward-only cost.
* ``quack``: QuACK's linear cross-entropy, ``chunked_linear_cross_entropy(h, W, t,
  reduction="sum")`` of ``quack/linear_cross_entropy.py`` (quack-kernels 0.6.5): reduction
  ``mean``/``sum`` only (its ``reduction="none"`` path, ``linear_cross_entropy_func``, writes the
  whole ``[N, V]`` logits); it takes its scaled-exp pipeline by itself on SM90 with bf16 and V a
  multiple of 128 (``scaled_exp_lce_supported``); under ``no_grad`` it computes the loss only.
* ``cce`` / ``cce_exact``: Cut-Cross-Entropy ``linear_cross_entropy(..., reduction="none")``,
  with its gradient filter (``filter_eps="auto"``) and without it (``None``).

A peer with a scalar output is timed as that peer's cost (forward+backward of the summed loss,
upstream gradient 1, as its API allows); its rows say so in ``output`` and its accuracy rows are
skipped (no per-token log-probs to compare). TF/s (``tflops``) on every timed row counts
``2*N*D*V`` per ``N x D x V`` GEMM whatever a method actually runs: forward 1 (2NDV), forward+
backward 4 (8NDV: logits, logits again, dh, dW), the GRPO loss's floor 3; the JSON's
``settings.flops`` says so.

Timings are medians of ``--reps`` CUDA-event-timed calls after ``--warmup`` calls. Results are
appended to ``<out>/bench_linear_logprob.json`` after every measurement (a cut-off run keeps
what it measured), with the GPU, versions and the command line.

    python benchmarks/bench_linear_logprob.py --out benchmarks/results --part all
    python benchmarks/bench_linear_logprob.py --out OUT --part logprob --grid 896,1024 --inputs flat,peaked \
        --methods ours,eager,cce,liger_flce,liger_cute,liger_cute_flce,quack

``--grid`` times the shapes ``d<D>_v<V>_n<N>`` for D in the given list (default 896, 1024, 2048,
4096), V in 128256, 151936 and N in 4096, 16384 (issue 20); ``--shapes`` takes such names too.
``--inputs`` takes both regimes in one run: the logprob and accuracy parts run once per regime
(rows tagged ``inputs``), the other parts on the first regime.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import importlib.metadata
import json
import math
import os
import re
import sys
import time
import traceback
from typing import Callable

import torch

import rl_kernel_core as rk
from rl_kernel_core.tools import bench
from rl_kernel_core.linear import chunks as LC
from rl_kernel_core.linear import triton_tile

DEV = torch.device("cuda")
SHAPES = {  # name -> (N, D, V); "tiny" is a CPU smoke test of this script under TRITON_INTERPRET=1
    "llama8b": (16384, 4096, 128256),
    "qwen0.5b": (16384, 896, 151936),
    "d2048": (16384, 2048, 128256),
    "n1000": (1000, 4096, 128256),
    "tiny": (96, 32, 500),
}
GRID_D = (896, 1024, 2048, 4096)
GRID_V = (128256, 151936)
GRID_N = (4096, 16384)


def grid_shapes(ds: tuple[int, ...] = GRID_D) -> list[str]:
    """The ``--grid`` shape names ``d<D>_v<V>_n<N>``: each of ``ds`` x :data:`GRID_V` x :data:`GRID_N`."""
    return [f"d{d}_v{v}_n{n}" for d in ds for v in GRID_V for n in GRID_N]


def shape_of(name: str) -> tuple[int, int, int]:
    """``(N, D, V)`` of a :data:`SHAPES` name or of ``d<D>_v<V>_n<N>``; ``KeyError`` otherwise."""
    if name in SHAPES:
        return SHAPES[name]
    m = re.fullmatch(r"d(\d+)_v(\d+)_n(\d+)", name)
    if m is None:
        raise KeyError(name)
    d, v, n = (int(x) for x in m.groups())
    return n, d, v


class Recorder:
    """Collects result rows and rewrites the JSON after each one."""

    def __init__(self, path: str, args: argparse.Namespace) -> None:
        self.path = path
        self.doc = {
            "benchmark": "linear_logprob / fused_linear_policy_loss",
            "command": bench.command_line(),
            "environment": bench.environment(DEV),
            "tuning_defaults": _tuning_dict(),
            "peer_versions": peer_versions(),
            "settings": {
                "warmup": args.warmup,
                "reps": args.reps,
                "dtype": args.dtype,
                "acc_rows": args.acc_rows,
                "inputs": args.inputs.split(","),
                "flops": FLOPS,
            },
            "notes": [],
            "results": [],
        }

    def add(self, row: dict) -> None:
        self.doc["results"].append(row)
        self._flush()
        print(json.dumps(row), flush=True)

    def note(self, text: str) -> None:
        self.doc["notes"].append(text)
        self._flush()
        print("NOTE", text, flush=True)

    def _flush(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.doc, f, indent=1)


FLOPS = {
    "unit": "tflops = flops / median time; a GEMM of N x D x V counts 2*N*D*V, whatever a method actually runs",
    "floor, forward, tiles": "2*N*D*V (one GEMM)",
    "fwd+bwd, memory fwd+bwd, loss fwd+bwd": "8*N*D*V (four GEMMs: logits, logits again, dh, dW)",
    "loss_floor": "6*N*D*V (three GEMMs: logits, dh, dW)",
}


def _tuning_dict() -> dict:
    """The tuning in force, with the Triton backend's table values where it leaves a field None."""
    return {**dataclasses.asdict(LC.tuning()), **dataclasses.asdict(triton_tile.linear())}


def _free() -> None:
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    fn: Callable[[], object], args: argparse.Namespace, out_bytes: Callable[[object], int] = lambda r: 0
) -> dict:
    """Median ms, and peak GiB beyond what was allocated before (and beyond the outputs' bytes)."""
    _free()
    try:
        timing = bench.time_ms(fn, DEV, warmup=args.warmup, reps=args.reps)
        _free()
        if DEV.type != "cuda":
            return {"median_ms": round(timing["median_ms"], 3)}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        kept = out_bytes(result)
        del result
        return {
            "median_ms": round(timing["median_ms"], 3),
            "min_ms": round(timing["min_ms"], 3),
            "peak_extra_gib": round(peak / 2**30, 3),
            "peak_beyond_outputs_gib": round((peak - kept) / 2**30, 3),
        }
    except torch.cuda.OutOfMemoryError as exc:
        return {"error": f"OOM: {str(exc).splitlines()[0]}"}
    finally:
        _free()


def paired_ratio(fn: Callable[[], object], floor_fn: Callable[[], object], args: argparse.Namespace) -> dict:
    """``fn`` and ``floor_fn`` timed alternately (``--reps`` pairs after warm-up), so clock and
    power drift over the run hit both alike: median of each and median of the per-pair ratios."""
    for _ in range(max(1, args.warmup)):
        fn(), floor_fn()
    ours_ms, floor_ms = [], []
    for _ in range(args.reps):
        for f, acc in ((fn, ours_ms), (floor_fn, floor_ms)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            end.record()
            torch.cuda.synchronize()
            acc.append(start.elapsed_time(end))
    ratios = sorted(a / b for a, b in zip(ours_ms, floor_ms))
    return {
        "paired_ms": round(sorted(ours_ms)[len(ours_ms) // 2], 3),
        "paired_floor_ms": round(sorted(floor_ms)[len(floor_ms) // 2], 3),
        "paired_x_floor": round(ratios[len(ratios) // 2], 3),
    }


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


# ----------------------------------------------------------------------------- inputs


INPUTS = "flat"
"""Input regime (``--inputs``): ``flat``: Gaussian logits of std 3 (entropy about 7 nats, every
vocab block holds probabilities above 2.4e-4); ``peaked``: like a trained LM sampling its own
tokens: each row has one preferred token about 14 nats above Gaussian logits of std 1 (entropy
about 1 nat), 70% of targets are that token. Time of exact methods does not depend on it;
gradient-filtering methods (Cut-Cross-Entropy skips blocks whose |dz| < 2.4e-4) do."""


def make(n: int, d: int, v: int, dtype: torch.dtype, seed: int = 0):
    """Hidden/weight of an LM head in the :data:`INPUTS` regime, targets with 5% ignored, upstream grad."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = torch.randn(n, d, device=DEV, generator=g)
    weight = torch.randn(v, d, device=DEV, generator=g) * ((3.0 if INPUTS == "flat" else 1.0) / math.sqrt(d))
    targets = torch.randint(0, v, (n,), device=DEV, generator=g)
    if INPUTS == "peaked":
        preferred = torch.randint(0, v, (n,), device=DEV, generator=g)
        wp = weight[preferred]
        hidden += 14.0 * wp / (wp * wp).sum(1, keepdim=True)
        targets = torch.where(torch.rand(n, device=DEV, generator=g) < 0.7, preferred, targets)
        del wp
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    targets[torch.rand(n, device=DEV, generator=g) < 0.05] = -100
    g_lp = (torch.rand(n, device=DEV, generator=g) + 0.5) * torch.where(
        torch.rand(n, device=DEV, generator=g) < 0.5, -1.0, 1.0
    )
    return hidden, weight, targets, g_lp


# ----------------------------------------------------------------------------- methods: (h, W, t) -> logprob [N] fp32


def ours(h, w, t):
    return rk.linear_logprob(h, w, t, backend="triton")


def eager(h, w, t):
    logits = h @ w.T
    logp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    keep = t != -100
    return torch.where(keep, logp.gather(1, torch.where(keep, t, 0)[:, None])[:, 0], 0.0)


def eager_chunked_ckpt(h, w, t, rows: int = 2048):
    from torch.utils.checkpoint import checkpoint

    return torch.cat(
        [
            checkpoint(eager, h[i : i + rows], w, t[i : i + rows], use_reentrant=False)
            for i in range(0, h.shape[0], rows)
        ]
    )


def liger(h, w, t):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    return -LigerFusedLinearCrossEntropyLoss(reduction="none")(w, h, t)


def cce(h, w, t, filter_eps="auto"):
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, t, reduction="none", filter_eps=filter_eps)


def cce_exact(h, w, t):
    """CCE with its gradient filter off (every block of the backward computed)."""
    return cce(h, w, t, filter_eps=None)


def liger_cute(h, w, t):
    from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import LigerFusedScaledCrossEntropySM90Function

    return -LigerFusedScaledCrossEntropySM90Function.apply(h, w, t)


def liger_cute_flce(h, w, t):
    """Minus the summed loss (a scalar): the API has reduction ``mean``/``sum`` only."""
    from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import liger_fused_linear_cross_entropy_sm90

    return -liger_fused_linear_cross_entropy_sm90(h, w, t, reduction="sum")


QUACK_CHUNK = 4096
"""QuACK's default ``chunk_size``. Where it equals D its dh GEMM epilogue is ``[chunk, D]`` square
and quack-kernels 0.6.5 raises ``ValueError: operand 'v': m == n makes row/col inference
ambiguous``; there it runs with twice the chunk (:func:`quack`)."""


def quack(h, w, t):
    """Minus the summed loss (a scalar): the fused API has reduction ``mean``/``sum`` only."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    chunk = 2 * QUACK_CHUNK if h.shape[1] == QUACK_CHUNK else QUACK_CHUNK
    return -chunked_linear_cross_entropy(h, w, t, chunk_size=chunk, reduction="sum")


METHODS = {
    "ours": ours,
    "eager": eager,
    "eager_chunked_ckpt": eager_chunked_ckpt,
    "liger_flce": liger,
    "cce": cce,
    "cce_exact": cce_exact,
    "liger_cute": liger_cute,
    "liger_cute_flce": liger_cute_flce,
    "quack": quack,
}
PEER_MODULES = {  # method -> the module its call imports; probed once, before any timing
    "liger_flce": "liger_kernel.transformers.fused_linear_cross_entropy",
    "cce": "cut_cross_entropy",
    "cce_exact": "cut_cross_entropy",
    "liger_cute": "liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90",
    "liger_cute_flce": "liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90",
    "quack": "quack.linear_cross_entropy",
}
PEER_PACKAGES = (
    "liger-kernel",
    "cut-cross-entropy",
    "quack-kernels",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-cu13",
    "nvidia-cutlass-dsl-libs-cu12",
    "apache-tvm-ffi",
)
SCALAR_OUTPUT = {
    "liger_cute_flce": "minus the summed loss (reduction='sum'; the API has no per-token output); backward of that scalar",
    "quack": "minus the summed loss (reduction='sum'; the fused API has no per-token output); backward of that scalar; "
    "chunk_size 8192 where D = 4096 (its default 4096 raises there), else 4096",
}
FORWARD_NOTES = {"liger_cute_flce": "its forward also computes dh (gradient-in-forward): not a forward-only cost"}


@functools.cache
def import_error(method: str) -> str | None:
    """``"Type: message"`` of importing ``method``'s peer module, or ``None`` when it imports (or is ours/eager)."""
    if method not in PEER_MODULES:
        return None
    try:
        importlib.import_module(PEER_MODULES[method])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def peer_versions() -> dict[str, str]:
    """Installed version of each of :data:`PEER_PACKAGES`, or ``"not installed"``."""
    out = {}
    for name in PEER_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def tflops(ms: float | None, n: int, d: int, v: int, gemms: int) -> float | None:
    """TF/s of ``gemms`` GEMMs of ``N x D x V`` (``2*N*D*V`` flops each) done in ``ms``."""
    return round(2 * gemms * n * d * v / ms / 1e9, 1) if ms else None


def fwd_bwd(method, h, w, t, g_lp):
    """Log-prob ``[N]`` (a scalar for the peers of :data:`SCALAR_OUTPUT`) and ``(dh, dW)`` for the
    upstream gradient ``g_lp`` (for a scalar: 1)."""
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
    lp = method(hl, wl, t)
    dh, dw = torch.autograd.grad((lp.float() * g_lp).sum() if lp.ndim else lp, (hl, wl))
    return lp.detach(), dh, dw


def fwd_only(method, h, w, t):
    with torch.no_grad():
        return method(h, w, t)


# ----------------------------------------------------------------------------- parts


def part_floor(shape: str, n: int, d: int, v: int, dtype, args, rec: Recorder) -> float:
    h, w, _, _ = make(n, d, v, dtype)
    # at least 5 warm-up products: the floor is the first thing timed on a cold GPU
    res = measure(lambda: h @ w.T, argparse.Namespace(warmup=max(5, args.warmup), reps=args.reps))
    rec.add(
        {
            "part": "floor",
            "shape": shape,
            "N": n,
            "D": d,
            "V": v,
            "method": "cublas h@W.T",
            **res,
            "tflops": tflops(res.get("median_ms"), n, d, v, 1),
        }
    )
    return res["median_ms"]


def _with_tuning(**overrides) -> contextlib.ExitStack:
    """Enter :func:`rl_kernel_core.linear.chunks.tuned` with ``overrides``; ``.close()`` leaves it."""
    scope = contextlib.ExitStack()
    scope.enter_context(LC.tuned(**overrides))
    return scope


def part_logprob(shape, n, d, v, dtype, args, rec, floor_ms, methods, variants):
    h, w, t, g = make(n, d, v, dtype)
    where = {"shape": shape, "N": n, "D": d, "V": v, "inputs": INPUTS}
    for name in methods:
        for vname, over in variants if name == "ours" else [("", {})]:
            scope = _with_tuning(**over)
            label = name + (f"[{vname}]" if vname else "")
            notes = {"output": SCALAR_OUTPUT[name]} if name in SCALAR_OUTPUT else {}
            try:
                m = METHODS[name]
                res_f = measure(lambda: fwd_only(m, h, w, t), args, out_bytes=_nbytes)
                if DEV.type == "cuda":
                    res_f.update(paired_ratio(lambda: fwd_only(m, h, w, t), lambda: h @ w.T, args))
                route = LC.tuning().route_for(h) if name == "ours" else None
                fwd_notes = {"note": FORWARD_NOTES[name]} if name in FORWARD_NOTES else {}
                rec.add(
                    {
                        "part": "forward",
                        **where,
                        "method": label,
                        "route": route,
                        **res_f,
                        **notes,
                        **fwd_notes,
                        "tflops": tflops(res_f.get("median_ms"), n, d, v, 1),
                        "x_floor": round(res_f.get("median_ms", math.nan) / floor_ms, 3),
                    }
                )
                res_b = measure(lambda: fwd_bwd(m, h, w, t, g), args, out_bytes=lambda r: _nbytes(*r))
                if DEV.type == "cuda" and name == "ours":
                    res_b.update(paired_ratio(lambda: fwd_bwd(m, h, w, t, g), lambda: h @ w.T, args))
                rec.add(
                    {
                        "part": "fwd+bwd",
                        **where,
                        "method": label,
                        **res_b,
                        **notes,
                        "tflops": tflops(res_b.get("median_ms"), n, d, v, 4),
                        "x_floor": round(res_b.get("median_ms", math.nan) / floor_ms, 3),
                    }
                )
            except Exception as exc:
                rec.add({"part": "logprob", **where, "method": label, "error": f"{type(exc).__name__}: {exc}"})
                traceback.print_exc()
            finally:
                scope.close()


def _err(got: torch.Tensor, ref: torch.Tensor) -> dict:
    e = (got.double() - ref).abs()
    return {"max_abs": float(e.max()), "rel_norm": float(e.norm() / ref.norm().clamp_min(1e-300))}


def part_accuracy(shape, n, d, v, dtype, args, rec, methods, variants):
    """Errors against fp64 at ``acc_rows`` rows of the benchmark shape (same D, V)."""
    rows = min(n, args.acc_rows)
    h, w, t, g = make(rows, d, v, dtype, seed=1)
    hl, wl = h.double().requires_grad_(), w.double().requires_grad_()
    lp64 = eager(hl, wl, t)
    dh64, dw64 = torch.autograd.grad((lp64 * g.double()).sum(), (hl, wl))
    lp64 = lp64.detach()
    del hl, wl
    _free()
    where = {"shape": shape, "N": rows, "D": d, "V": v, "inputs": INPUTS}
    for name in methods:
        if name in SCALAR_OUTPUT:
            rec.add(
                {
                    "part": "accuracy",
                    **where,
                    "method": name,
                    "skipped": "scalar output: no per-token log-probs to compare",
                }
            )
            continue
        for vname, over in variants if name == "ours" else [("", {})]:
            scope = _with_tuning(**over)
            label = name + (f"[{vname}]" if vname else "")
            try:
                lp, dh, dw = fwd_bwd(METHODS[name], h, w, t, g)
                rec.add(
                    {
                        "part": "accuracy",
                        **where,
                        "method": label,
                        "logprob": _err(lp, lp64),
                        "dhidden": _err(dh, dh64),
                        "dweight": _err(dw, dw64),
                    }
                )
            except Exception as exc:
                rec.add({"part": "accuracy", **where, "method": label, "error": f"{type(exc).__name__}: {exc}"})
            finally:
                scope.close()
                _free()


def part_tiles(shape, n, d, v, dtype, args, rec, floor_ms):
    h, w, t, _ = make(n, d, v, dtype)
    T = LC.TileConfig
    configs = [
        T(128, 256, 64, 16, 8, 3),
        T(128, 256, 64, 16, 8, 3, tma=True),
        T(128, 256, 64, 16, 8, 3, persistent=True),
        T(128, 256, 64, 16, 8, 3, tma=True, persistent=True),
        T(128, 256, 64, 16, 8, 4, tma=True, persistent=True),
        T(128, 256, 64, 8, 8, 3, tma=True, persistent=True),
        T(256, 128, 64, 16, 8, 3, tma=True, persistent=True),
        T(128, 256, 64, 16, 8, 4, persistent=True),
        # narrower tiles: a shorter epilogue per tile, which weighs more at small D
        T(128, 128, 64, 16, 8, 4, tma=True, persistent=True),
        T(128, 128, 64, 16, 4, 4, tma=True, persistent=True),
        T(64, 256, 64, 16, 4, 4, tma=True, persistent=True),
        T(128, 128, 128, 16, 8, 3, tma=True, persistent=True),
    ]
    for cfg in configs:
        scope = _with_tuning(gemm_tiles=cfg, route="gemm")
        try:
            res = measure(lambda: fwd_only(ours, h, w, t), args)
            paired = paired_ratio(lambda: fwd_only(ours, h, w, t), lambda: h @ w.T, args) if DEV.type == "cuda" else {}
            rec.add(
                {
                    "part": "tiles",
                    "shape": shape,
                    "N": n,
                    "D": d,
                    "V": v,
                    "tiles": dataclasses.asdict(cfg),
                    **res,
                    "tflops": tflops(res.get("median_ms"), n, d, v, 1),
                    "x_floor": round(res.get("median_ms", math.nan) / floor_ms, 3),
                    **paired,
                }
            )
        except Exception as exc:
            rec.add(
                {
                    "part": "tiles",
                    "shape": shape,
                    "tiles": dataclasses.asdict(cfg),
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
        finally:
            scope.close()


def _loss_inputs(b: int, tl: int, d: int, v: int, dtype):
    h, w, t, _ = make(b * tl, d, v, dtype, seed=2)
    g = torch.Generator(device=DEV).manual_seed(3)
    old = -torch.rand(b, tl, device=DEV, generator=g) * 2.0 - 9.0  # around the log-probs of the random head
    adv = torch.randn(b, device=DEV, generator=g)
    mask = torch.rand(b, tl, device=DEV, generator=g) < 0.9
    return h.view(b, tl, d), w, t.clamp_min(0).view(b, tl), old, adv, mask


def ours_loss(h, w, t, old, adv, mask):
    return rk.fused_linear_policy_loss(
        h, w, t, old, adv[:, None].expand_as(old), mask, loss_agg_mode="token-mean", backend="triton"
    )[0]


def liger_grpo(h, w, t, old, adv, mask):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    out = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2)(
        h, w, t, mask.long(), adv, old_per_token_logps=old
    )
    return out[0] if isinstance(out, tuple) else out


def eager_loss(h, w, t, old, adv, mask):
    b, tl, d = h.shape
    lp = eager(h.reshape(-1, d), w, t.reshape(-1)).view(b, tl)
    return rk.policy_loss(lp, old, adv[:, None].expand_as(old), mask, loss_agg_mode="token-mean", backend="torch")[0]


LOSSES = {"ours": ours_loss, "liger_grpo": liger_grpo, "eager": eager_loss}


def loss_fwd_bwd(fn, h, w, *rest):
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(hl, wl, *rest)
    dh, dw = torch.autograd.grad(loss, (hl, wl))
    return loss.detach(), dh, dw


def part_loss(shape, b, tl, d, v, dtype, args, rec, methods, variants):
    h, w, t, old, adv, mask = _loss_inputs(b, tl, d, v, dtype)
    n = b * tl
    hh = h.reshape(n, d)
    dl = torch.randn(n, v, device=DEV).to(dtype)
    floor = measure(lambda: (hh @ w.T, dl @ w, dl.T @ hh), args)["median_ms"]
    del dl
    rec.add(
        {
            "part": "loss_floor",
            "shape": shape,
            "N": n,
            "D": d,
            "V": v,
            "method": "cublas logits+dh+dW",
            "median_ms": floor,
            "tflops": tflops(floor, n, d, v, 3),
        }
    )
    for name in methods:
        for vname, over in variants if name == "ours" else [("", {})]:
            scope = _with_tuning(**over)
            try:
                res = measure(
                    lambda: loss_fwd_bwd(LOSSES[name], h, w, t, old, adv, mask), args, out_bytes=lambda r: _nbytes(*r)
                )
                if DEV.type == "cuda" and name == "ours":  # the target's unit: one GEMM h @ W.T, timed alternately
                    res.update(
                        paired_ratio(
                            lambda: loss_fwd_bwd(LOSSES[name], h, w, t, old, adv, mask), lambda: hh @ w.T, args
                        )
                    )
                rec.add(
                    {
                        "part": "loss fwd+bwd",
                        "shape": shape,
                        "B": b,
                        "T": tl,
                        "N": n,
                        "D": d,
                        "V": v,
                        "method": name + (f"[{vname}]" if vname else ""),
                        "route": LC.tuning().route_for(hh) if name == "ours" else None,
                        **res,
                        "tflops": tflops(res.get("median_ms"), n, d, v, 4),
                        "x_floor3": round(res.get("median_ms", math.nan) / floor, 3),
                    }
                )
            except Exception as exc:
                rec.add(
                    {
                        "part": "loss fwd+bwd",
                        "shape": shape,
                        "method": name + vname,
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                )
                traceback.print_exc()
            finally:
                scope.close()


def part_loss_accuracy(d, v, dtype, args, rec, methods):
    b, tl = (4, 512) if DEV.type == "cuda" else (2, 16)
    h, w, t, old, adv, mask = _loss_inputs(b, tl, d, v, dtype)
    ref = loss_fwd_bwd(eager_loss, h.double(), w.double(), t, old.double(), adv.double(), mask)
    for name in methods:
        try:
            got = loss_fwd_bwd(LOSSES[name], h, w, t, old, adv, mask)
            rec.add(
                {
                    "part": "loss accuracy",
                    "B": b,
                    "T": tl,
                    "D": d,
                    "V": v,
                    "method": name,
                    "loss": _err(got[0].reshape(1), ref[0].reshape(1)),
                    "dhidden": _err(got[1], ref[1]),
                    "dweight": _err(got[2], ref[2]),
                }
            )
        except Exception as exc:
            rec.add({"part": "loss accuracy", "method": name, "error": f"{type(exc).__name__}: {exc}"})
        _free()


def part_memory(d, v, dtype, args, rec, sizes):
    for n in sizes:
        h, w, t, g = make(n, d, v, dtype)
        for name in ("ours", "eager"):
            res = measure(
                lambda: fwd_bwd(METHODS[name], h, w, t, g),
                argparse.Namespace(warmup=1, reps=2),
                out_bytes=lambda r: _nbytes(*r),
            )
            rec.add(
                {
                    "part": "memory fwd+bwd",
                    "N": n,
                    "D": d,
                    "V": v,
                    "method": name,
                    **res,
                    "tflops": tflops(res.get("median_ms"), n, d, v, 4),
                }
            )
        del h, w, t, g
        _free()


def part_invariance(d, v, dtype, args, rec):
    """A row's log-prob inside batches of N = 1, 7, 1000, 16384 (first rows shared)."""
    h, w, t, _ = make(16384, d, v, dtype, seed=4)
    for name in ("eager", "ours"):
        with torch.no_grad():
            full = METHODS[name](h, w, t)
            worst = 0.0
            for n in (1, 7, 1000):
                part = METHODS[name](h[:n], w, t[:n])
                worst = max(worst, float((part - full[:n]).abs().max()))
        rec.add(
            {
                "part": "batch invariance",
                "D": d,
                "V": v,
                "method": name,
                "Ns": [1, 7, 1000, 16384],
                "max_abs_diff": worst,
            }
        )
        _free()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--part", default="all", help="comma list: tiles,logprob,accuracy,loss,memory,invariance or all")
    p.add_argument(
        "--shapes",
        default=None,
        help="comma list of SHAPES names or d<D>_v<V>_n<N> (default llama8b,qwen0.5b,n1000,d2048)",
    )
    p.add_argument(
        "--grid",
        nargs="?",
        const=",".join(map(str, GRID_D)),
        default=None,
        metavar="D,...",
        help="the issue-20 grid at these D (default all of GRID_D) x GRID_V x GRID_N, instead of --shapes",
    )
    p.add_argument(
        "--methods", default="ours,eager,eager_chunked_ckpt,liger_flce,cce", help=f"comma list of {', '.join(METHODS)}"
    )
    p.add_argument(
        "--variants", default="", help="ours variants: name=field:value;field:value,... (LinearTuning overrides)"
    )
    p.add_argument("--memory-sizes", default="4096,16384,65536,131072")
    p.add_argument("--memory-dv", default="4096,128256", help="D,V of the memory part (default Llama-3-8B's LM head)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--acc-rows", type=int, default=2048)
    p.add_argument(
        "--device", default="cuda", help="cuda; or cpu with TRITON_INTERPRET=1 and --shapes tiny (smoke test)"
    )
    p.add_argument("--inputs", default="flat", help="comma list of input regimes, flat and/or peaked (see INPUTS)")
    args = p.parse_args(argv)
    global DEV, INPUTS
    regimes = [r for r in args.inputs.split(",") if r]
    if not regimes or any(r not in ("flat", "peaked") for r in regimes):
        p.error(f"--inputs: expected a comma list of flat, peaked; got {args.inputs!r}")
    methods = [m for m in args.methods.split(",") if m]
    if not methods or any(m not in METHODS for m in methods):
        p.error(f"--methods: expected a comma list of {', '.join(METHODS)}; got {args.methods!r}")
    if args.grid is not None and args.shapes is not None:
        p.error("--grid: give --grid or --shapes, not both")
    if args.grid is not None:
        try:
            shapes = grid_shapes(tuple(int(x) for x in args.grid.split(",")))
        except ValueError:
            p.error(f"--grid: expected a comma list of hidden sizes D, got {args.grid!r}")
    else:
        shapes = (args.shapes or "llama8b,qwen0.5b,n1000,d2048").split(",")
    for shape in shapes:
        try:
            shape_of(shape)
        except KeyError:
            p.error(f"--shapes: unknown shape {shape!r} (one of {', '.join(SHAPES)} or d<D>_v<V>_n<N>)")
    try:
        memory_dv = tuple(int(x) for x in args.memory_dv.split(","))
        if len(memory_dv) != 2:
            raise ValueError
    except ValueError:
        p.error(f"--memory-dv: expected D,V (two integers), got {args.memory_dv!r}")
    DEV = torch.device(args.device)
    INPUTS = regimes[0]
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    parts = set(args.part.split(",")) if args.part != "all" else {"logprob", "accuracy", "loss", "memory", "invariance"}
    variants = [("", {})] + [_parse_variant(s) for s in args.variants.split(",") if s]
    rec = Recorder(os.path.join(args.out, "bench_linear_logprob.json"), args)
    if DEV.type == "cuda":
        rec.note(
            f"torch.mm(out_dtype=fp32): {LC.fp32_logits_supported(DEV, torch.bfloat16)}; addmm(out_dtype=fp32, in place): {LC._dtype_mm_supported('addmm')}"
        )
    missing = {m: import_error(m) for m in methods if import_error(m) is not None}
    runnable = [m for m in methods if m not in missing]
    t0 = time.time()
    if "invariance" in parts and DEV.type == "cuda":
        for d in (896, 2048):
            part_invariance(d, 128256, dtype, args, rec)
    if "memory" in parts and DEV.type == "cuda":
        part_memory(*memory_dv, dtype, args, rec, [int(x) for x in args.memory_sizes.split(",")])
    for shape in shapes:
        n, d, v = shape_of(shape)
        if parts & {"logprob", "accuracy"}:
            for name, error in missing.items():
                rec.add(
                    {
                        "part": "logprob",
                        "shape": shape,
                        "N": n,
                        "D": d,
                        "V": v,
                        "inputs": regimes,
                        "method": name,
                        "unavailable": True,
                        "error": error,
                    }
                )
        INPUTS = regimes[0]
        floor = part_floor(shape, n, d, v, dtype, args, rec)
        if "tiles" in parts:
            part_tiles(shape, n, d, v, dtype, args, rec, floor)
        for regime in regimes:
            INPUTS = regime
            if "logprob" in parts:
                part_logprob(shape, n, d, v, dtype, args, rec, floor, runnable, variants)
            if "accuracy" in parts:
                part_accuracy(shape, n, d, v, dtype, args, rec, runnable, variants)
        INPUTS = regimes[0]
        if "loss" in parts and n in (16384, 96):
            # Liger's GRPO loss compiles per shape (torch.compile): measured on the first shape only
            loss_methods = ["ours"] + (["liger_grpo"] if "liger_flce" in runnable and shape == shapes[0] else [])
            part_loss(shape, 32, n // 32, d, v, dtype, args, rec, loss_methods, variants)
            part_loss_accuracy(d, v, dtype, args, rec, loss_methods)
        print(f"-- {shape} done at {time.time() - t0:.0f}s", flush=True)
    _table(rec.doc["results"])
    return 0


def _parse_variant(spec: str) -> tuple[str, dict]:
    name, _, body = spec.partition("=")
    over = {}
    convert = {"int": int, "bool": lambda s: s.lower() in ("1", "true"), "str": str}
    for item in body.split(";"):
        key, _, val = item.partition(":")
        if "." in key:  # one field of a tile shape, e.g. gemm_tiles.tma:true
            tiles, sub = key.split(".", 1)
            base = over.get(tiles, getattr(triton_tile.linear(), tiles))
            sub_type = {f.name: f.type for f in dataclasses.fields(LC.TileConfig)}[sub]
            over[tiles] = dataclasses.replace(base, **{sub: convert[sub_type](val)})
            continue
        field_type = {f.name: f.type for f in dataclasses.fields(LC.LinearTuning)}[key]
        over[key] = convert[field_type.removeprefix("Optional[").removesuffix("]")](val)
    return name, over


def _table(rows: list) -> None:
    print(
        f"{'part':16} {'shape':20} {'inputs':7} {'method':28} {'ms':>9} {'TF/s':>6} {'x_floor':>8} {'GiB+':>7} {'GiB+out':>8}"
    )
    for r in rows:
        inputs = r.get("inputs", "")
        inputs = ",".join(inputs) if isinstance(inputs, list) else inputs
        head = (
            f"{r['part']:16} {str(r.get('shape', '')):20} {inputs:7.7} {str(r.get('method', r.get('tiles', ''))):28.28}"
        )
        if "median_ms" in r:
            print(
                f"{head} {r['median_ms']:9.2f} {str(r.get('tflops', '')):>6} {r.get('x_floor', r.get('x_floor3', '')):>8} "
                f"{r.get('peak_extra_gib', ''):>7} {r.get('peak_beyond_outputs_gib', ''):>8}"
            )
        elif "error" in r:
            print(f"{head} ERROR {r['error'][:80]}")


if __name__ == "__main__":
    sys.exit(main())
