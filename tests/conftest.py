"""Shared pytest set-up: the ``gpu`` marker skips cleanly without CUDA."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def seed():
    """A fresh random seed per test (printed on failure through the test id's output)."""
    s = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.seed() % 2**31)))
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
