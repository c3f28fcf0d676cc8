"""The README's API example runs as written (a claim in the README is a claim we test), and the
op x backend table of docs/backends.md matches the manifest of ops."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BACKENDS_DOC = README.parent / "docs" / "backends.md"


def test_readme_api_example_runs():
    text = README.read_text(encoding="utf-8")
    match = re.search(r"```python\n(import torch, rl_kernel_core as rk\n.*?)```", text, re.S)
    assert match, "README lost its API example"
    scope: dict = {}
    exec(compile(match.group(1), "README.md", "exec"), scope)
    assert torch.isfinite(scope["loss"]) and scope["hidden"].grad is not None
    assert scope["toks"].shape == (8,) and scope["toklp"].dtype == torch.float32


def test_backends_doc_coverage_table_matches_dispatch():
    """Each row of docs/backends.md's op x backend table says "no" exactly where the manifest's
    op does not name the backend, and the table lists every op of the manifest."""
    from rl_kernel_core import ops

    text = BACKENDS_DOC.read_text(encoding="utf-8")
    header = "| op | torch | triton | native | flashinfer |"
    assert header in text, "docs/backends.md lost its op x backend table"
    backends = [name.strip() for name in header.strip("|").split("|")[1:]]
    rows = text.split(header, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]
    listed = set()
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for op in re.findall(r"`(\w+)`", cells[0]):
            listed.add(op)
            for backend, cell in zip(backends, cells[1:]):
                assert (backend in ops.OPS[op].backends) == (cell != "no"), (
                    f"docs/backends.md says {backend} {cell!r} for {op}"
                )
    assert listed == set(ops.OPS), sorted(listed ^ set(ops.OPS))


def test_example_uses_one_temperature():
    """The example's log-probs, fused loss and sampling agree on the temperature (mixing them
    would compare log-probs of different distributions)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = text[text.index("```python") :]
    example = example[: example.index("```\n", 9)]
    assert len(set(re.findall(r"temperature=([0-9.]+)", example))) == 1
