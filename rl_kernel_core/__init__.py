"""rl-kernel core operators: the public API, re-exported from the modules that hold it.

The re-exports load on first access (PEP 562 ``__getattr__``), so importing a standard-library
module of the package (:mod:`rl_kernel_core.switches`, :mod:`rl_kernel_core.adapters`) does not
import torch, nor anything else of the package: the framework adapters read their switches with
them at process start, and an adapter that is off loads nothing else. What is exported, and from
where, is the manifest's (:func:`rl_kernel_core.ops.exports`).
"""

import importlib
import importlib.util

__version__ = "0.1.0"


def _exports() -> dict[str, str]:
    """``{public name: the module that holds it}``, read from the manifest of ops on first need."""
    return importlib.import_module("rl_kernel_core.ops").exports()


def __getattr__(name: str):
    if name == "__all__":
        return sorted(_exports())
    # `from rl_kernel_core import switches` asks for the attribute before importing the submodule:
    # a submodule's name is left to the import system, without reading the manifest
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(f"module 'rl_kernel_core' has no attribute {name!r} (a submodule, not imported yet)")
    module = _exports().get(name)
    if module is None:
        raise AttributeError(f"module 'rl_kernel_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_exports()))
