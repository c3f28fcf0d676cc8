"""Peak memory of the reference log-prob paths, measured as the peak RSS of a fresh subprocess
(:func:`measure_peak`; the op tests that bound it skip where ``/proc`` is missing: :data:`skip_without_proc`).

Each case runs in its own interpreter: inputs are built first, then the current RSS is read
(``/proc/self/statm``) and the peak RSS is reset to it (``/proc/self/clear_refs``: a peak reached
while importing or building inputs would otherwise hide the op's own), the op runs forward and
backward, and ``VmHWM`` (``/proc/self/status``) gives the peak. The extra peak is ``VmHWM - RSS
before``. Memory only, never a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

skip_without_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc (Linux)")

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import rl_kernel_core as rk
    linear_logprob, logprob_from_logits = rk.linear_logprob, rk.logprob_from_logits  # loaded before measuring

    case, n, v, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)

    def rss_bytes():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def peak_rss_bytes():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    if case in ("reference", "naive"):
        hidden = torch.randn(n, d, requires_grad=True)
        weight = (torch.randn(v, d) * d**-0.5).requires_grad_()
        targets = torch.randint(0, v, (n,))
        grad_out = torch.rand(n) + 0.5
        inputs = (hidden, weight)
    else:
        logits = torch.randn(n, v, dtype=torch.bfloat16).mul_(3).requires_grad_()
        targets = torch.randint(0, v, (n,))
        grad_out = torch.rand(n) + 0.5
        inputs = (logits,)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_bytes()
    peak_before = peak_rss_bytes()
    if case == "reference":
        lp = linear_logprob(hidden, weight, targets, backend="torch")
    elif case == "naive":
        lp = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        lp = logprob_from_logits(logits, targets, backend="torch")
    forward_peak = peak_rss_bytes()
    (lp * grad_out).sum().backward()
    peak = peak_rss_bytes()
    assert all(x.grad is not None for x in inputs)
    print(json.dumps({"before": before, "peak_before": peak_before, "forward_extra": forward_peak - before, "extra": peak - before}))
    """
)


def measure_peak(case: str, n: int, v: int, d: int) -> dict:
    """Run ``case`` (``reference``/``naive``: linear_logprob or the [N, V] log_softmax from hidden
    states; ``from_logits``: logprob_from_logits on bf16 logits) forward and backward in a fresh
    interpreter; bytes: ``before``, ``peak_before``, ``forward_extra``, ``extra``."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, case, str(n), str(v), str(d)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(case, {k: f"{val / 2**20:.0f} MiB" for k, val in result.items()})
    return result
