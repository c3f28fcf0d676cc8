"""The toolkit the framework adapters (``rl_kernel_vllm``, ``rl_kernel_verl``, ``rl_kernel_vime``) share.

Standard library only.

* Targets by import path: ``"package.module:Attr.path"``. :func:`resolve` returns the object
  there (inherited class attributes included), :func:`locate` the owner, name and stored value of
  an attribute to patch (which must be defined on its owner itself: replacing an inherited
  attribute would patch a different class than the one named). Both raise :class:`TargetMissing`
  naming the target and the step that failed.
* :class:`Patches`: idempotent attribute patches, by-name rebinding and post-import hooks of one
  adapter, with an exact :meth:`Patches.restore`.
* The strict switch: :func:`strict_switch` reads an adapter's ``*_STRICT`` variable through the
  one boolean parser (:mod:`rl_kernel_core.switches`); :func:`refuse_or_warn` turns a problem into
  an error in strict mode and into one logged warning otherwise.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Optional

from rl_kernel_core.switches import env_flag

ORIGINAL_ATTR = "__rl_kernel_original__"
"""Set on every replacement :meth:`Patches.install` makes: the value it replaced."""

_ABSENT = object()


class TargetMissing(LookupError):
    """A target's module or attribute does not exist in the installed framework (the message says which)."""


def _split(target: str) -> tuple[str, list[str]]:
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"target must look like 'package.module:Attr.path', got {target!r}")
    return module_name, attr_path.split(".")


