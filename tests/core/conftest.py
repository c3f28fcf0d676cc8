"""The ``backend`` fixture of the op tests (``tests/core/ops``); pytest also puts this folder on
``sys.path``, so tests below it import the shared helpers (``oracles``, ``op_backends``)."""

from __future__ import annotations

import pytest

from op_backends import Backend


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    """The :class:`op_backends.Backend` a test is parametrised with (``op_backends.on_backends``):
    Triton on CPU runs in its interpreter (``TRITON_INTERPRET=1`` for this test; kernels built
    with ``launch_time_jit`` choose at launch), on CUDA it compiles."""
    chosen: Backend = request.param
    if chosen.interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif chosen.device == "cuda":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return chosen
