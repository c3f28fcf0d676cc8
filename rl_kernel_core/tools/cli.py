"""The ``rl-kernel`` command: ``info``, ``bench``, ``compare`` and ``consistency``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any, Optional, Sequence

import torch

from rl_kernel_core import dispatch, ops
from rl_kernel_core.tools import bench, report
from rl_kernel_core.argtypes import device_name, integer, json_object, number  # noqa: F401  (the parser's types; also importable from here)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_GIB = 2**30


_positive_int, _non_negative_int = integer(1), integer(0)


def _fail(command: str, message: str) -> int:
    print(f"rl-kernel {command}: error: {message}", file=sys.stderr)
    return 2


def _info(args: argparse.Namespace) -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    env = bench.environment(device)
    import rl_kernel_core

    env["rl_kernel"] = rl_kernel_core.__version__
    env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    backends = dispatch.backend_report()
    if backends["triton"] == "available" and device.type != "cuda":
        backends["triton"] = (
            "imports, but runs only on CUDA tensors (or under TRITON_INTERPRET=1 when named explicitly)"
        )
    env["backends"] = backends
    env["routes"] = dict(ops.ROUTES)
    try:
        from rl_kernel_core.linear import triton_sm90
        from rl_kernel_core.batch_invariant_mode import triton_launch as native_launch

        env["linear_logprob_hopper_passes"] = triton_sm90.status()
        env["triton_cpp_launch"] = native_launch.status()
    except ImportError as exc:  # both serve the Triton backend's launches
        env["linear_logprob_hopper_passes"] = f"not used: the Triton backend does not import ({exc})"
        env["triton_cpp_launch"] = env["linear_logprob_hopper_passes"]
    try:
        env["default_backend"] = dispatch.default_backend()
    except ValueError as exc:  # a diagnostic command reports a bad variable and goes on
        env["default_backend"] = f"invalid: {exc}"
        print(f"rl-kernel info: warning: {exc}", file=sys.stderr)
    if args.json:
        print(json.dumps(env, indent=2))
        return 0
    width = max(len(k) for k in env)
    for key, value in env.items():
        if key in ("backends", "routes"):
            print(f"{key}:")
            for name, text in value.items():
                print(f"  {name:<{width - 2}} {text}")
        else:
            print(f"{key:<{width}} {value}")
    return 0


def bench_bytes(n: int, d: int, v: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes ``rl-kernel bench`` allocates at most for ``N=n, D=d, V=v`` in ``dtype``.

    ``inputs``: hidden ``[N, D]`` and weight ``[V, D]`` with their gradients, targets and the
    upstream gradient. ``eager``: the eager baseline's ``[N, V]`` tensors alive at once (the
    logits, their fp32 copy when ``dtype`` is not fp32, the fp32 log-softmax and its gradient).
    rl-kernel's own path needs less than the baseline (it never builds ``[N, V]``).
    """
    size = torch.tensor([], dtype=dtype).element_size()
    inputs = 2 * (n * d + v * d) * size + n * 8 + n * 4
    per_logit = size + (0 if dtype == torch.float32 else 4) + 4 + 4
    return {"inputs": inputs, "eager": n * v * per_logit, "total": inputs + n * v * per_logit}


def _check_out(path: str) -> Optional[str]:
    """Why ``--out`` cannot be written (checked before any timing), or None."""
    if os.path.isdir(path):
        return f"--out must be a file path, got {path!r}, which is a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"--out must be a writable file path, got {path!r}: {exc.strerror or exc}"
    if not existed:
        os.remove(path)
    return None


