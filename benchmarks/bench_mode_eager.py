"""Batch-invariant mode on vs off in eager code: transformers' Qwen3 ``generate`` and a training step.

One process, one random-weight ``Qwen3ForCausalLM`` (``make_random_model.PRESETS``, default
``qwen3-0.6b``, bf16), the same inputs for both modes:

* ``generate``: ``--gen-batch`` prompts of ``--prompt-len`` random tokens, ``--new-tokens`` greedy
  tokens with the KV cache (``min_new_tokens`` = ``max_new_tokens``: every call decodes the same
  number of steps), launched from Python as a user's eager loop does;
* ``train``: one forward+backward of the causal-LM loss over ``--train-batch`` x ``--train-len``
  tokens (8192 by default), with gradients for every parameter.

Mode on: :func:`rl_kernel_core.batch_invariant` around the call, and the model's attention set to
:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention` (``varlen_attention`` while the mode is on,
transformers' ``sdpa`` while it is off), so the off rows are transformers as shipped. Each row is
the median of ``--reps`` calls after ``--warmup`` (``rl_kernel_core.tools.bench.time_ms``; the first
calls compile the Triton kernels); the JSON names the GPU, versions, shapes and command line.
``--profile`` adds each case's CUDA kernels by device time (``bench.kernel_table``) and
``--cprofile`` its Python functions by own time, for both modes: where the on/off gap is.
``--compare-launcher`` adds the mode with the kernels launched through Triton rather than the C++
launcher (:mod:`rl_kernel_core.batch_invariant_mode.triton_launch`), same process.
Targets (issue 20): ``generate`` on/off <= 1.3, ``train`` on/off <= 1.15.

    python benchmarks/bench_mode_eager.py --out OUT
    TRITON_INTERPRET=1 python benchmarks/bench_mode_eager.py --preset tiny --device cpu --reps 1 --warmup 0  # smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_random_model import PRESETS  # noqa: E402

import rl_kernel_core as rk  # noqa: E402
from rl_kernel_core.tools import bench  # noqa: E402
from rl_kernel_core.batch_invariant_mode import triton_launch as native_launch  # noqa: E402
from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention  # noqa: E402

TARGETS = {"generate": 1.3, "train": 1.15}


def build_model(preset: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A ``Qwen3ForCausalLM`` with ``preset``'s config and seeded random weights, mode attention set."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**PRESETS[preset], bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype)
    use_mode_attention(model)
    return model


def host_profile(fn, device: torch.device, top: int = 30) -> str:
    """The ``top`` functions of one ``fn()`` call by own time, then by time inside them (cProfile;
    file names without folders)."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="directory for bench_mode_eager.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument(
        "--profile",
        action="store_true",
        help="add each case's CUDA kernels by device time, both modes (torch.profiler, one call)",
    )
    p.add_argument("--cases", default="generate,train", help="the cases --profile and --cprofile cover")
    p.add_argument(
        "--compare-launcher",
        action="store_true",
        help="also time the mode with the C++ launcher off (rl_kernel_core.batch_invariant_mode.triton_launch.set_enabled)",
    )
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="add each case's Python functions by own time, both modes (cProfile, one call)",
    )
    bench.add_timing_options(p, reps=5, warmup=2)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device or "cuda"), getattr(torch, args.dtype)
    model = build_model(args.preset, device, dtype, args.seed)
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    prompts = torch.randint(3, vocab, (args.gen_batch, args.prompt_len), generator=g).to(device)
    train_ids = torch.randint(3, vocab, (args.train_batch, args.train_len), generator=g).to(device)

    def generate():
        with torch.no_grad():
            return model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=False,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=2,
            )

    def train():
        model.zero_grad(set_to_none=True)
        model(train_ids, labels=train_ids).loss.backward()

    rows = []
    modes = ("off", "on", "on_triton_launch") if args.compare_launcher else ("off", "on")
    for case, fn in (("generate", generate), ("train", train)):
        timed = {}
        for mode in modes:
            native_launch.set_enabled(mode != "on_triton_launch")
            with rk.batch_invariant(mode != "off"):
                timed[mode] = bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)
            native_launch.set_enabled(True)
        ratio = timed["on"]["median_ms"] / timed["off"]["median_ms"]
        row = {
            "case": case,
            "off": timed["off"],
            "on": timed["on"],
            "on_over_off": round(ratio, 3),
            "target": TARGETS[case],
        }
        if args.compare_launcher:
            row["on_triton_launch"] = timed["on_triton_launch"]
            row["on_triton_launch_over_off"] = round(
                timed["on_triton_launch"]["median_ms"] / timed["off"]["median_ms"], 3
            )
            print(
                f"  on with Triton's launcher: {timed['on_triton_launch']['median_ms']:.2f} ms, "
                f"{row['on_triton_launch_over_off']:.3f}x off",
                flush=True,
            )
        if args.profile and case in args.cases.split(","):
            row["profile"] = {}
            for mode in ("off", "on"):
                with rk.batch_invariant(mode == "on"):
                    device_ms, kernels = bench.kernel_table(fn, warmup=0)
                row["profile"][mode] = {"device_ms": device_ms, "kernels": kernels[:12]}
                print(
                    f"  profile {mode}: {device_ms:.1f} ms device of {timed[mode]['median_ms']:.1f} ms wall; top: "
                    + "; ".join(f"{k['ms']:.1f} ms {k['launches']}x {k['kernel'][:60]}" for k in kernels[:4]),
                    flush=True,
                )
        if args.cprofile and case in args.cases.split(","):
            row["cprofile"] = {}
            for mode in ("off", "on"):
                with rk.batch_invariant(mode == "on"):
                    row["cprofile"][mode] = host_profile(fn, device)
                print(f"  cProfile {mode}:\n{row['cprofile'][mode]}", flush=True)
        rows.append(row)
        print(
            f"{case:9} off {timed['off']['median_ms']:9.2f} ms  on {timed['on']['median_ms']:9.2f} ms  on/off {ratio:6.3f}  (target <= {TARGETS[case]})",
            flush=True,
        )
    result = {
        "benchmark": "batch-invariant mode on vs off in eager code (transformers Qwen3)",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "shapes": {
            "preset": args.preset,
            "config": PRESETS[args.preset],
            "dtype": args.dtype,
            "generate": {"batch": args.gen_batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
            "train": {"batch": args.train_batch, "seq_len": args.train_len},
        },
        "settings": {"warmup": args.warmup, "reps": args.reps},
        "rows": rows,
        "native_launch": {"unavailable_reason": native_launch.unavailable_reason(), **native_launch.stats()},
    }
    if args.out:
        print("wrote", bench.write_json(args.out, "bench_mode_eager.json", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
