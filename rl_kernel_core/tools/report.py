"""Compare two step logs (flag off vs on): statistics, a Markdown report and PNG plots.

A step log is the JSONL that :func:`rl_kernel_core.profiling.step_end` writes (from the recipe or
any adapter): one JSON object per line with ``step``, ``regions`` (name -> ms) and numeric fields
(``tokens_per_s``, ``peak_vram_gib``, ``reward``, ``logprob_diff``, ``kl``, ``loss``, ...); the
reader adds ``region/actor_update``, the per-step sum of the policy-update regions
(:data:`ACTOR_REGIONS`). Files
are read one line at a time (a line over :data:`MAX_LINE_BYTES` is an error) and only numeric
series are kept, so memory follows the number of values, not the file size. A malformed line is
an error naming the file and line, except an unterminated last line (a run interrupted
mid-write), which is skipped and counted. NaN and infinite values (and integers beyond the float
range) count as missing, and the comparison's warnings say how many of which field; a ``step``
must fit in int64; statistics
that overflow are written as ``null`` in JSON (:func:`json_safe`). A record with ``"oom": true``
marks a run that ran out of memory at that step.

An optional ``<log>.meta.json`` beside a log (hardware, versions, command line, resolved config,
git commit) is included in the report; it must hold a JSON object (an array or a string there is
an error naming the file). Two logs that both hold metrics but share none are refused
(:func:`check_comparable`).
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rl_kernel_core.profiling import summarize_values

# per-module breakdown order (the profiler's shared region names)
MODULES = ("rollout", "old_logprob", "ref_logprob", "logprob", "ratio_kl", "loss", "backward", "update", "weight_sync")

# the regions of one policy update (verl's update_actor): summed per step into ACTOR_UPDATE
ACTOR_REGIONS = ("logprob", "ratio_kl", "loss", "backward", "update")
ACTOR_UPDATE = "region/actor_update"

# metrics shown first in the headline table, in this order
HEADLINE = (
    "region/step",
    ACTOR_UPDATE,
    "region/old_logprob",
    "tokens_per_s",
    "peak_vram_gib",
    "reward",
    "accuracy",
    "logprob_diff",
    "kl",
    "loss",
    "entropy",
)

_PLOTS = (  # file, metric keys, y label
    ("step_time.png", ("region/step",), "step time (ms)"),
    ("reward.png", ("reward",), "mean reward"),
    ("logprob_diff.png", ("logprob_diff",), "mean |rollout - train log-prob|"),
    ("kl.png", ("kl",), "KL to reference (low_var_kl)"),
    ("loss.png", ("loss",), "loss"),
    ("peak_vram.png", ("peak_vram_gib",), "peak VRAM (GiB)"),
    ("tokens_per_s.png", ("tokens_per_s",), "tokens/s"),
)


MAX_LINE_BYTES = 16 << 20
"""Longest line read (a step record is a few hundred bytes): bounds the reader's memory."""


class StepLogError(ValueError):
    """A step log that cannot be read; the message names the file and, where known, the line."""


@dataclass
class StepLog:
    """The numeric content of one step log.

    ``series`` maps ``region/<name>`` and every numeric field to its ``(steps, values)`` arrays;
    ``step_numbers`` holds each step record's ``step`` in file order; ``oom`` holds ``(step, error
    text)`` when the run ran out of memory; ``skipped_partial`` is 1 when an unterminated last line
    was skipped; ``not_finite`` counts, per field, the numbers that were NaN, infinite or beyond
    the float range (kept as missing).
    """

    path: Path
    steps: int = 0
    step_numbers: array = field(default_factory=lambda: array("q"))
    series: dict[str, tuple[array, array]] = field(default_factory=dict)
    oom: Optional[tuple[int, str]] = None
    skipped_partial: int = 0
    meta: Optional[dict[str, Any]] = None
    not_finite: dict[str, int] = field(default_factory=dict)

    def values(self, key: str) -> list[float]:
        return list(self.series[key][1]) if key in self.series else []


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer beyond the float range, as infinite as 1e400
        return None
    return value if math.isfinite(value) else None


def _add(log: StepLog, key: str, step: int, value: Any) -> None:
    number = _number(value)
    if number is not None:
        steps, values = log.series.setdefault(key, (array("q"), array("d")))
        steps.append(step)
        values.append(number)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        log.not_finite[key] = log.not_finite.get(key, 0) + 1


