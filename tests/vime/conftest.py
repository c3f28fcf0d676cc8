"""Shared set-up for the vime adapter tests.

vime is not on any package registry: these tests run against the contract stand-in under
``standin/`` (see ``standin/vime/__init__.py``), put first on ``sys.path`` here.
"""

import sys
from pathlib import Path

import pytest
import torch

STANDIN = Path(__file__).parent / "standin"
if str(STANDIN) not in sys.path:
    sys.path.insert(0, str(STANDIN))

import rl_kernel_vime  # noqa: E402
from rl_kernel_vime import fallback, registry  # noqa: E402


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A generator seeded from the per-test random seed."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    """No switch from the outer environment; no patch, fallback record or timing leaks between tests."""
    for name in (
        "VIME_RL_KERNEL",
        "VIME_RL_KERNEL_OPS",
        "VIME_RL_KERNEL_STRICT",
        "VIME_RL_KERNEL_PROFILE",
        "RL_KERNEL_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    fallback.reset()
    yield
    rl_kernel_vime.restore()
    registry.reset_states()
    registry.reset_provider_calls()
    fallback.reset()
    from rl_kernel_core import profiling

    profiling.disable()