def _import(target: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetMissing(f"{target}: cannot import {module_name} ({type(exc).__name__}: {exc})") from exc


def _name(obj: Any) -> str:
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


def _walk(target: str, module_name: str, attrs: list[str]) -> Any:
    obj: Any = _import(target, module_name)
    for attr in attrs:
        if not hasattr(obj, attr):
            raise TargetMissing(f"{target}: {_name(obj)} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    return obj


def resolve(target: str) -> Any:
    """The object at ``target`` (``"module:Attr.path"``), inherited class attributes included.

    Raises:
        ValueError: ``target`` is not of the form ``module:attr[.attr...]``.
        TargetMissing: the module cannot be imported or an attribute on the path is absent.
    """
    module_name, attrs = _split(target)
    return _walk(target, module_name, attrs)


def locate(target: str) -> tuple[Any, str, Any]:
    """``(owner, attribute name, stored value)`` of the attribute ``target`` names, for patching.

    On a class the attribute must be in the class's own ``__dict__`` and the stored value is the
    raw entry (a ``staticmethod``/``classmethod`` object, not the bound function).

    Raises:
        ValueError, TargetMissing: as :func:`resolve`; also when a class only inherits the attribute.
    """
    module_name, attrs = _split(target)
    *parents, name = attrs
    owner = _walk(target, module_name, parents)
    if isinstance(owner, type):
        if name not in vars(owner):
            raise TargetMissing(f"{target}: {_name(owner)} defines no attribute {name!r}")
        return owner, name, vars(owner)[name]
    if not hasattr(owner, name):
        raise TargetMissing(f"{target}: {_name(owner)} defines no attribute {name!r}")
    return owner, name, getattr(owner, name)


def is_patched(value: Any) -> bool:
    """Whether ``value`` is a replacement made by :meth:`Patches.install`."""
    return hasattr(value, ORIGINAL_ATTR)


def strict_switch(variable: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """An adapter's strict switch: environment variable ``variable`` through the one boolean parser.

    Unset or empty is off. Raises :class:`rl_kernel_core.switches.SwitchError` for an unaccepted value.
    """
    return env_flag(variable, False, environ)


_warned: set[tuple[str, str]] = set()


def refuse_or_warn(
    message: str, *, strict: bool, error: type[Exception], logger: logging.Logger, hint: str = ""
) -> None:
    """Strict mode: raise ``error(message)``. Otherwise log ``message`` (plus ``hint``) once per
    logger and message, and return so the caller can leave the framework's code in place."""
    if strict:
        raise error(message)
    key = (logger.name, message)
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s%s", message, f" ({hint})" if hint else "")


class ImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that finds nothing itself: for the modules it watches, it lets
    the other finders find them and calls ``on_import(module)`` right after each executes.

    ``before(name)``, when given, runs first and may raise (an ``ImportError`` fails the import
    before the module's code runs). ``once``: the hook steps off ``sys.meta_path`` after the first
    module it wraps.
    """

    def __init__(
        self,
        modules: Iterable[str],
        on_import: Callable[[ModuleType], None],
        *,
        once: bool = False,
        before: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.modules = frozenset(modules)
        self.on_import = on_import
        self.once = once
        self.before = before
        self._busy = threading.local()

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in self.modules:
            return None
        if self.before is not None:
            self.before(fullname)
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, self.on_import)
        if self.once:
            self.remove()
        return spec

    def install(self) -> None:
        """Put the hook first on ``sys.meta_path`` (no-op when it is there)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        """Take the hook off ``sys.meta_path`` (no-op when it is not there)."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader, then hands the executed module to the hook."""

    def __init__(self, inner: importlib.abc.Loader, on_import: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._on_import = on_import

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._on_import(module)

    def __getattr__(self, name: str):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


def _loaded(package: str) -> list[tuple[str, ModuleType]]:
    return [
        (n, m) for n, m in list(sys.modules.items()) if m is not None and (n == package or n.startswith(package + "."))
    ]


class Patches:
    """The changes one adapter made to a framework in this process, undone exactly by :meth:`restore`.

    Every replaced attribute (class, module or by-name binding in another module), every change
    recorded with :meth:`on_restore` and every import hook is kept in order; :meth:`restore`
    undoes them newest first (an attribute that did not exist is deleted again) and takes the
    hooks off ``sys.meta_path``.
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._hooks: list[ImportHook] = []
        self._unbind: dict[int, tuple[Any, Any]] = {}  # id(replacement) -> (replacement, original)
        self._packages: set[str] = set()
        self._lock = threading.RLock()

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering the value it replaces (the raw class entry)."""
        with self._lock:
            stored = vars(owner).get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name, _ABSENT)

            def undo() -> None:
                if stored is not _ABSENT:
                    setattr(owner, name, stored)
                elif name in vars(owner):
                    delattr(owner, name)

            self._undo.append(undo)
            setattr(owner, name, value)

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Record a change made another way (a framework's own registration call): :meth:`restore`
        calls ``undo`` in its turn."""
        with self._lock:
            self._undo.append(undo)

    def install(self, target: str, make: Callable[[Any], Any]) -> str:
        """Replace ``target`` by ``make(original)`` unless it already holds such a replacement.

        ``make`` receives the value as stored (see :func:`locate`); the replacement gets
        :data:`ORIGINAL_ATTR` set to it. Returns ``"patched"`` or ``"already patched"`` (vLLM and
        others may load a plugin twice in one process). Raises :class:`TargetMissing`.
        """
        with self._lock:
            owner, name, current = locate(target)
            if is_patched(current):
                return "already patched"
            replacement = make(current)
            setattr(replacement, ORIGINAL_ATTR, current)
            self.set(owner, name, replacement)
            return "patched"

    def rebind(self, pairs: Iterable[tuple[Any, Any]], package: str) -> list[str]:
        """Replace by-name imports of originals in the loaded modules of ``package`` (and its submodules).

        ``pairs`` holds ``(original, replacement)``: every module attribute holding an original
        (``from pkg.mod import fn``) is set to its replacement. :meth:`restore` also puts the
        original back wherever a module of ``package`` imported the replacement itself by name
        (a module loaded after the patch). Returns the ``"module.attr"`` names rebound.
        """
        by_original = {}
        with self._lock:
            for original, replacement in pairs:
                by_original[id(original)] = replacement
                self._unbind[id(replacement)] = (replacement, original)
            self._packages.add(package)
        done = []
        for module_name, module in _loaded(package):
            for attr, value in list(vars(module).items()):
                replacement = by_original.get(id(value))
                if replacement is not None and replacement is not value:
                    self.set(module, attr, replacement)
                    done.append(f"{module_name}.{attr}")
        return done

    def add_import_hook(self, hook: ImportHook) -> ImportHook:
        """Install ``hook`` first on ``sys.meta_path``; :meth:`restore` removes it. Returns ``hook``."""
        with self._lock:
            self._hooks.append(hook)
        hook.install()
        return hook

    def restore(self) -> None:
        """Take every import hook off ``sys.meta_path`` and undo every change, newest first."""
        with self._lock:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            while self._undo:
                self._undo.pop()()
            for package in self._packages:
                for _, module in _loaded(package):
                    for attr, value in list(vars(module).items()):
                        pair = self._unbind.get(id(value))
                        if pair is not None and pair[0] is value:
                            setattr(module, attr, pair[1])
            self._unbind.clear()
            self._packages.clear()

    def __len__(self) -> int:
        """The number of changes :meth:`restore` would undo."""
        return len(self._undo)
