"""Named, idempotent attribute patches on vLLM.

A target is written ``"package.module:Attr.path"``: the module is imported, the dotted path is
walked, and the last attribute is replaced by ``make(original)``. The replacement carries its
original in ``__rl_kernel_original__``; a target whose current value already carries it is left
alone, so installing twice (vLLM may load plugins twice in one process) changes nothing.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

ORIGINAL_ATTR = "__rl_kernel_original__"


class TargetMissing(LookupError):
    """A target's module or attribute does not exist in the installed vLLM (the message says which)."""


def resolve(target: str) -> tuple[Any, str, Any]:
    """``(owner, attribute name, current value)`` of ``target`` (``"module:Attr.path"``).

    Raises:
        ValueError: ``target`` is not of the form ``module:attr[.attr...]``.
        TargetMissing: the module cannot be imported or an attribute on the path is absent.
    """
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"target must look like 'package.module:Attr.path', got {target!r}")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetMissing(f"{target}: cannot import {module_name} ({type(exc).__name__}: {exc})") from exc
    *parents, name = attr_path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            raise TargetMissing(f"{target}: {getattr(owner, '__name__', owner)!s} has no attribute {part!r}")
        owner = getattr(owner, part)
    # On a class, require the attribute to be defined there, not inherited: replacing an
    # inherited attribute would silently patch a different class than the one named.
    defined = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
    if not defined:
        raise TargetMissing(f"{target}: {getattr(owner, '__name__', owner)!s} defines no attribute {name!r}")
    current = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    return owner, name, current


def is_patched(value: Any) -> bool:
    """Whether ``value`` is a replacement installed by :func:`install`."""
    return hasattr(value, ORIGINAL_ATTR)


def install(target: str, make: Callable[[Any], Any]) -> str:
    """Replace ``target`` by ``make(original)`` unless it is already patched.

    ``make`` receives the value as stored (for a class attribute: the raw ``staticmethod``/
    function object from the class ``__dict__``) and returns the replacement, on which this
    function sets ``__rl_kernel_original__``.

    Returns:
        ``"patched"`` or ``"already patched"``.

    Raises:
        TargetMissing: see :func:`resolve`.
    """
    owner, name, current = resolve(target)
    if is_patched(current):
        return "already patched"
    replacement = make(current)
    setattr(replacement, ORIGINAL_ATTR, current)
    setattr(owner, name, replacement)
    return "patched"
