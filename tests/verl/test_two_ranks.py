"""verl's FSDP2 engine on two gloo ranks, untied head sharded across them (``fsdp2_two_ranks.py``).

Runs the script under ``torch.distributed.run`` in fresh processes. Reading the sharded head
weight with a plain ``full_tensor()`` (instead of through the head's FSDP forward) bypasses
FSDP's gradient reduction for the head; here that shows as a gradient norm off by ~4e-4
relative, outside the contract, which this test catches.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import verl_cpu

SCRIPT = Path(__file__).resolve().parent / "fsdp2_two_ranks.py"


def test_two_ranks_sharded_untied_head(tmp_path):
    model_dir = verl_cpu.save_tiny_qwen2(str(tmp_path / "qwen2_untied"), tied=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(SCRIPT),
        model_dir,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}: log-probs, entropies, loss metrics and" in out
