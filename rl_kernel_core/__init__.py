"""rl-kernel core operators: the public API, re-exported from the modules that hold it.

The re-exports load on first access (PEP 562 ``__getattr__``), so importing a standard-library
module of the package (:mod:`rl_kernel_core.switches`, :mod:`rl_kernel_core.adapters`) does not
import torch: the framework adapters read their switches with them at process start, and an
adapter that is off loads nothing else.
"""

import importlib

from rl_kernel_core import ops

__version__ = "0.1.0"

# public name -> the module that holds it (the manifest's public ops and the other public names)
_EXPORTS: dict[str, str] = ops.exports()

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_kernel_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

