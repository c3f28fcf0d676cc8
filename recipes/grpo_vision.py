"""GRPO on generated image problems, twice (rl-kernel off, then on), and a report comparing the runs.

Run through ``recipes/grpo_vision.sh`` (which prepares the environment) or directly with a Python
that has rl-kernel, transformers, Pillow, matplotlib and tqdm: ``python recipes/grpo_vision.py
--help``. The policy is a tiny Qwen2-VL built locally (:mod:`grpo.vision_model`), the problems are
drawn images with one-word answers (:mod:`grpo.vision_data`), the engine is the embedded one with
a VLM's inputs (:mod:`grpo.vision`). Before the first step's log-probs and update, each run checks
processor-layout parity between its rollout and training batches and stops on a mismatch, naming
the first mismatched span (exit status 2). Writes into ``--out`` what ``grpo_gsm8k`` writes:
``off.jsonl``/``on.jsonl``, ``off.meta.json``/``on.meta.json``, ``first_step.json``, ``report.md``
and its plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

from grpo import vision, vision_data
from grpo import runs
from grpo.vision_model import PRESETS, CacheError, build_local_vlm
from rl_kernel_core.argtypes import integer, number
from rl_kernel_core.tools.multimodal.parity import ParityError

ROOT = Path(__file__).resolve().parent.parent

PRESET_RUNS = {
    "tiny": dict(runs.TINY_RUN, steps=30, prompts_per_step=8, group_size=4, max_new_tokens=3),
}
# every override but the prompt length: a prompt's length is its image's tokens and the question
VISION_OVERRIDES = tuple(o for o in runs.OVERRIDES if o[0] != "max_prompt_tokens")


def _tasks(value: str) -> tuple[str, ...]:
    tasks = tuple(t.strip() for t in value.split(",") if t.strip())
    unknown = [t for t in tasks if t not in vision_data.TASKS]
    if not tasks or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(vision_data.TASKS)}, got {value!r}"
        )
    return tasks


def parse_args(argv=None) -> argparse.Namespace:
    p = runs.recipe_parser(
        "grpo_vision",
        PRESETS,
        "model shape and run defaults: tiny (2-core CPU, minutes)",
        "GRPO on generated image problems with a tiny Qwen2-VL, rl-kernel off and on, then a comparison "
        "report; processor-layout parity is checked on the first batch before any training.",
    )
    p.add_argument(
        "--data",
        choices=("synthetic",),
        default="synthetic",
        help="synthetic: images drawn from --seed (count squares, read a number, name a colour)",
    )
    p.add_argument(
        "--tasks",
        type=_tasks,
        default=vision_data.TASKS,
        help=f"comma-separated subset of {','.join(vision_data.TASKS)} (default: all)",
    )
    p.add_argument(
        "--problems",
        type=integer(1, vision_data.MAX_PROBLEMS),
        default=512,
        help=f"generated problems, in [1, {vision_data.MAX_PROBLEMS}] (default 512); each is drawn up front "
        "(a run uses at most steps x prompts-per-step of them)",
    )
    p.add_argument(
        "--sampler", choices=("torch", "rl-kernel"), default="torch", help="rollout sampler, the same in both runs"
    )
    p.add_argument(
        "--format-score",
        type=number(0.0, 1.0),
        default=0.1,
        help="reward in [0, 1] for an answer of the right kind that is wrong (default 0.1)",
    )
    p.add_argument(
        "--training-max-pixels",
        type=integer(1),
        default=None,
        help="the trainer's image processor resolution budget in pixels (default: the rollout's); "
        "another value lays images out with another token count, which the parity check stops",
    )
    runs.add_run_options(p, VISION_OVERRIDES)
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="rollout and training in rl-kernel's batch-invariant mode (both runs): each token's rollout "
        "and recomputed log-probs are bitwise equal (logprob_diff 0)",
    )
    return runs.parse_run_options(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, out = runs.device_and_output(args, "grpo_vision")
    print(f"[grpo_vision] engine: embedded; device: {device}; output: {out}", flush=True)
    problems = vision_data.synthetic_problems(args.problems, args.tasks, args.seed)
    source = f"synthetic: {args.problems} problems ({', '.join(args.tasks)}), seed {args.seed}"
    try:
        model_dir = build_local_vlm(
            args.preset, ROOT / "runs" / "models", vision_data.vocabulary_texts(), seed=args.seed
        )
    except CacheError as exc:
        return runs.recipe_error("grpo_vision", str(exc))
    model_desc = (
        f"local {args.preset} (Qwen2-VL-style, random weights, tokenizer trained on the data): {model_dir.name}"
    )
    print(f"[grpo_vision] data: {source}\n[grpo_vision] model: {model_desc}", flush=True)

    cfg = runs.run_config(
        args,
        PRESET_RUNS[args.preset],
        sampler=args.sampler,
        format_score=args.format_score,
        batch_invariant=args.batch_invariant,
        seed=args.seed,
    )
    engine_class = partial(vision.VisionEngine, training_max_pixels=args.training_max_pixels)
    meta_common = runs.run_meta(
        "grpo_vision",
        args,
        cfg,
        device,
        engine="embedded",
        model=model_desc,
        data=source,
        training_max_pixels=args.training_max_pixels,
    )
    first = {}
    for side in args.sides:
        try:
            result, fields = runs.embedded_side(
                "grpo_vision", side, model_dir, problems, cfg, out, device, not args.no_progress, engine_class
            )
        except ParityError as exc:
            return runs.recipe_error(
                "grpo_vision",
                f"{side} run stopped before training: processor-layout parity failed on "
                f"the first batch, rollout vs training: {exc}",
            )
        first[side] = result["first_step"]
        meta = {**meta_common, "side": side, **fields, "parity": "first batch checked, no mismatch"}
        (out / f"{side}.meta.json").write_text(json.dumps(meta, indent=2, default=str))
        print(f"[grpo_vision] {side}: processor-layout parity of the first batch: no mismatch", flush=True)

    if len(args.sides) < 2:
        return 0
    run_lines = [
        "- engine: embedded (transformers Qwen2-VL, rollout over a KV cache)",
        f"- data: {source}",
        f"- model: {model_desc}",
        f"- sampler: {cfg.sampler} (the same in both runs)",
        f"- reward: 1 when the response's first word is the answer, {cfg.format_score:g} when it is a wrong answer of "
        "the right kind (a number, a colour), else 0",
        "- processor-layout parity (rl_kernel_core.tools.multimodal.parity) on each run's first batch, rollout vs training "
        "encoding: no mismatch (a mismatch stops the run before training)",
        f"- batch-invariant mode: {'on in both runs' if cfg.batch_invariant else 'off'}",
    ]
    runs.write_comparison(
        "grpo_vision",
        "GRPO on generated image problems: rl-kernel off vs on",
        first,
        device,
        out,
        [("Run", "\n".join(run_lines))],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
