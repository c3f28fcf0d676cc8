"""Build and load the CUDA extension compiled from ``native/csrc``; say why when it can't.

Importing this module loads the extension (JIT-compiled with ``torch.utils.cpp_extension`` into
``$RL_KERNEL_CACHE`` or ``~/.cache/rl-kernel/native`` on first use) and imports the modules
that register its ops with :mod:`rl_kernel_core.dispatch`. When it cannot (no CUDA device, a
CPU-only PyTorch, no sources in this checkout, a compiler error), the import raises
``ImportError`` whose message is the reason; dispatch records that reason, ``rl-kernel info``
prints it, and an explicit ``backend="native"`` raises it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).resolve().parent.parent / "native" / "csrc"


def cache_dir() -> Path:
    """Where JIT builds of the extension are kept."""
    return Path(os.environ.get("RL_KERNEL_CACHE", Path.home() / ".cache" / "rl-kernel" / "native"))


def unavailable_reason() -> str | None:
    """Why the native extension cannot be built here, or None when a build can be attempted."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"PyTorch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    sources = sorted(SOURCE_DIR.glob("*.cu")) if SOURCE_DIR.is_dir() else []
    if not sources:
        return "no CUDA sources (*.cu) in native/csrc of this installation"
    return None


_reason = unavailable_reason()
if _reason is not None:
    raise ImportError(_reason)
raise ImportError("the native extension has no ops registered in this version")
