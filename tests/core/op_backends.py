"""The backends an op's shared cases run on, as pytest parameters for the ``backend`` fixture
(tests/conftest.py).

``@on_backends("policy_loss")`` parametrises a test over every backend that serves the op (as
``rl_kernel_core.dispatch`` declares it): ``torch`` on CPU always; ``triton`` on CPU under the
Triton interpreter, and on CUDA compiled (``gpu`` marker); ``native`` on CUDA (``gpu`` marker)
where the op has a native implementation. The test receives a :class:`Backend`: the name to pass
as ``backend=`` and the device its inputs live on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import pytest

from rl_kernel_core import dispatch

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Backend:
    """One place a case runs: ``name`` is the ``backend=`` argument, ``device`` the inputs' device
    (``"cpu"`` with ``name="triton"`` means the Triton interpreter)."""

    name: str
    device: str

    @property
    def interpreted(self) -> bool:
        return self.name == "triton" and self.device == "cpu"


def backends(op: str, *, exclude: Sequence[str] = ()) -> list:
    """``pytest.param`` per backend serving ``op``, minus the ids in ``exclude`` (``"torch"``,
    ``"triton-interpret"``, ``"triton-cuda"``, ``"native-cuda"``)."""
    gpu = pytest.mark.gpu
    params = [pytest.param(Backend("torch", "cpu"), id="torch")]
    if dispatch.serves("triton", op):
        params.append(pytest.param(Backend("triton", "cpu"), id="triton-interpret"))
        params.append(pytest.param(Backend("triton", "cuda"), id="triton-cuda", marks=gpu))
    if dispatch.serves("native", op):
        params.append(pytest.param(Backend("native", "cuda"), id="native-cuda", marks=gpu))
    unknown = set(exclude) - {p.id for p in params}
    if unknown:
        raise ValueError(f"exclude must name backends serving {op}, got {sorted(unknown)}")
    return [p for p in params if p.id not in exclude]


def on_backends(op: str, *, exclude: Sequence[str] = ()) -> Callable[[F], F]:
    """Run the decorated test once per backend of :func:`backends` (the ``backend`` fixture)."""
    return pytest.mark.parametrize("backend", backends(op, exclude=exclude), indirect=True)
