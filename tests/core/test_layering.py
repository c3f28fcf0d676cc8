"""The package's import graph: every module imports alone (no cycle), and no module imports a layer above its own.

Layers, bottom up: standalone helpers (the manifest of ops, switches, adapters, codes, checks, contract, the native
build), op definitions (``opdef``, a family's ``opdef.py`` and the backend-neutral ``linear/chunks.py``),
``dispatch``, the reference backend, the fast backends (Triton and native never import each other, except
``linear/triton_sm90.py``, which loads the Hopper CUDA passes the Triton route runs from ``native``;
FlashInfer's sampler takes its log-probs from the Triton kernel), the public
ops, and the tools on top (CLI, benchmarks' helpers, profiling, report, consistency). An op family's package
(:data:`FAMILIES`) holds one file per layer, named for it (:data:`FAMILY_ROLES`: ``api.py``, ``opdef.py``,
``reference.py``, ``triton.py``, ``native.py``, ``flashinfer.py``; ``<role>_<part>.py`` for a role split over files,
:data:`PART_ROLES`), and its ``__init__.py`` imports nothing. Every import counts, a function's lazy one too (only dispatch's ``importlib``, which loads backends by
name, is not an import statement); no module of the core imports an adapter package
(``rl_kernel_vllm``, ``rl_kernel_verl``, ``rl_kernel_vime``).

The tests: no module under tests/ imports a test module (helpers shared by test modules live in
tests/core/oracles.py and each tier's helper modules).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rl_kernel_core"
TESTS = PACKAGE.parent / "tests"
LAYERS: list[tuple[str, ...]] = [
    (
        "ops",
        "switches",
        "adapters",
        "loss_codes",
        "_checks",
        "contract",
        "native_build",
        "digest",
        "spans",
        "argtypes",
        "tiles",
    ),
    ("opdef",),
    ("dispatch", "profiling"),
    ("reference",),
    ("triton", "native"),
    ("attention", "invariance"),
    ("tools", "cli", "report", "consistency", "multimodal"),
]
"""The layers of the modules outside the op families' packages, by their first name under ``rl_kernel_core``;
the last is the tools' (``rl_kernel_core/tools/`` and the old paths ``cli.py``, ``report.py``, ``consistency/``,
``multimodal/`` that re-export from it and from the batch-invariant mode's family)."""
TOOLS: tuple[str, ...] = LAYERS[-1]
FAMILIES: tuple[str, ...] = ("linear", "batch_invariant_mode", "logprob", "loss", "advantages", "sampling")
"""The op families' packages (``rl_kernel_core/<family>/``), one per family (CONTRIBUTING.md, "Map")."""
FAMILY_ROLES: dict[str, tuple[int, str]] = {
    "opdef": (1, "opdef"),
    "chunks": (1, "opdef"),
    "reference": (3, "reference"),
    "triton": (4, "triton"),
    "native": (4, "native"),
    "flashinfer": (4, "flashinfer"),
    "api": (5, "api"),
}
"""``{file name in a family's package: (its layer, its backend or role)}``."""
PART_ROLES: tuple[str, ...] = ("api", "reference", "triton", "flashinfer")
"""Roles a family may split over several files: ``<role>_<part>.py`` has ``<role>``'s layer."""


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _layer(module: str) -> tuple[int, str]:
    """``(layer, name)``: a fast backend's module is named by its backend (``triton``, ``native``,
    ``flashinfer``), so that modules of different backends can be told apart."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top in FAMILIES:
        if len(parts) == 2:  # the family's __init__.py, which imports nothing
            return 0, top
        role = next((r for r in PART_ROLES if parts[2].startswith(f"{r}_")), parts[2])
        if role not in FAMILY_ROLES:
            raise AssertionError(f"{module}: a family's module is named for its layer (FAMILY_ROLES)")
        return FAMILY_ROLES[role]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i, top
    raise AssertionError(f"{module} is in no layer of this test; add it to LAYERS")


def _path(module: str) -> Path:
    rel = Path(*module.split("."))
    path = PACKAGE.parent / rel.with_suffix(".py")
    return path if path.exists() else PACKAGE.parent / rel / "__init__.py"


def _imports(module: str) -> set[str]:
    """The ``rl_kernel_core`` modules ``module`` imports anywhere (at module level or in a function)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(_path(module).read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("rl_kernel_core.") and m.count(".") >= 1 and _is_module(m)}


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel.with_suffix(".py")).exists() or (PACKAGE.parent / rel / "__init__.py").exists()


