"""What the GRPO recipes share: their common options and the ones that override a preset's run,
the output directory and device, the run config, one embedded run of a side, the runs' common
metadata, and the report with its first-step off-vs-on check."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from rl_kernel_core import contract, dispatch
from rl_kernel_core.argtypes import device_name, integer, number
from rl_kernel_core.tools import bench, report

from . import embedded

ROOT = Path(__file__).resolve().parents[2]

SEED_MAX = 2**32 - 1

LR_MAX = 1.0
"""The largest ``--lr``: AdamW moves each weight by about ``lr`` per step, so above 1 a run only
diverges (``1e30``: NaN weights after one step; ``1e300`` does not even fit the fp32 update)."""

TEMPERATURE_RANGE = (torch.finfo(torch.float32).tiny, 1.0 / torch.finfo(torch.float32).tiny)
"""``--temperature``'s range, the ops' own (``2**-126`` to ``2**126``, so that the temperature and
its reciprocal are normal fp32 numbers): outside it rl-kernel's ops refuse the run's temperature."""

# the options that override a preset's run: name, argparse type, what it takes
OVERRIDES = (
    ("steps", integer(1), "GRPO steps, >= 1"),
    ("prompts_per_step", integer(1), "prompts per step, >= 1"),
    ("group_size", integer(2), "responses per prompt, >= 2 (a group's advantages need two)"),
    ("max_new_tokens", integer(1), "response tokens at most, >= 1"),
    ("micro_batch", integer(1), "sequences per forward/backward, >= 1"),
    ("max_prompt_tokens", integer(1), "prompt tokens kept (longer prompts are truncated), >= 1"),
    ("lr", number(0.0, LR_MAX, low_open=True), "AdamW learning rate, in (0, 1]"),
    (
        "temperature",
        number(*TEMPERATURE_RANGE),
        "sampling and log-prob temperature, in [2**-126, 2**126] (about 1.2e-38 to 8.5e37, the ops' range)",
    ),
    ("kl_coef", number(0.0), "coefficient of the KL-to-reference loss term, >= 0 (0: no reference model)"),
    ("entropy_coef", number(0.0), "coefficient of the entropy bonus, >= 0"),
)

TINY_RUN = dict(micro_batch=32, lr=1e-2, temperature=1.0, kl_coef=0.0, gradient_checkpointing=False)
"""What every recipe's ``tiny`` preset runs with (each adds its steps, group sizes and lengths): a model
small enough for a 2-core CPU takes 32 sequences a forward and a learning rate large enough for its
reward to move within minutes, with no reference model. Each key stays a ``--<key>`` override
(:data:`OVERRIDES`; :func:`run_config` overrides only a preset's keys)."""


def git_commit() -> str:
    """The checkout's commit (``+uncommitted`` when the tree differs from it).

    ``RL_KERNEL_GIT_COMMIT``, when set, is taken instead: for copies of the tree whose ``.git``
    is missing or not the tree's own.
    """
    if os.environ.get("RL_KERNEL_GIT_COMMIT"):
        return os.environ["RL_KERNEL_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def first_step_check(off: dict, on: dict, dtype: torch.dtype) -> dict:
    """Off vs on values on step 0's samples: log-prob/entropy/loss agreement within the contract.

    ``on`` is the on run's step 0 (with its samples); ``off`` the off path evaluated on those same
    samples and weights. Each side is within the contract's bound of the exact value, so their
    difference is held to twice the bound of the off values.
    """
    result: dict[str, Any] = {"dtype": contract.dtype_key(dtype)}
    mask = on["response_mask"].bool()
    for name, op_class in (("old_logprob", "logprob"), ("logprob", "logprob"), ("entropy", "logprob")):
        a, b = off[name][mask].double(), on[name][mask].double()
        diff = (a - b).abs()
        bound = 2 * contract.error_bound(a, op_class, dtype)
        result[name] = {
            "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "within_contract": bool((diff <= bound).all()),
            "worst_bound_fraction": float((diff / bound).max()),
        }
    tol = contract.tolerance("reduction", dtype)
    loss_diff = abs(off["loss"] - on["loss"])
    result["loss"] = {
        "off": off["loss"],
        "on": on["loss"],
        "abs_diff": loss_diff,
        "within_contract": loss_diff <= 2 * (tol.atol + tol.rtol * abs(off["loss"])),
    }
    return result


def first_step_section(first: dict, device: torch.device, out: Path) -> tuple[str, str]:
    """The report's first-step section from the runs' step-0 tensors (``first["on"]`` with its
    ``cross_check``, ``first["off"]`` when run); writes ``first_step.json`` into ``out``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cross = first["on"]["cross_check"]
    check = {"error": cross["error"]} if "error" in cross else first_step_check(cross, first["on"], dtype)
    off_first = first.get("off")
    check["samples_identical_across_runs"] = bool(
        off_first is not None
        and torch.equal(off_first["response_ids"], first["on"]["response_ids"])
        and torch.equal(off_first["response_mask"], first["on"]["response_mask"])
    )
    (out / "first_step.json").write_text(json.dumps(check, indent=2))
    return "First step, off vs on", report.first_step_markdown(check)


def run_meta(recipe: str, args: argparse.Namespace, cfg: embedded.GRPOConfig, device: torch.device, **fields) -> dict:
    """The meta fields both runs of ``recipes/<recipe>.sh`` share: its command line, the preset,
    ``fields`` (engine, model, data, ...), the checkout's commit, the resolved config and the environment."""
    return {
        "command": " ".join([f"bash recipes/{recipe}.sh", *bench.command_line().split(" ")[2:]]),
        "preset": args.preset,
        **fields,
        "git_commit": git_commit(),
        "config": dataclasses.asdict(cfg),
        "environment": bench.environment(device),
    }


def write_comparison(
    recipe: str, title: str, first: dict, device: torch.device, out: Path, sections: list[tuple[str, str]]
) -> None:
    """Writes ``out/report.md`` comparing ``out/off.jsonl`` and ``out/on.jsonl``: the first-step
    section (when the on run has a step 0 in ``first``), then ``sections`` (title, markdown)."""
    if first.get("on"):
        sections = [first_step_section(first, device, out), *sections]
    report_path = report.write_report(out / "off.jsonl", out / "on.jsonl", out, title=title, sections=sections)
    print(f"[{recipe}] report: {report_path}", flush=True)


def recipe_parser(recipe: str, presets: Any, preset_help: str, description: str) -> argparse.ArgumentParser:
    """The command line parser of ``recipes/<recipe>.sh``, holding its ``--preset`` (one of
    ``presets``, default tiny)."""
    p = argparse.ArgumentParser(prog=f"recipes/{recipe}.sh", description=description)
    p.add_argument("--preset", choices=sorted(presets), default="tiny", help=preset_help)
    return p


def add_run_options(p: argparse.ArgumentParser, overrides: tuple = OVERRIDES) -> None:
    """The options of every recipe: ``--out``, ``--device``, ``--sides``, ``--seed``,
    ``--no-progress`` and ``--<field>`` for each of ``overrides`` (name, argparse type, what it takes)."""
    p.add_argument("--out", default=None, help="output directory (default: runs/<recipe>-<time>)")
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--sides", default="off,on", help="which runs to make (default: off,on)")
    p.add_argument(
        "--seed", type=integer(0, SEED_MAX), default=0, help="seed of the model, data order and sampling (default 0)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for field, kind, what in overrides:
        p.add_argument("--" + field.replace("_", "-"), type=kind, default=None, help=f"{what} (overrides the preset)")


def parse_run_options(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``p.parse_args(argv)`` with ``--sides`` as a list; ``p.error`` (one line, exit 2) where
    ``--sides`` lists something other than off/on, or one of them twice, or ``--out`` is a file."""
    args = p.parse_args(argv)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not args.sides or any(s not in ("off", "on") for s in args.sides):
        p.error(f"--sides must list off and/or on, got {','.join(args.sides)!r}")
    if len(set(args.sides)) < len(args.sides):  # a second run of a side would overwrite the first's log
        p.error(f"--sides must list off and/or on, each once, got {','.join(args.sides)!r}")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out must be a directory, got {args.out!r}, which is a file")
    return args


def recipe_error(recipe: str, message: str) -> int:
    """Prints ``[<recipe>] error: <message>`` on stderr; returns the exit status of such an error, 2."""
    print(f"[{recipe}] error: {message}", file=sys.stderr)
    return 2


def device_and_output(args: argparse.Namespace, recipe: str) -> tuple[torch.device, Path]:
    """``--device`` (default cuda when available) and ``--out`` (default ``runs/<recipe>-<time>``),
    created; where it cannot be, exits with status 2 after a one-line :func:`recipe_error`, as
    argparse does for a bad option. Turns transformers' progress bars off."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out or ROOT / "runs" / time.strftime(f"{recipe}-%Y%m%d-%H%M%S"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        sys.exit(recipe_error(recipe, f"--out {str(out)!r} cannot be created: {exc.strerror or exc}"))
    return device, out


def run_config(args: argparse.Namespace, preset_run: dict, **fixed) -> embedded.GRPOConfig:
    """The run's config: ``preset_run``'s defaults, the overrides given on the command line, then ``fixed``."""
    overrides = {k: getattr(args, k) for k in preset_run if getattr(args, k, None) is not None}
    if args.entropy_coef is not None:
        overrides["entropy_coef"] = args.entropy_coef
    return embedded.GRPOConfig(**{**preset_run, **overrides, **fixed})


def embedded_side(
    recipe: str,
    side: str,
    model_dir: Path,
    problems: list,
    cfg: embedded.GRPOConfig,
    out: Path,
    device: torch.device,
    progress: bool,
    engine_class: Callable = embedded.Engine,
) -> tuple[dict, dict]:
    """One run of the embedded engine (``side`` "off" or "on", the on run cross-checked against
    the off path on step 0) logging to ``out/<side>.jsonl``; returns :func:`grpo.embedded.run`'s
    result and the side's fields of its meta."""
    log = out / f"{side}.jsonl"
    log.unlink(missing_ok=True)
    path = embedded.OFF if side == "off" else embedded.ON
    result = embedded.run(
        model_dir,
        problems,
        cfg,
        path,
        log,
        device,
        progress=progress,
        cross_check=embedded.OFF if side == "on" else None,
        engine_class=engine_class,
    )
    if result["oom"]:
        print(f"[{recipe}] {side}: out of memory, run stopped: {result['oom']}", flush=True)
    return result, {
        "oom": result["oom"],
        "backends": {op: d.backend for op, d in dispatch.explain().items()} if side == "on" else "plain PyTorch",
    }
