"""Both settings of a real-engine consistency run, each in a fresh process: ``python -m
rl_kernel_vllm.consistency`` with the rollout's switches off (the control group: vLLM and the
trainer as shipped) and on (both switches), then a few lines of text and a chart of the gaps. What
``rl-kernel consistency --engine vllm`` prints; it imports nothing of vLLM or of the adapter
(the engine runs in the child processes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Sequence

ENGINE_MODULE = "rl_kernel_vllm.consistency"
"""The module each setting runs as (``python -m``)."""

MODE_ENV = {"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_BATCH_INVARIANT": "1"}
"""The rollout side's switches for the mode-on run."""


def off_and_on(model: str, args: Sequence[str], workdir: str, timeout_s: float = 3600) -> dict[str, Any]:
    """Run :data:`ENGINE_MODULE` twice in fresh processes, mode off (control) and on, with the extra
    command line ``args``; returns ``{"off": report, "on": report, "passed": on-gap == 0}``.

    Raises:
        RuntimeError: a run failed (its exit code and the tail of its output).
    """
    reports: dict[str, Any] = {}
    for name, on in (("off", False), ("on", True)):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_VLLM", "VLLM_BATCH_INVARIANT"))}
        env.update(MODE_ENV if on else {})
        out = os.path.join(workdir, f"engine_{name}.json")
        cmd = [sys.executable, "-m", ENGINE_MODULE, "--model", model, "--out", out, *args] + (
            ["--batch-invariant"] if on else []
        )
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(
                f"the mode-{name} engine run exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
            )
        with open(out, encoding="utf-8") as f:
            reports[name] = json.load(f)
    reports["passed"] = reports["on"]["gap"]["max"] == 0.0
    return reports


def text(pair: dict[str, Any]) -> str:
    """A few lines: per mode the per-token gap and vLLM's throughput."""
    lines = []
    for name in ("off", "on"):
        gap, rollout = pair[name]["gap"], pair[name]["rollout"]
        lines.append(
            f"mode {name:3s}: |rollout - training| max {gap['max']:.3g} mean {gap['mean']:.3g}, "
            f"{100 * gap['equal_fraction']:.2f}% of {gap['tokens']} tokens equal; vLLM {rollout['tokens_per_s']:.0f} tokens/s"
        )
    lines.append("bitwise equal with the mode on" if pair["passed"] else "NOT bitwise equal with the mode on")
    return "\n".join(lines)


def plot(pair: dict[str, Any], path: str) -> None:
    """A PNG: tokens per gap decade (exact equality first), mode off vs on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(
        {k for name in ("off", "on") for k in pair[name]["gap"]["histogram_log10"]},
        key=lambda k: -math.inf if k == "0" else float(k[2:]),
    )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.4
    for i, name in enumerate(("off", "on")):
        counts = [pair[name]["gap"]["histogram_log10"].get(k, 0) for k in keys]
        ax.bar([j + (i - 0.5) * width for j in range(len(keys))], counts, width, label=f"mode {name}")
    ax.set_xticks(range(len(keys)), ["equal" if k == "0" else k for k in keys])
    ax.set_xlabel("|rollout - training| per token")
    ax.set_ylabel("tokens")
    settings = pair["on"]["settings"]
    ax.set_title(f"vLLM rollout vs trainer log-probs ({settings['dtype']}, {pair['on']['versions'].get('gpu', 'cpu')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
