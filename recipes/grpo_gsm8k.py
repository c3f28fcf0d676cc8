"""GRPO on GSM8K, twice (rl-kernel off, then on), and a report comparing the two runs.

Run through ``recipes/grpo_gsm8k.sh`` (which prepares the environment) or directly with a Python
that has rl-kernel, transformers, matplotlib and tqdm: ``python recipes/grpo_gsm8k.py --help``.
Writes into ``--out``: ``off.jsonl``/``on.jsonl`` (one profiler record per step, flushed every
step), ``off.meta.json``/``on.meta.json`` (hardware, versions, command line, resolved config, git
commit), ``first_step.json`` (embedded engine: off vs on on the identical first-step samples) and
``report.md`` with its PNG plots. The verl engine (:mod:`grpo.verl_engine`) also leaves each run's
parquet data, console log and metrics in ``verl-off/``/``verl-on/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

import torch

from grpo import data as gsm8k
from grpo import embedded
from grpo.model import PRESETS, build_local_model
from grpo import runs
import rl_kernel_core as rk
from rl_kernel_core.tools import report
from rl_kernel_core.argtypes import integer, number

ROOT = Path(__file__).resolve().parent.parent

# preset -> defaults of the run (every one overridable on the command line)
PRESET_RUNS = {
    "tiny": dict(runs.TINY_RUN, steps=60, prompts_per_step=16, group_size=8, max_new_tokens=8, max_prompt_tokens=160),
    "qwen3-0.6b": dict(
        steps=12,
        prompts_per_step=16,
        group_size=8,
        max_new_tokens=256,
        micro_batch=32,
        lr=1e-5,
        temperature=1.0,
        kl_coef=1e-3,
        gradient_checkpointing=True,
        max_prompt_tokens=256,
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = runs.recipe_parser(
        "grpo_gsm8k",
        PRESETS,
        "model shape and run defaults: tiny (2-core CPU, minutes) or qwen3-0.6b (one GPU)",
        "GRPO on GSM8K with rl-kernel off and on, then a comparison report "
        "(step time per module, tokens/s, peak memory, reward, train/rollout log-prob drift).",
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF model path or directory (default: a local model of the preset's shape, random weights)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="GSM8K directory (train.jsonl/test.jsonl or parquet) or 'synthetic'; "
        "default: $GSM8K_DIR, else the hub (openai/gsm8k)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "embedded", "verl"),
        default="auto",
        help="auto: verl when verl, vLLM and a GPU are all present, else embedded",
    )
    p.add_argument(
        "--sampler",
        choices=("torch", "rl-kernel"),
        default="torch",
        help="rollout sampler of the embedded engine, the same in both runs",
    )
    p.add_argument("--limit", type=integer(1), default=None, help="use the first N training problems")
    p.add_argument(
        "--reward-method",
        choices=("strict", "flexible"),
        default="flexible",
        help="GSM8K answer extraction, as verl's scorer (default flexible)",
    )
    p.add_argument(
        "--format-score",
        type=number(0.0, 1.0),
        default=0.1,
        help="reward in [0, 1] for an extracted but wrong answer (verl's format_score)",
    )
    runs.add_run_options(p)
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="rollout and training in rl-kernel's batch-invariant mode, so each token's rollout and "
        "recomputed log-probs are bitwise equal. Embedded engine: both runs (logprob_diff 0). "
        "verl engine: the on run, with the adapter's rl_kernel_batch_invariant option and "
        "RL_KERNEL_VLLM_BATCH_INVARIANT=1 for verl's vLLM server (verl's "
        "training/rollout_probs_diff_max 0); the off run is verl's own, the control group",
    )
    p.add_argument(
        "--weight-check-every",
        type=integer(0),
        default=0,
        metavar="N",
        help="verl engine, on run: check every N-th weight sync into verl's vLLM rollout bit for bit "
        "(the adapter's rl_kernel_weight_check_every option; 0, the default: off)",
    )
    p.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None, help="override the preset"
    )
    args = runs.parse_run_options(p, argv)
    if args.weight_check_every and args.engine != "verl":
        p.error(
            f"--weight-check-every applies to --engine verl (the embedded engine samples from the model it "
            f"trains: no weight sync), got --engine {args.engine}"
        )
    return args


def resolve_engine(requested: str, device: torch.device) -> tuple[str, str]:
    """The engine to run and why (``auto`` takes verl only when a GPU and every module of
    :data:`VERL_ENGINE_NEEDS` are present)."""
    if requested != "auto":
        return requested, "requested with --engine"
    missing = verl_engine_missing()
    if device.type != "cuda":
        missing.append("a GPU")
    if missing:
        return "embedded", f"auto: embedded (no {', '.join(missing)})"
    return "verl", "auto: verl (verl, vLLM, pandas, pyarrow and a GPU are present)"


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, a module without a spec
        return False


VERL_ENGINE_NEEDS = ("verl", "vllm", "pandas", "pyarrow")
"""What ``--engine verl`` imports in this Python: verl's trainer, its vLLM rollout, and pandas and
pyarrow for the parquet files it reads the problems from."""


def verl_engine_missing() -> list[str]:
    """The modules of :data:`VERL_ENGINE_NEEDS` this Python cannot import."""
    return [name for name in VERL_ENGINE_NEEDS if not _importable(name)]


def run_verl_side(
    cfg: embedded.GRPOConfig, out: Path, side: str, model_dir: Path, problems, device: torch.device
) -> dict:
    """One run with verl's trainer (:func:`grpo.verl_engine.run_verl`); its fields of the side's meta."""
    from grpo import verl_engine

    print(f"[grpo_gsm8k] {side}: verl's trainer, log in {out / f'verl-{side}' / 'verl.log'}", flush=True)
    result = verl_engine.run_verl(dataclasses.asdict(cfg), out, side == "on", model_dir, problems, device.type)
    return {
        "verl_command": shlex.join(result["command"]),
        "verl_rl_kernel_environment": result["rl_kernel_environment"],
        "verl_returncode": result["returncode"],
        "verl_steps": result["steps"],
        "verl_log": result["log"],
        "backends": result["backends"] if side == "on" else "verl's own path",
    }


def equal_reward_residues(group_size: int, rewards: list[float]) -> list[tuple[float, float, float]]:
    """``(reward, off advantage, on advantage)`` for a group of ``group_size`` copies of each reward:
    the off path's fp32 ``(r - mean) / (std + eps)`` leaves a float residue, rl-kernel's is 0."""
    out = []
    for r in rewards:
        group = torch.full((group_size,), r, dtype=torch.float32)
        off = embedded.OFF.advantages(group, group_size)
        on = rk.group_advantages(group, group_size=group_size, estimator="grpo")
        out.append((r, float(off.abs().max()), float(on.abs().max())))
    return out


def known_differences(engine: str, cfg: embedded.GRPOConfig, off_log: Path, on_log: Path) -> str:
    """Markdown naming each known difference in meaning between the off and on paths, with its size
    (computed, and measured in these runs' step logs where the engine records it)."""
    residues = equal_reward_residues(cfg.group_size, sorted({0.0, cfg.format_score, 1.0}))
    table = "\n".join(
        [f"| reward of all {cfg.group_size} | off advantage (max abs) | on advantage (max abs) |", "|---|---|---|"]
        + [f"| {r:g} | {off:.3g} | {on:.3g} |" for r, off, on in residues]
    )
    if engine == "verl":
        return (
            "**Advantages.** Both runs compute them with verl's `compute_grpo_outcome_advantage` (the verl adapter "
            "replaces the log-prob and loss, not the advantages), so a group whose rewards are all equal gets the same "
            "float residue in both runs (fp32 on CPU; rl-kernel's own `group_advantages` gives 0 there):\n\n"
            + table
            + "\n\n**Loss.** rl-kernel's `policy_loss` differs from verl's only where a micro-batch has no response "
            "token (0 instead of NaN) and in verl's `1e-8` added to token counts (below half an fp32 ulp); "
            "neither arises here, every response having at least one token (`docs/loss.md`)."
        )
    logs = {side: report.read_step_log(path) for side, path in (("off", off_log), ("on", on_log))}
    measured = []
    for side, log in logs.items():
        steps, largest = log.series.get("equal_reward_advantage_max", ([], []))
        groups = sum(log.values("equal_reward_groups"))
        worst = max(largest, default=0.0)
        nonzero = [step for step, value in zip(steps, largest) if value]
        first = f", first nonzero at step {nonzero[0]}" if nonzero else ""
        measured.append(
            f"{side}: {groups:g} such groups over {log.steps} steps, largest |advantage| {worst:.3g}{first}"
        )
    return (
        "**Advantages of a group whose rewards are all equal.** The off path computes `(r - mean) / (std + 1e-6)` "
        "in fp32 as written (and as verl's `compute_grpo_outcome_advantage`): `r - mean` is a float residue, not "
        "0, and the division by `1e-6` magnifies it. rl-kernel's `group_advantages` gives exactly 0 "
        "(`docs/advantages.md`). Computed for this run's group size and rewards (fp32 on CPU):\n\n"
        + table
        + "\n\nMeasured in these runs: "
        + "; ".join(measured)
        + ". A nonzero residue gives that group's tokens a "
        "policy gradient on the off path only, so from the step after the first one the runs' weights, samples and "
        "rewards are no longer the same.\n\n**Groups of unequal rewards.** The off path's group mean and std are "
        "fp32, rl-kernel's fp64 rounded to fp32: their advantages differ in the last bits of fp32, not in meaning.\n\n"
        "No other difference in meaning is known between the two paths' log-probs, entropy and loss; the first-step "
        "check measures their numeric agreement."
    )


def model_problem(model: str) -> str | None:
    """Why ``--model``'s config or tokenizer cannot be loaded (checked before any run), or None."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(model).expanduser()
    if path.exists() and not path.is_dir():
        return "not a directory (expected a Hugging Face model directory or hub id)"
    if not path.exists() and (path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1):
        return "no such directory (expected a Hugging Face model directory or hub id)"
    try:
        AutoConfig.from_pretrained(model)
        AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:  # transformers' errors for a missing path, hub id or config
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    device, out = runs.device_and_output(args, "grpo_gsm8k")
    engine, why = resolve_engine(args.engine, device)
    if engine == "verl" and (missing := verl_engine_missing()):
        return runs.recipe_error(
            "grpo_gsm8k",
            f"--engine verl needs {', '.join(VERL_ENGINE_NEEDS)} in this Python "
            f"({sys.executable}), missing: {', '.join(missing)}; recipes/grpo_gsm8k.sh "
            "builds an environment with them (scripts/env.sh recipe-verl)",
        )
    print(f"[grpo_gsm8k] engine: {engine} ({why}); device: {device}; output: {out}", flush=True)
    if args.model:
        problem = model_problem(args.model)
        if problem:
            return runs.recipe_error("grpo_gsm8k", f"--model {args.model}: {problem}")

    try:
        problems, source = gsm8k.load_problems(args.data, "train", args.limit, args.seed)
    except (gsm8k.DataUnavailableError, gsm8k.DataError) as exc:
        return runs.recipe_error("grpo_gsm8k", str(exc))
    print(f"[grpo_gsm8k] data: {source}", flush=True)

    if args.model:
        model_dir, model_desc = Path(args.model), args.model
    else:
        texts = [p.question + " " + p.answer for p in problems[:4000]] + [gsm8k.INSTRUCTION]
        model_dir = build_local_model(args.preset, ROOT / "runs" / "models", texts, seed=args.seed)
        model_desc = (
            f"local {args.preset} (Qwen3-style, random weights, tokenizer trained on the data): {model_dir.name}"
        )
    print(f"[grpo_gsm8k] model: {model_desc}", flush=True)

    cfg = runs.run_config(
        args,
        PRESET_RUNS[args.preset],
        sampler=args.sampler,
        reward_method=args.reward_method,
        format_score=args.format_score,
        batch_invariant=args.batch_invariant,
        weight_check_every=args.weight_check_every,
        seed=args.seed,
    )
    meta_common = runs.run_meta(
        "grpo_gsm8k", args, cfg, device, engine=engine, engine_choice=why, model=model_desc, data=source
    )
    first, failed = {}, []
    for side in args.sides:
        if engine == "verl":
            (out / f"{side}.jsonl").unlink(missing_ok=True)
            meta = {**meta_common, "side": side, **run_verl_side(cfg, out, side, model_dir, problems, device)}
            if meta["verl_returncode"] != 0:
                failed.append(side)
                print(
                    f"[grpo_gsm8k] {side}: verl exited with {meta['verl_returncode']} after {meta['verl_steps']} "
                    f"step(s); its log: {meta['verl_log']}",
                    flush=True,
                )
        else:
            result, fields = runs.embedded_side(
                "grpo_gsm8k", side, model_dir, problems, cfg, out, device, not args.no_progress
            )
            first[side] = result["first_step"]
            meta = {**meta_common, "side": side, **fields}
        (out / f"{side}.meta.json").write_text(json.dumps(meta, indent=2, default=str))

    if failed or len(args.sides) < 2:
        return 1 if failed else 0
    rollout = (
        f"- rollout: verl's vLLM server, {cfg.group_size} samples per prompt"
        if engine == "verl"
        else f"- sampler: {cfg.sampler} (the same in both runs)"
    )
    run_lines = [
        f"- engine: {engine} ({why})",
        f"- data: {source}",
        f"- model: {model_desc}",
        rollout,
        f"- reward: GSM8K scorer, {cfg.reward_method} extraction, format score {cfg.format_score}",
    ]
    if engine == "verl":
        from grpo import verl_engine

        if cfg.batch_invariant:
            run_lines.append(
                "- batch-invariant: the on run with the verl adapter's rl_kernel_batch_invariant option and "
                "RL_KERNEL_VLLM_BATCH_INVARIANT=1 in verl's vLLM server; the off run is verl's own (the "
                "control group). verl's train/rollout difference: `rollout_probs_diff_max`"
            )
        if cfg.weight_check_every:
            run_lines.append(
                f"- weight check: the on run checks every {cfg.weight_check_every}-th weight sync into "
                "verl's vLLM rollout bit for bit (`rl_kernel/weight_bits_differ`, parameters whose bits "
                "differ)"
            )
        run_lines += filter(None, [verl_engine.vocabulary_note(model_dir)])
    sections = [
        ("Run", "\n".join(run_lines)),
        (
            "Known differences between the off and on paths",
            known_differences(engine, cfg, out / "off.jsonl", out / "on.jsonl"),
        ),
    ]
    runs.write_comparison("grpo_gsm8k", "GRPO on GSM8K: rl-kernel off vs on", first, device, out, sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