def read_step_log(path: str | Path) -> StepLog:
    """Read a step log line by line (see the module docstring for what counts as malformed)."""
    path = Path(path)
    if not path.exists():
        raise StepLogError(f"{path}: no such file")
    if not path.is_file():
        raise StepLogError(f"{path}: not a regular file")
    log = StepLog(path)
    with open(path, "rb") as f:
        pending: Optional[tuple[int, bytes]] = None
        lineno = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if len(raw) > MAX_LINE_BYTES:
                raise StepLogError(
                    f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES >> 20} MiB is not a step record"
                )
            if pending is not None:
                _parse_line(log, *pending)
            pending = (lineno, raw)
        if pending is not None:
            lineno, raw = pending
            if raw.endswith(b"\n"):
                _parse_line(log, lineno, raw)
            else:
                try:
                    _parse_line(log, lineno, raw)
                except StepLogError:
                    log.skipped_partial = 1
    meta_path = path.with_name(path.stem + ".meta.json")
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StepLogError(f"{meta_path}: not a JSON object ({exc})") from None
        if not isinstance(meta, dict):
            raise StepLogError(
                f"{meta_path}: must hold a JSON object (hardware, versions, config...), "
                f"got a JSON {_JSON_KINDS.get(type(meta), type(meta).__name__)}"
            )
        log.meta = meta
    return log


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def check_comparable(off: StepLog, on: StepLog) -> None:
    """Refuse two logs that both hold metrics but share none (say, a step log beside another
    tool's JSONL): their comparison would be two disjoint halves of a table, silently.

    Raises:
        StepLogError: naming both files and a few metrics of each.
    """
    if off.series and on.series and set(off.series).isdisjoint(on.series):

        def some(log: StepLog) -> str:
            keys = sorted(log.series)
            return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

        raise StepLogError(
            f"{off.path} and {on.path} share no metric ({off.path.name}: {some(off)}; {on.path.name}: "
            f"{some(on)}): they are not two runs of one kind to compare"
        )


def json_object_line(
    raw: bytes, where: str, what: str, error: type[Exception] = StepLogError
) -> Optional[dict[str, Any]]:
    """The JSON object on one line of a JSONL file, None for a blank line; otherwise ``error``
    naming ``where`` (``file:line``): not UTF-8, not JSON, or not an object (``what`` says which
    object was expected). The recipe reads its GSM8K rows with it too."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:
        raise error(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise error(f"{where}: expected a JSON object ({what}), got {type(record).__name__}")
    return record


def _parse_line(log: StepLog, lineno: int, raw: bytes) -> None:
    where = f"{log.path}:{lineno}"
    record = json_object_line(raw, where, "a step record")
    if record is None:
        return
    step = record.get("step", log.steps)
    if isinstance(step, bool) or not isinstance(step, int):
        raise StepLogError(f"{where}: 'step' must be an integer, got {step!r}")
    if not -(2**63) <= step < 2**63:
        raise StepLogError(f"{where}: 'step' must fit in int64, got an integer of {len(str(abs(step)))} digits")
    regions = record.get("regions") or {}
    if not isinstance(regions, dict):
        raise StepLogError(f"{where}: 'regions' must be an object of name -> ms, got {type(regions).__name__}")
    if record.get("oom"):
        log.oom = (step, str(record.get("error", "out of memory")))
        return
    log.steps += 1
    log.step_numbers.append(step)
    for name, ms in regions.items():
        _add(log, f"region/{name}", step, ms)
    actor = [_number(regions.get(name)) for name in ACTOR_REGIONS if name in regions]
    if actor and None not in actor:
        _add(log, ACTOR_UPDATE, step, sum(actor))
    for key, value in record.items():
        if key not in ("step", "regions"):
            _add(log, key, step, value)


def step_warnings(off: StepLog, on: StepLog) -> list[str]:
    """Why comparing ``off`` with ``on`` may mean little: a log without step records, a log that
    repeats step numbers (runs appended to one file?), two logs that share no step number, or
    numbers that were not finite (counted as missing)."""
    warnings = []
    for log, side in ((off, "OFF"), (on, "ON")):
        if log.not_finite:
            counts = ", ".join(f"{key} {n}" for key, n in sorted(log.not_finite.items()))
            warnings.append(
                f"{side} log {log.path} has values that are NaN, infinite or beyond the float range, "
                f"counted as missing: {counts}"
            )
        numbers = log.step_numbers
        if not numbers:
            warnings.append(f"{side} log {log.path} has no step records")
            continue
        seen: set[int] = set()
        repeats = []
        for n in numbers:
            if n in seen:
                repeats.append(n)
            seen.add(n)
        if repeats:
            warnings.append(
                f"{side} log {log.path} repeats step numbers ({len(repeats)} of {len(numbers)} records, "
                f"first step {repeats[0]}): were runs appended to one file?"
            )
    if off.step_numbers and on.step_numbers and set(off.step_numbers).isdisjoint(on.step_numbers):
        warnings.append(
            f"the logs share no step number (OFF steps {min(off.step_numbers)}..{max(off.step_numbers)}, "
            f"ON steps {min(on.step_numbers)}..{max(on.step_numbers)}): are they runs of the same schedule?"
        )
    return warnings


def is_timing(key: str) -> bool:
    """Whether a series is a timing (regions and throughput), which warm-up steps distort."""
    return key.startswith("region/") or key == "tokens_per_s"


def _ratio(off: dict[str, Any], on: dict[str, Any], stat: str) -> Optional[float]:
    return on[stat] / off[stat] if off["n"] and on["n"] and off[stat] else None


def compare_table(off: StepLog, on: StepLog, warmup_steps: int = 0) -> list[dict[str, Any]]:
    """Rows ``{"metric", "off", "on", "on_over_off", "on_over_off_median", "spreads_overlap"}``:
    statistics of every series in either log.

    ``off``/``on`` are :func:`rl_kernel_core.profiling.summarize_values` dicts; ``on_over_off`` is
    the ratio of the means, ``on_over_off_median`` of the medians (None where either side lacks
    the metric or the off value is 0). ``spreads_overlap`` (timing series with values on both
    sides, else None) says whether the runs' ``[min, max]`` ranges overlap, i.e. whether their
    ratio is within the step-to-step noise. Timing series leave out each log's first
    ``warmup_steps`` steps (compilation, autotuning and allocator growth land there); other series
    keep every step. Headline metrics first.
    """
    keys = set(off.series) | set(on.series)
    ordered = [k for k in HEADLINE if k in keys] + sorted(keys - set(HEADLINE))
    rows = []
    for key in ordered:
        skip = warmup_steps if is_timing(key) else 0
        a, b = summarize_values(off.values(key)[skip:]), summarize_values(on.values(key)[skip:])
        overlap = a["min"] <= b["max"] and b["min"] <= a["max"] if is_timing(key) and a["n"] and b["n"] else None
        rows.append(
            {
                "metric": key,
                "off": a,
                "on": b,
                "on_over_off": _ratio(a, b, "mean"),
                "on_over_off_median": _ratio(a, b, "p50"),
                "spreads_overlap": overlap,
            }
        )
    return rows


MIN_TIMED_STEPS = 3
"""Fewer timed steps per run than this and a run's spread says little about its noise."""