def test_no_module_imports_a_layer_above_its_own():
    violations = []
    for module in _modules():
        if module == "rl_kernel_core":
            continue
        level, family = _layer(module)
        for imported in _imports(module):
            their_level, their_family = _layer(imported)
            sideways = (
                their_level == level == 4
                and their_family != family
                and (family, their_family) != ("flashinfer", "triton")
                and (module, their_family) != ("rl_kernel_core.linear.triton_sm90", "native")
            )
            if their_level > level or sideways:
                violations.append(f"{module} (layer {level}) imports {imported} (layer {their_level})")
    assert not violations, "\n".join(violations)


def test_no_operator_module_imports_a_tool():
    """The tools sit above the operators: what the adapters and trainers run never needs them."""
    violations = [
        f"{module} imports {imported}"
        for module in _modules()
        if _top(module) not in TOOLS
        for imported in _imports(module)
        if _top(imported) in TOOLS
    ]
    assert not violations, "\n".join(violations)


def test_no_import_cycle():
    """No circle of imports, lazy ones counted (dispatch's ``importlib`` loads of backends are not imports)."""
    graph = {module: _imports(module) for module in _modules() if module != "rl_kernel_core"}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return []
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported, path + [module])
            if cycle:
                return cycle
        done.add(module)
        return []

    cycles = [" -> ".join(c) for c in (visit(m, []) for m in sorted(graph)) if c]
    assert not cycles, "\n".join(cycles)


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_core_imports_no_adapter():
    adapters = ("rl_kernel_vllm", "rl_kernel_verl", "rl_kernel_vime")
    violations = [
        f"{module} imports {name}"
        for module in _modules()
        for name in _imported_names(ast.parse(_path(module).read_text()))
        if name.split(".")[0] in adapters
    ]
    assert not violations, "\n".join(violations)


def _import_alone(module: str) -> str | None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env, timeout=300
    )
    if proc.returncode == 0:
        return None
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    # a native family module (a family's native.py) cannot build without CUDA, the FlashInfer module needs FlashInfer:
    # their ImportError is the reason dispatch reports, by design
    optional = (
        module.startswith("rl_kernel_core.native.")
        or module.split(".")[1:] in ([f, "native"] for f in FAMILIES)
        or module == "rl_kernel_core.sampling.flashinfer"
    )
    if optional and last.startswith(("ImportError:", "ModuleNotFoundError: No module named 'flashinfer'")):
        return None
    return f"{module}: {last}"


@pytest.mark.parametrize("chunk", range(2))
def test_every_module_imports_alone(chunk):
    modules = [m for i, m in enumerate(_modules()) if i % 2 == chunk]
    with ThreadPoolExecutor(2) as pool:
        failures = [f for f in pool.map(_import_alone, modules) if f]
    assert not failures, "\n".join(failures)


def _imported_names(tree: ast.AST) -> list[str]:
    """Every module or name any import statement (or ``importlib.import_module("...")``) in ``tree`` names."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [node.module or ""] + [a.name for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    return names


def test_no_test_module_imports_a_test_module():
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")}
    violations = [
        f"{path.relative_to(TESTS.parent)} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in _imported_names(ast.parse(path.read_text()))
        if set(name.split(".")) & test_modules or name.split(".")[0] == "tests"
    ]
    assert not violations, "\n".join(violations)


def test_kernels_choose_compiled_or_interpreted_at_launch():
    """``triton.jit`` binds a kernel to the compiler or the interpreter when its module is imported;
    a kernel module imported before a CPU test sets ``TRITON_INTERPRET=1`` would then ask for a GPU
    driver. Kernels use ``rl_kernel_core.triton._jit``'s ``launch_time_jit`` / ``helper_jit``."""
    bound = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", None) == "triton":
                bound.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bound, f"triton.jit at {bound}: use launch_time_jit or helper_jit"
