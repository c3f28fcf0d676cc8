"""Benchmark the consistency chain's forward with batch-invariant mode on vs off at Qwen3-0.6B shapes.

The model is :class:`rl_kernel_core.tools.consistency.model.TinyDecoder` with Qwen3-0.6B's layer shapes
(D=1024, 16 query / 8 KV heads, head_dim 128, F=3072, V=151936) and ``--layers`` layers (default 4
of the real model's 28: every layer has the same shape, so the per-layer cost ratio is what a
few layers measure; the LM head and log-prob are included once, as in the real model). One timed
call is the training-style forward: embedding, the layers over the packed sequences, final norm, LM
head and the selected log-probs (``chain.packed_logprobs``), under ``torch.no_grad``.

* mode off: PyTorch's defaults: cuBLAS GEMMs, ``scaled_dot_product_attention`` (one call over the
  batch: all sequences have the same length), PyTorch's mean and log-softmax;
* mode on: :func:`rl_kernel_core.batch_invariant`: the persistent Triton matmul, the Triton row
  reductions and the Triton ``varlen_attention``.

Batch sizes 1..256 with ``--seq`` tokens per sequence (512), capped at ``--max-tokens`` tokens per
forward (8192: 16 x 512; larger batches use shorter sequences, recorded per row). Each timing is the
median of ``--reps`` calls after ``--warmup`` (``rl_kernel_core.tools.bench``); the JSON names the GPU,
versions, shapes, dtype and command line. Target: mode on <= 1.15x mode off.

``--graph-batches`` (CUDA only) also times each mode's forward captured as a CUDA graph and
replayed: the device's work alone, as an engine that captures its forward (vLLM's decode) runs it.
Both timings are reported; the launched one includes the host's work, which the mode adds to (a
Python call and a Triton launch per routed op).

``--profile-batches`` (CUDA only) profiles one forward per mode at those batch sizes: the sum of
its kernels' device time next to the wall-clock median (their gap is host time: launches and Python),
and the kernels grouped by name, most time first, which says where the mode's extra time goes.
On CUDA it also times the host side of one routed product (``routed_matmul_host``): microseconds
per ``x @ w.T`` as issued with the mode off and on, and the Triton launch alone.

The invariance check runs the same probe sequences (``--check-len`` tokens) alone and inside
batches of ``--check-sizes`` and compares their log-probs bit for bit: mode on must be bitwise
equal at every size; mode off's largest difference is reported (the control group).

    python benchmarks/bench_consistency.py --out benchmarks/results

Runs on CUDA (``--device cpu`` with ``--layers 1 --batches 1,2 --seq 16`` is a smoke test of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_random_model import PRESETS  # noqa: E402

from rl_kernel_core import dispatch  # noqa: E402
from rl_kernel_core.tools import bench  # noqa: E402
from rl_kernel_core.batch_invariant_mode.api import batch_invariant  # noqa: E402
from rl_kernel_core.tools.consistency import chain  # noqa: E402
from rl_kernel_core.tools.consistency.model import HF_NAMES, TinyConfig, TinyDecoder  # noqa: E402

# Qwen3-0.6B's shapes in TinyConfig's names, all but its layer count (``--layers``)
QWEN3_06B = {ours: PRESETS["qwen3-0.6b"][hf] for ours, hf in HF_NAMES.items() if ours != "num_layers"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _sequences(count: int, length: int, vocab: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).to(device) for _ in range(count)]


def _batch(
    model: TinyDecoder, args: argparse.Namespace, device: torch.device, batch: int
) -> tuple[int, list[torch.Tensor]]:
    """``(tokens per sequence, the batch's sequences)``: ``--seq`` tokens, fewer where
    ``--max-tokens`` caps the forward."""
    seq = min(args.seq, args.max_tokens // batch)
    return seq, _sequences(batch, seq, model.config.vocab_size, args.seed, device)


def forwards(model: TinyDecoder, args: argparse.Namespace, device: torch.device, batch: int) -> tuple[int, dict]:
    """``(tokens per sequence, {"off"|"on": the timed training-style forward of batch sequences})``."""
    seq, seqs = _batch(model, args, device, batch)

    def forward(mode: str):
        with batch_invariant(mode == "on"), torch.no_grad():
            return chain.packed_logprobs(model, seqs)

    return seq, {mode: (lambda mode=mode: forward(mode)) for mode in ("off", "on")}


def _add_row(rows: list[dict], row: dict, label: str = "") -> None:
    """Sets ``row``'s ``on_over_off`` (ratio of the median times), appends it to ``rows`` and prints
    its table line, ``label`` first."""
    row["on_over_off"] = row["on"]["median_ms"] / row["off"]["median_ms"]
    rows.append(row)
    print(
        f"{label}{row['batch']:>6}{row['seq']:>6}{row['tokens']:>8}{row['off']['median_ms']:>12.2f}"
        f"{row['on']['median_ms']:>12.2f}{row['on_over_off']:>9.3f}",
        flush=True,
    )


def timing_rows(model: TinyDecoder, args: argparse.Namespace, device: torch.device) -> list[dict]:
    rows = []
    for batch in _ints(args.batches):
        seq, calls = forwards(model, args, device, batch)
        row = {"batch": batch, "seq": seq, "tokens": batch * seq}
        for mode, forward in calls.items():
            row[mode] = {
                **bench.time_ms(forward, device, warmup=args.warmup, reps=args.reps),
                "peak_extra_gib": bench.peak_extra_gib(forward, device),
            }
        _add_row(rows, row)
    return rows


def _captured_forward(
    model: TinyDecoder, inputs: tuple, mode: str
) -> tuple["torch.cuda.CUDAGraph", torch.Tensor, bool]:
    """The training-style forward of ``inputs`` (``chain.packed_inputs``) captured as a CUDA graph
    with the mode ``mode``, after two warm-up calls on a side stream (Triton compiles, and
    ``varlen_attention`` copies this layout's tables to the device, outside the capture). Returns
    the graph, its output tensor and whether one replay gives the eager call's bits."""
    ids, positions, targets, cu = inputs
    forward = lambda: chain.selected_logprobs(model.lm_head(model(ids, positions, cu)), targets)  # noqa: E731
    graph = torch.cuda.CUDAGraph()
    with batch_invariant(mode == "on"), torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                eager = forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = forward()
    graph.replay()
    return graph, out, torch.equal(out, eager)


def graph_rows(model: TinyDecoder, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The same forwards replayed as CUDA graphs: device work only, no Python or launch cost (what
    an engine that captures its forward, as vLLM does for decoding, pays)."""
    rows = []
    for batch in _ints(args.graph_batches):
        seq, seqs = _batch(model, args, device, batch)
        inputs = chain.packed_inputs(seqs)
        row = {"batch": batch, "seq": seq, "tokens": batch * seq}
        for mode in ("off", "on"):
            graph, out, same_bits = _captured_forward(model, inputs, mode)
            row[mode] = {
                **bench.time_ms(graph.replay, device, warmup=args.warmup, reps=args.reps),
                "replay_equals_eager": same_bits,
            }
            del graph, out
            torch.cuda.empty_cache()
        _add_row(rows, row, "graph ")
    return rows


def profile_rows(model: TinyDecoder, args: argparse.Namespace, device: torch.device, timed: list[dict]) -> list[dict]:
    wall = {r["batch"]: r for r in timed}
    rows = []
    for batch in _ints(args.profile_batches):
        seq, calls = forwards(model, args, device, batch)
        row = {"batch": batch, "seq": seq}
        for mode, forward in calls.items():
            device_ms, kernels = bench.kernel_table(forward, args.warmup)
            row[mode] = {
                "device_ms": device_ms,
                "wall_median_ms": wall.get(batch, {}).get(mode, {}).get("median_ms"),
                "kernels": kernels[: args.profile_top],
            }
            print(f"-- profile batch {batch} mode {mode}: {device_ms:.2f} ms device")
            for k in kernels[: args.profile_top]:
                print(f"   {k['ms']:9.3f} ms {k['launches']:5d}x  {k['kernel'][:90]}")
        rows.append(row)
    return rows


def routed_matmul_host_us(args: argparse.Namespace, device: torch.device) -> dict:
    """Host microseconds per call of one ``[512, D] @ [D, D]`` product: as the model issues it with
    the mode off (cuBLAS) and on (the route, all of it), and the route's Triton launch alone."""
    from rl_kernel_core.batch_invariant_mode.triton import matmul_forward

    d = QWEN3_06B["hidden_size"]
    a = torch.randn(512, d, device=device, dtype=DTYPES[args.dtype])
    w = torch.randn(d, d, device=device, dtype=DTYPES[args.dtype])
    calls = 200

    def per_call(fn) -> float:
        for _ in range(10):
            fn()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize(device)
        return host

    with torch.no_grad():
        out = {"mode_off": per_call(lambda: a @ w.T)}
        with batch_invariant():
            out["mode_on_routed"] = per_call(lambda: a @ w.T)
        out["triton_launch_alone"] = per_call(lambda: matmul_forward(a, w, None))
    return {"shape": [512, d, d], "calls": calls, "host_us_per_call": out}


def invariance(model: TinyDecoder, args: argparse.Namespace, device: torch.device) -> dict:
    probes = _sequences(2, args.check_len, model.config.vocab_size, args.seed + 1, device)
    filler = _sequences(max(_ints(args.check_sizes)), args.check_len, model.config.vocab_size, args.seed + 2, device)
    out = {}
    for mode in ("off", "on"):
        with batch_invariant(mode == "on"), torch.no_grad():
            alone = chain.packed_logprobs(model, probes)
            worst, equal = 0.0, True
            for size in _ints(args.check_sizes):
                if size < len(probes):
                    continue
                got = chain.packed_logprobs(
                    model, filler[: size // 2] + probes + filler[size // 2 : size - len(probes)]
                )
                got = got[size // 2 : size // 2 + len(probes)]
                equal = equal and all(torch.equal(a, b) for a, b in zip(alone, got))
                worst = max(worst, chain.max_abs_diff(alone, got))
        out[mode] = {"bitwise_equal_at_every_size": equal, "max_abs_logprob_diff": worst}
    out["sizes"] = _ints(args.check_sizes)
    out["seq"] = args.check_len
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--check-sizes", default="2,3,8,17,64,256")
    p.add_argument("--check-len", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    bench.add_timing_options(p, reps=10)
    p.add_argument(
        "--graph-batches",
        default="1,2,4,8,16,32,64,128,256",
        help="batch sizes also timed as CUDA graphs (CUDA only; '' for none)",
    )
    p.add_argument(
        "--profile-batches", default="1,16,256", help="batch sizes profiled per kernel (CUDA only; '' for none)"
    )
    p.add_argument("--profile-top", type=int, default=12, help="kernels kept per profiled forward")
    p.add_argument("--out", default=None, help="directory for bench_consistency.json")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = TinyConfig(num_layers=args.layers, **QWEN3_06B)
    torch.manual_seed(args.seed)
    model = TinyDecoder(config).to(device=device, dtype=DTYPES[args.dtype]).eval()
    print(f"consistency chain forward, Qwen3-0.6B shapes, {args.layers} layers, {args.dtype} on {device}")
    print(f"{'batch':>6}{'seq':>6}{'tokens':>8}{'off ms':>12}{'on ms':>12}{'on/off':>9}")
    rows = timing_rows(model, args, device)
    graphs = graph_rows(model, args, device) if device.type == "cuda" else []
    profile = profile_rows(model, args, device, rows) if device.type == "cuda" else []
    host = routed_matmul_host_us(args, device) if device.type == "cuda" else None
    if host:
        print("host us per matmul call: " + ", ".join(f"{k} {v:.1f}" for k, v in host["host_us_per_call"].items()))
    check = invariance(model, args, device)
    backends = {op: d.backend for op, d in dispatch.explain().items()}
    print(
        f"invariance (seq {args.check_len}, sizes {args.check_sizes}): "
        f"on bitwise={check['on']['bitwise_equal_at_every_size']}, off max |diff|={check['off']['max_abs_logprob_diff']:.3g}"
    )
    worst = max(r["on_over_off"] for r in rows)
    worst_graph = max((r["on_over_off"] for r in graphs), default=None)
    print(
        f"largest on/off ratio: {worst:.3f} launched from Python, "
        f"{'n/a' if worst_graph is None else f'{worst_graph:.3f}'} as CUDA graphs (target <= 1.15); backends in the mode: {backends}"
    )
    result = {
        "benchmark": "consistency chain forward, batch-invariant mode on vs off",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "model": {
            "layers": args.layers,
            "of_real_model_layers": PRESETS["qwen3-0.6b"]["num_hidden_layers"],
            **QWEN3_06B,
        },
        "dtype": args.dtype,
        "baseline": "mode off: cuBLAS, SDPA, PyTorch reductions",
        "timing": {"warmup": args.warmup, "reps": args.reps, "statistic": "median"},
        "rows": rows,
        "graph_rows": graphs,
        "profile": profile,
        "routed_matmul_host": host,
        "largest_on_over_off": worst,
        "largest_on_over_off_graph": worst_graph,
        "target_on_over_off": 1.15,
        "invariance": check,
        "backends": backends,
    }
    if args.out:
        bench.write_json(args.out, "bench_consistency.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