def timing_noise(rows: list[dict[str, Any]]) -> list[str]:
    """Plain-text warnings about the timing rows of :func:`compare_table`: the series whose off and
    on spreads overlap (their ratios are within step-to-step noise), and too few timed steps."""
    compared = [r for r in rows if r["spreads_overlap"] is not None]
    warnings = []
    overlapping = [r["metric"] for r in compared if r["spreads_overlap"]]
    if overlapping:
        warnings.append(
            f"{len(overlapping)} of {len(compared)} timing series have overlapping off and on spreads "
            f"(min..max over steps): {', '.join(overlapping)}; their on/off ratios are within the "
            "step-to-step noise of these runs, not a measured difference"
        )
    timing = [r for r in rows if is_timing(r["metric"])]
    fewest = min(max(r[side]["n"] for r in timing) for side in ("off", "on")) if timing else None
    if fewest is not None and fewest < MIN_TIMED_STEPS:
        warnings.append(f"only {fewest} timed step(s) in a run: too few for its spread to show the noise")
    return warnings


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (a mean can overflow), so
    ``json.dumps(..., allow_nan=False)`` writes valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"


_TEXT_STATS = ("mean", "p50", "min", "max")


def text_table(rows: list[dict[str, Any]]) -> str:
    """The comparison rows as a fixed-width text table: each side's mean, median, min and max, the
    on/off ratios of the means and of the medians, and ``~`` after a timing series whose off and on
    spreads overlap."""
    head = (
        f"{'metric':<26}"
        + "".join(f"{f'{s} {q}':>11}" for s in ("off", "on") for q in _TEXT_STATS)
        + f"{'on/off':>9}{'p50 on/off':>11}"
    )
    lines = [head]
    for row in rows:
        cells = "".join(_fmt(row[s].get(q)).rjust(11) for s in ("off", "on") for q in _TEXT_STATS)
        mark = " ~" if row["spreads_overlap"] else ""
        lines.append(
            f"{row['metric']:<26}{cells}{_fmt(row['on_over_off']).rjust(9)}{_fmt(row['on_over_off_median']).rjust(11)}{mark}"
        )
    return "\n".join(lines)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _smooth(values: list[float], alpha: float = 0.3) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def write_plots(off: StepLog, on: StepLog, out_dir: Path, warmup_steps: int = 0) -> list[tuple[str, str]]:
    """PNG plots of each series over steps (every step), and the per-module bars (means without
    the first ``warmup_steps`` steps, as in :func:`compare_table`).

    Returns ``[(file name, caption)]`` of the plots written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, keys, label in _PLOTS:
        key = keys[0]
        if key not in off.series and key not in on.series:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for log, side, color in ((off, "off", "tab:blue"), (on, "on", "tab:orange")):
            if key not in log.series:
                continue
            steps, vals = log.series[key]
            if key == "reward":
                ax.plot(steps, vals, color=color, alpha=0.35, lw=1, label=f"{side} (raw)")
                ax.plot(steps, _smooth(list(vals)), color=color, lw=2, label=f"{side} (smoothed)")
            else:
                ax.plot(steps, vals, color=color, marker=".", lw=1.5, label=side)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append((name, label))

    modules = [m for m in MODULES if f"region/{m}" in off.series or f"region/{m}" in on.series]
    if modules:
        fig, ax = plt.subplots(figsize=(8, 3.8))
        width = 0.4
        for i, (log, side, color) in enumerate(((off, "off", "tab:blue"), (on, "on", "tab:orange"))):
            means = [summarize_values(log.values(f"region/{m}")[warmup_steps:]).get("mean", 0.0) for m in modules]
            ax.bar([x + (i - 0.5) * width for x in range(len(modules))], means, width, label=side, color=color)
        ax.set_xticks(range(len(modules)), modules, rotation=20, fontsize=8)
        ax.set_ylabel("mean ms per step")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "modules.png", dpi=110)
        plt.close(fig)
        written.append(("modules.png", "per-module time per step (mean ms)"))
    return written


def first_step_markdown(check: dict[str, Any]) -> str:
    """Markdown for the recipe's first-step check (both paths on the on run's step-0 samples)."""
    if "error" in check:
        return f"The off path could not be evaluated on the on run's step-0 samples: {check['error']}"
    rows = [
        [
            name,
            _fmt(v["max_abs_diff"]),
            _fmt(v["mean_abs_diff"]),
            _fmt(v["worst_bound_fraction"]),
            "yes" if v["within_contract"] else "**no**",
        ]
        for name, v in check.items()
        if isinstance(v, dict) and "max_abs_diff" in v
    ]
    loss = check.get("loss")
    same = check.get("samples_identical_across_runs")
    text = (
        "Both paths evaluated on the on run's step-0 samples and weights "
        f"(inputs {check['dtype']}; bound: twice the numerical contract's bound, each side being within it of the exact value). "
        + (
            "The off run drew bitwise the same step-0 samples."
            if same
            else "The off run's step-0 samples were not bitwise the same as the on run's (the rollout forward is not "
            "bitwise reproducible from run to run here), so the comparison uses the on run's samples for both paths."
        )
        + "\n\n"
    )
    text += _md_table(["value", "max abs diff", "mean abs diff", "worst diff / bound", "within contract"], rows)
    if loss:
        text += (
            f"\n\nLoss: off {loss['off']:.8g}, on {loss['on']:.8g}, |diff| {loss['abs_diff']:.3g} "
            f"({'within' if loss['within_contract'] else '**outside**'} the contract)."
        )
    return text


def _meta_markdown(off: StepLog, on: StepLog) -> str:
    parts = []
    for log, side in ((off, "off"), (on, "on")):
        if not log.meta:
            continue
        meta = dict(log.meta)
        env = meta.pop("environment", {})
        if not isinstance(env, dict):
            meta["environment"], env = env, {}
        config = meta.pop("config", None)
        lines = [f"**{side}** ({log.path.name})", ""]
        lines += [f"- {k}: `{v}`" for k, v in meta.items()]
        lines += [f"- {k}: `{v}`" for k, v in env.items()]
        if config is not None:
            lines += ["", "Resolved config:", "", "```json", json.dumps(config, indent=1), "```"]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "No metadata files (`<log>.meta.json`) beside the logs."


def _relative(path: Path, base: Path) -> str:
    """``path`` relative to the report's directory when it lies inside it (reports travel)."""
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def write_report(
    off_path: str | Path,
    on_path: str | Path,
    out_dir: str | Path,
    *,
    title: str = "rl-kernel off vs on",
    sections: Sequence[tuple[str, str]] = (),
    warmup_steps: int = 1,
) -> Path:
    """Write ``report.md``, ``comparison.json`` and the PNG plots for two step logs into ``out_dir``.

    ``sections``: extra ``(heading, markdown)`` pairs placed after the summary;
    ``warmup_steps``: leading steps left out of the timing statistics (see :func:`compare_table`;
    the plots show every step). Returns the report's path.
    """
    off, on = read_step_log(off_path), read_step_log(on_path)
    check_comparable(off, on)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = compare_table(off, on, warmup_steps)
    plots = write_plots(off, on, out_dir, warmup_steps)

    names = {side: _relative(log.path, out_dir) for log, side in ((off, "off"), (on, "on"))}
    lines = [
        f"# {title}",
        "",
        f"- off: `{names['off']}` ({off.steps} steps)",
        f"- on: `{names['on']}` ({on.steps} steps)",
    ]
    for log, side in ((off, "off"), (on, "on")):
        if log.oom:
            lines.append(f"- **{side} ran out of memory at step {log.oom[0]}** (caught and recorded): `{log.oom[1]}`")
        if log.skipped_partial:
            lines.append(f"- {side}: an unterminated last line was skipped (interrupted run)")
    for warning in step_warnings(off, on):
        lines.append(f"- **warning:** {warning}")
    warm = (
        f" Timings (step and module times, tokens/s) leave out the first {warmup_steps} step(s) of each run "
        "(compilation, autotuning, allocator growth); the plots show every step."
        if warmup_steps
        else ""
    )
    lines += [
        "",
        "## Summary",
        "",
        "Statistics over steps; on/off is given as the ratio of the means and of the medians (a few slow steps "
        f"move the mean, not the median).{warm}",
        "",
    ]
    lines.append(
        _md_table(
            ["metric", "off mean", "off median", "on mean", "on median", "on/off (means)", "on/off (medians)"],
            [
                [r["metric"]]
                + [_fmt(r[s].get(q)) for s in ("off", "on") for q in ("mean", "p50")]
                + [_fmt(r["on_over_off"]), _fmt(r["on_over_off_median"])]
                for r in rows
                if r["metric"] in HEADLINE
            ],
        )
    )
    noise = timing_noise(rows)
    lines += [
        "",
        "**Timing noise.** "
        + (
            "; ".join(noise) + "."
            if noise
            else "No timing series has overlapping off and on spreads (min..max over steps). "
            "Each side is one run: the noise between repeated runs is not measured."
        ),
    ]
    modules = [r for r in rows if r["metric"].removeprefix("region/") in MODULES and r["metric"].startswith("region/")]
    if modules:
        modules.sort(key=lambda r: MODULES.index(r["metric"].removeprefix("region/")))
        lines += [
            "",
            "## Per-module time (ms per step)",
            "",
            "Each run's min, median and max over steps; \"overlap\": the two runs' ranges overlap, so the "
            "ratio is within the step-to-step noise.",
            "",
        ]
        lines.append(
            _md_table(
                [
                    "module",
                    "off min",
                    "off median",
                    "off max",
                    "on min",
                    "on median",
                    "on max",
                    "on/off (medians)",
                    "on/off (means)",
                    "spread",
                ],
                [
                    [r["metric"].removeprefix("region/")]
                    + [_fmt(r[s].get(q)) for s in ("off", "on") for q in ("min", "p50", "max")]
                    + [
                        _fmt(r["on_over_off_median"]),
                        _fmt(r["on_over_off"]),
                        "-" if r["spreads_overlap"] is None else ("overlap" if r["spreads_overlap"] else "apart"),
                    ]
                    for r in modules
                ],
            )
        )
    for heading, body in sections:
        lines += ["", f"## {heading}", "", body]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{caption}]({name})" for name, caption in plots]
    lines += [
        "",
        "## All metrics",
        "",
        "```",
        text_table(rows),
        "```",
        "",
        "## Environment and configuration",
        "",
        _meta_markdown(off, on),
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    summary = {
        "off": names["off"],
        "on": names["on"],
        "steps": {"off": off.steps, "on": on.steps},
        "timing_warmup_steps": warmup_steps,
        "timing_noise": noise,
        "warnings": step_warnings(off, on),
        "oom": {"off": off.oom, "on": on.oom},
        "skipped_partial_lines": {"off": off.skipped_partial, "on": on.skipped_partial},
        "rows": rows,
    }
    (out_dir / "comparison.json").write_text(
        json.dumps(json_safe(summary), indent=2, allow_nan=False), encoding="utf-8"
    )
    return path
