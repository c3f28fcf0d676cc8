"""The native sources compile for sm_90 on a machine without a GPU (nvcc and a C++ compiler only)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_native_sources_compile_for_sm90():
    proc = subprocess.run([sys.executable, "-m", "rl_kernel_core.native", "check", "--arch", "90"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sources compiled for sm_90" in proc.stdout
