"""pytest set-up for the verl tier: verl on CPU (see ``verl_cpu``), one gloo process group,
the tiny models and a session cache of built workers (building one takes a few seconds)."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch.distributed as dist

_spec = importlib.util.find_spec("verl")
if _spec is None or _spec.origin is None:  # not installed (this directory is a namespace package "verl")
    # the tier runs in its own environment: $(scripts/env.sh verl)/bin/python -m pytest tests/verl
    collect_ignore_glob = ["*.py"]
else:
    import verl_cpu  # noqa: F401  (sets verl up on CPU before anything else imports verl)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """One gloo process group of world size 1, and the env verl's ``Worker`` reads."""
    port = str(_free_port())
    os.environ.update(
        WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """``{"tied": path, "untied": path, "moe": path}``: tiny random Qwen2 causal LMs and a tiny Qwen3-MoE."""
    import verl_cpu

    dirs = {
        name: verl_cpu.save_tiny_qwen2(str(tmp_path_factory.mktemp(f"qwen2_{name}")), tied=name == "tied")
        for name in ("tied", "untied")
    }
    dirs["moe"] = verl_cpu.save_tiny_qwen3_moe(str(tmp_path_factory.mktemp("qwen3_moe")))
    return dirs


@pytest.fixture(scope="session")
def build_worker(model_dirs):
    """``build_worker(model, role, *overrides)``: an initialised verl worker, cached per arguments."""
    import verl_cpu

    cache = {}

    def build(model: str, role: str, *overrides: str):
        key = (model, role, overrides)
        if key not in cache:
            cache[key] = verl_cpu.build_worker(model_dirs[model], role, *overrides)
        return cache[key]

    return build
