"""The README's API example runs as written (a claim in the README is a claim we test)."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_api_example_runs():
    text = README.read_text(encoding="utf-8")
    match = re.search(r"```python\n(import torch, rl_kernel_core as rk\n.*?)```", text, re.S)
    assert match, "README lost its API example"
    scope: dict = {}
    exec(compile(match.group(1), "README.md", "exec"), scope)
    assert torch.isfinite(scope["loss"]) and scope["hidden"].grad is not None
    assert scope["toks"].shape == (8,) and scope["toklp"].dtype == torch.float32
