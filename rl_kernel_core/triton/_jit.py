"""Triton kernels that pick compiled or interpreted execution when they are launched.

``triton.jit`` decides between the compiler and the CPU interpreter once, when the decorator
runs (it reads ``TRITON_INTERPRET`` at import time). A kernel module imported before a test sets
``TRITON_INTERPRET=1`` would then try to compile for a GPU that is not there, and one imported
under the interpreter could never run compiled. :func:`launch_time_jit` defers the choice to each
launch: ``kernel[grid](...)`` interprets when ``TRITON_INTERPRET=1`` is set at that moment and
compiles otherwise. Both flavours are built lazily from the same Python function.

Helpers: while an interpreted launch runs, every ``JITFunction`` it calls (``triton.language``'s
own ``tl.max``, ``tl.sum``, ``tl.cdiv``... and any :func:`helper_jit` helper of the caller) is
interpreted too, as it would have been had ``TRITON_INTERPRET=1`` been set before Triton was
imported. Our own device functions use :func:`helper_jit` rather than ``triton.jit``, which
would bind them to the interpreter for good when imported under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

from triton.runtime.jit import JITFunction


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` is set now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_interpreted_helpers: dict = {}


def _call_interpreted(self: JITFunction, *args, **kwargs):
    """``JITFunction.__call__`` inside an interpreted launch: run the helper in the interpreter.

    As ``InterpretedFunction.__call__`` does, but the interpreter's patches of
    ``triton.language`` are undone when the helper returns (Triton 3.6 leaves them in place,
    after which a compiled launch or ``triton.compile`` of any kernel in the process fails)."""
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang

    helper = _interpreted_helpers.get(self.fn)
    if helper is None:
        helper = _interpreted_helpers[self.fn] = InterpretedFunction(self.fn)
    patches = _patch_lang(helper.fn)
    try:
        return helper.rewrite()(*args, **kwargs)
    finally:
        patches.restore()


def _call_rewritten(self, *args, **kwargs):
    """``InterpretedFunction.__call__`` inside one of our interpreted launches: run the rewritten
    function without re-patching ``triton.language`` on every device-function call (the launch
    patched it once, see :func:`_helpers_interpreted`); the re-patching dominated the run time of
    helper-heavy kernels under the interpreter."""
    return self.rewrite()(*args, **kwargs)


@contextlib.contextmanager
def _helpers_interpreted() -> Iterator[None]:
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang

    original = JITFunction.__call__, InterpretedFunction.__call__
    scope = _patch_lang(standard.sum.fn)  # triton.language.core, which triton.language's own helpers call into
    JITFunction.__call__ = _call_interpreted
    InterpretedFunction.__call__ = _call_rewritten
    try:
        yield
    finally:
        JITFunction.__call__, InterpretedFunction.__call__ = original
        scope.restore()


class LaunchTimeKernel:
    """A Triton kernel whose compiled/interpreted flavour is chosen at each ``kernel[grid]``."""

    def __init__(self, fn: Callable, **jit_kwargs) -> None:
        self.fn = fn
        self._jit_kwargs = jit_kwargs
        self._compiled: Optional[JITFunction] = None
        self._interpreted = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def flavour(self, interpreted: Optional[bool] = None):
        """The JITFunction (compiled) or InterpretedFunction to launch right now (``interpreted``:
        :func:`interpreting`'s answer, where the caller has it)."""
        if interpreting() if interpreted is None else interpreted:
            if self._interpreted is None:
                from triton.runtime.interpreter import InterpretedFunction

                self._interpreted = InterpretedFunction(self.fn, **self._jit_kwargs)
            return self._interpreted
        if self._compiled is None:
            self._compiled = JITFunction(self.fn, **self._jit_kwargs)
        return self._compiled

    def __getitem__(self, grid):
        interpreted = interpreting()  # read once: every routed op launches through here
        kernel = self.flavour(interpreted)
        if not interpreted:
            return kernel[grid]

        def launch(*args, **kwargs):
            with _helpers_interpreted():
                return kernel[grid](*args, **kwargs)

        return launch


def helper_jit(fn: Callable) -> JITFunction:
    """Decorator for a device function called from :func:`launch_time_jit` kernels: always a
    ``JITFunction`` (inlined when the caller compiles, interpreted when the caller is)."""
    return JITFunction(fn)


def launch_time_jit(fn: Optional[Callable] = None, **jit_kwargs):
    """Decorator: like ``triton.jit`` but the compile-or-interpret choice happens per launch."""
    if fn is None:
        return lambda f: LaunchTimeKernel(f, **jit_kwargs)
    return LaunchTimeKernel(fn, **jit_kwargs)