def _bench(args: argparse.Namespace) -> int:
    from rl_kernel_core.linear.api import linear_logprob

    if args.out:
        problem = _check_out(args.out)
        if problem:
            return _fail("bench", problem)
    if args.backend == "auto":
        try:
            dispatch.default_backend()
        except ValueError as exc:
            return _fail("bench", str(exc))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype]
    n, d, v = args.tokens, args.hidden, args.vocab
    need = bench_bytes(n, d, v, dtype)
    free = bench.free_memory_bytes(device)
    if need["total"] > free:
        return _fail(
            "bench",
            f"N={n} D={d} V={v} {args.dtype} needs about {need['total'] / _GIB:.2f} GiB on {device} "
            f"(inputs and gradients {need['inputs'] / _GIB:.2f} GiB, the eager baseline's [N, V] tensors "
            f"{need['eager'] / _GIB:.2f} GiB) and {free / _GIB:.2f} GiB is free; lower --tokens or --vocab",
        )
    hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device=device, dtype=dtype) / d**0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=device)
    upstream = torch.rand(n, device=device)

    def ours_fwd_bwd():
        lp = linear_logprob(hidden, weight, targets, backend=args.backend)
        torch.autograd.grad(lp, (hidden, weight), upstream)

    def eager_fwd_bwd():
        logits = hidden @ weight.T
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
        torch.autograd.grad(lp, (hidden, weight), upstream)

    rows: list[dict[str, Any]] = []
    for name, fn in (("rl_kernel", ours_fwd_bwd), ("eager", eager_fwd_bwd)):
        timing = bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)
        rows.append({"impl": name, **timing, "peak_extra_gib": bench.peak_extra_gib(fn, device)})
    decision = dispatch.explain("linear_logprob")
    result = {
        "op": "linear_logprob forward+backward",
        "command": bench.command_line(),
        "shape": {"N": n, "D": d, "V": v},
        "dtype": args.dtype,
        "backend": decision.backend,
        "route": decision.route,
        "environment": bench.environment(device),
        "results": rows,
        "ratio_to_eager": rows[0]["median_ms"] / rows[1]["median_ms"],
    }
    print(
        f"linear_logprob fwd+bwd N={n} D={d} V={v} {args.dtype} on {device} "
        f"(backend {result['backend']}, route {result['route']})"
    )
    print(f"{'impl':<12}{'median ms':>12}{'peak extra GiB':>16}")
    for row in rows:
        mem = "n/a" if row["peak_extra_gib"] is None else f"{row['peak_extra_gib']:.3f}"
        print(f"{row['impl']:<12}{row['median_ms']:>12.3f}{mem:>16}")
    print(f"ratio rl_kernel/eager: {result['ratio_to_eager']:.3f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def _compare(args: argparse.Namespace) -> int:
    try:
        off, on = report.read_step_log(args.off), report.read_step_log(args.on)
        report.check_comparable(off, on)
        if args.out:
            path = report.write_report(args.off, args.on, args.out, warmup_steps=args.warmup_steps)
    except report.StepLogError as exc:
        return _fail("compare", str(exc))
    except OSError as exc:
        return _fail("compare", f"--out {args.out!r} cannot be written: {exc.strerror or exc}")
    for warning in report.step_warnings(off, on):
        print(f"rl-kernel compare: warning: {warning}", file=sys.stderr)
    rows = report.compare_table(off, on, args.warmup_steps)
    notes = []
    for log, side in ((off, "OFF"), (on, "ON")):
        if log.oom:
            notes.append(f"{side}: out of memory at step {log.oom[0]}: {log.oom[1]}")
        if log.skipped_partial:
            notes.append(
                f"{side}: skipped {log.skipped_partial} unterminated last line of {log.path} (interrupted run)"
            )
    notes += [f"timing noise: {warning}" for warning in report.timing_noise(rows)]
    if args.json:
        for note in notes:
            print(f"rl-kernel compare: {note}", file=sys.stderr)
        print(json.dumps(report.json_safe(rows), indent=2, allow_nan=False))
        return 0
    print(f"OFF: {off.path} ({off.steps} steps)   ON: {on.path} ({on.steps} steps)")
    for note in notes:
        print(note)
    print(report.text_table(rows))
    if args.out:
        print(f"report: {path}")
    return 0


def _parity_only(args: argparse.Namespace) -> int:
    """``--parity ROLLOUT TRAINING``: two saved text batches (``consistency.parity``) or two saved
    multimodal batches (``multimodal.storage``), compared; the kind is read from each file. A file
    that is not such a batch (not a regular file, unreadable, a wrong or missing field, a sparse,
    quantized or expanded tensor) exits 2 with one line naming the file and field; 1 is a mismatch."""
    from rl_kernel_core.tools.consistency import parity
    from rl_kernel_core.tools.multimodal import parity as layout, storage
    from rl_kernel_core.tools.multimodal.schema import MultimodalBatch

    batches: list[Any] = []
    for path in args.parity:
        try:
            try:
                batches.append(storage.load(path))
            except storage.NotMultimodal:
                batches.append(parity.load(path))
        except ValueError as exc:
            return _fail("consistency", f"--parity {exc}")
        except OSError as exc:
            return _fail("consistency", f"--parity {path}: cannot be read: {exc.strerror or exc}")
    rollout, training = batches
    if type(rollout) is not type(training):
        kinds = ["a multimodal" if isinstance(b, MultimodalBatch) else "a text" for b in batches]
        return _fail(
            "consistency", f"--parity {args.parity[0]} holds {kinds[0]} batch but {args.parity[1]} holds {kinds[1]} one"
        )
    try:  # both loaders validate; a side malformed in a way they let through is still bad input, not a mismatch
        if isinstance(rollout, MultimodalBatch):
            lines = layout.compare(rollout, training)
            result = "ok" if not lines else lines[0]
        else:
            mismatch = parity.check(rollout, training)
            result = "ok" if mismatch is None else str(mismatch)
    except (ValueError, TypeError) as exc:
        return _fail(
            "consistency",
            f"--parity {' '.join(args.parity)}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}",
        )
    print(json.dumps({"parity": result}) if args.json else f"input parity: {result}")
    return 0 if result == "ok" else 1


def _engine_consistency(args: argparse.Namespace) -> int:
    """``--engine vllm``: vLLM's rollout vs the trainer's forward of a checkpoint, mode off and on."""
    import tempfile

    from rl_kernel_core.tools.consistency import engine_pair as engine

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None:
        print("rl-kernel consistency: error: --engine vllm needs vLLM and transformers installed", file=sys.stderr)
        return 2
    if args.model == "tiny":
        print(
            "rl-kernel consistency: error: --engine vllm needs --model PATH (a checkpoint directory)", file=sys.stderr
        )
        return 2
    extra = [
        "--prompts",
        str(args.sequences),
        "--prompt-len",
        str(args.prompt_len),
        "--max-tokens",
        str(args.max_len),
        "--seed",
        str(args.seed),
        "--dtype",
        {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype],
        "--engine",
        json.dumps(args.engine_args),
    ] + (["--device", args.device] if args.device else [])
    try:
        with tempfile.TemporaryDirectory() as workdir:
            pair = engine.off_and_on(args.model, extra, workdir)
        if args.plot:
            engine.plot(pair, args.plot)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"rl-kernel consistency: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(pair, indent=2) if args.json else engine.text(pair))
    return 0 if pair["passed"] else 1


def _consistency(args: argparse.Namespace) -> int:
    from rl_kernel_core.tools.consistency import run

    if args.parity:
        return _parity_only(args)
    if args.engine == "vllm":
        return _engine_consistency(args)

    settings = run.Settings(
        model=args.model,
        sequences=args.sequences,
        min_len=args.min_len,
        max_len=args.max_len,
        prompt_len=args.prompt_len,
        rollout_batch=args.rollout_batch,
        seed=args.seed,
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        dtype=args.dtype,
        probe=args.probe or bool(args.plot),
    )
    try:
        if args.plot:  # fail before the run, not after it, when matplotlib is missing
            run.plot_available()
        report = run.run(settings)
        if args.plot:
            run.plot(report, args.plot)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"rl-kernel consistency: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, allow_nan=True) if args.json else run.text(report))
    if args.plot and not args.json:
        print(f"plot: {args.plot}")
    return 0 if report["passed"] else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rl-kernel``."""
    parser = argparse.ArgumentParser(
        prog="rl-kernel", description="rl-kernel operators: environment, benchmarks, step-log comparison"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, devices and which backends are available (and why not)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_info)

    p = sub.add_parser("bench", help="time linear_logprob forward+backward against eager PyTorch")
    p.add_argument("--tokens", "-N", type=_positive_int, default=2048, help="tokens N, rows of hidden (default 2048)")
    p.add_argument("--hidden", "-D", type=_positive_int, default=256, help="hidden size D (default 256)")
    p.add_argument(
        "--vocab",
        "-V",
        type=_positive_int,
        default=32000,
        help="vocabulary size V, rows of the LM head (default 32000)",
    )
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="dtype of hidden and weight (default fp32)")
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", *(b for b in dispatch.BACKENDS if dispatch.serves(b, "linear_logprob"))),
        help="auto, native, triton or torch",
    )
    p.add_argument("--warmup", type=_non_negative_int, default=2, help="untimed runs first (default 2)")
    p.add_argument("--reps", type=_positive_int, default=5, help="timed runs (the median is reported)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(func=_bench)

    p = sub.add_parser("compare", help="compare two step logs (flag off vs on): table, or a report with plots")
    p.add_argument("off", help="step log (JSONL) of the run with the flag off")
    p.add_argument("on", help="step log (JSONL) of the run with the flag on")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", default=None, help="write report.md, comparison.json and PNG plots into this directory")
    p.add_argument(
        "--warmup-steps",
        type=_non_negative_int,
        default=1,
        help="leave each log's first N steps out of the timing statistics (default 1)",
    )
    p.set_defaults(func=_compare)

    p = sub.add_parser(
        "consistency",
        help="rollout-like vs training-like log-probs, batch-invariant mode off vs on",
        description="Log-probs of a fixed sequence set from a rollout-like run (KV-cache decode) and a "
        "training-like run (one forward), with batch-invariant mode off and on, against the "
        "numerical contract. Exit 0: both pass; 1: a mode fails (the drift probe names the "
        "first divergent module); 2: an error.",
    )
    p.add_argument("--model", default="tiny", help="'tiny' (built-in Qwen3-style decoder) or a Hugging Face model path")
    p.add_argument("--sequences", type=_positive_int, default=8, help="number of sequences (default 8)")
    p.add_argument("--min-len", type=_positive_int, default=8, help="shortest sequence in tokens (default 8)")
    p.add_argument("--max-len", type=_positive_int, default=24, help="longest sequence in tokens (default 24)")
    p.add_argument(
        "--prompt-len", type=_positive_int, default=4, help="tokens prefilled before decoding, < --min-len (default 4)"
    )
    p.add_argument("--rollout-batch", type=_positive_int, default=3, help="sequences per rollout batch (default 3)")
    p.add_argument(
        "--seed",
        type=_non_negative_int,
        default=0,
        help="seed of the tiny model's weights and of the sequences (default 0)",
    )
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="model dtype (default fp32)")
    p.add_argument("--probe", action="store_true", help="run the layer-wise drift probe even when both modes pass")
    p.add_argument(
        "--plot", default=None, metavar="PNG", help="write a PNG of drift per module, mode off vs on (needs matplotlib)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="builtin: transformers/our chain for both sides; vllm: a real vLLM engine's rollout (mode off: "
        "as shipped; on: RL_KERNEL_VLLM_BATCH_INVARIANT=1) vs the trainer's forward of --model "
        "(--sequences prompts of --prompt-len ids, --max-len new tokens each)",
    )
    p.add_argument(
        "--engine-args",
        type=json_object,
        default={},
        metavar="JSON",
        help="extra vllm.LLM keyword arguments, a JSON object (--engine vllm)",
    )
    p.add_argument(
        "--parity",
        nargs=2,
        metavar=("ROLLOUT", "TRAINING"),
        default=None,
        help="only the input parity precheck, of two batches saved by rl_kernel_core.tools.consistency.parity.save "
        "(or torch.save of a Batch or of a dict of its fields), or two multimodal batches saved by "
        "rl_kernel_core.tools.multimodal.storage.save (token ids, image-token insertion, 3-D positions, loss "
        "spans, media, processor fingerprint); exit 1 at the first mismatch, 2 when a file is not such a batch "
        "(not a regular file, a wrong or missing field, a sparse or expanded tensor)",
    )
    p.set_defaults(func=_consistency)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``rl-kernel`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
