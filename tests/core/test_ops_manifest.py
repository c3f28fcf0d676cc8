"""The manifest of ops (``rl_kernel_core.ops``) is what the package exports, its glue kinds are what the backends define, and every op has its test module."""

import importlib
from pathlib import Path

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import ops
from rl_kernel_core.ops import OpSpec

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parents[1] / "rl_kernel_core"


def test_the_package_exports_every_public_op_and_other_name_from_its_module():
    assert rk.__all__ == sorted(ops.exports())
    assert not set(ops.OPS) & set(ops.OTHER_EXPORTS)
    for name, module in ops.exports().items():
        assert getattr(rk, name) is getattr(importlib.import_module(module), name)


def test_glue_kinds_are_the_custom_ops_the_triton_backend_defines():
    pytest.importorskip("triton")
    for module in ops.modules("triton").values():
        importlib.import_module(module)
    for spec in ops.OPS.values():
        if "triton" not in spec.backends:
            continue
        forward = hasattr(torch.ops.rl_kernel, f"triton_{spec.name}")
        backward = hasattr(torch.ops.rl_kernel, f"triton_{spec.name}_backward")
        expected = {"differentiable_custom_op": (True, True), "custom_op": (True, False)}.get(spec.glue, (False, False))
        assert (forward, backward) == expected, f"{spec.name}: glue {spec.glue!r}"


def test_each_native_module_loads_the_extension_of_its_ops_group():
    """A native backend module loads one extension (``extension("<group>")``, built by native_build
    from the manifest's groups): the group its ops declare in the manifest."""
    import importlib.util

    for spec in ops.OPS.values():
        if "native" not in spec.backends:
            continue
        found = importlib.util.find_spec(spec.backends["native"])
        assert found is not None and found.origin is not None, spec.backends["native"]
        source = Path(found.origin).read_text()
        assert f'extension("{spec.native_group}")' in source, (spec.name, spec.native_group, spec.backends["native"])
    assert set(ops.native_groups()) == {spec.native_group for spec in ops.OPS.values()} - {None}


def test_every_op_has_its_test_module():
    """Each op of the manifest has ``test_<op>.py`` in its family's test folder ``tests/core/<family>/``,
    the family whose package ``rl_kernel_core/<family>/`` holds its modules (its Triton module's family
    first, then its public function's; CONTRIBUTING.md, "Adding an op")."""
    missing = [
        f"tests/core/{folder.name}/test_{spec.name}.py"
        for spec in ops.OPS.values()
        if not ((folder := _test_folder(spec)) / f"test_{spec.name}.py").is_file()
    ]
    assert not missing, f"ops without their test module: {missing}"


SHARED_PACKAGES = ("opdef", "reference", "triton", "native", "tools", "consistency", "multimodal")
"""The packages of ``rl_kernel_core`` that are no op family's (shared machinery and tools)."""


def _test_folder(spec: OpSpec) -> Path:
    for module in (spec.backends.get("triton"), spec.public_module):
        parts = (module or "").split(".")
        if len(parts) > 2 and parts[1] not in SHARED_PACKAGES and (PACKAGE / parts[1] / "__init__.py").is_file():
            return TESTS / parts[1]
    raise AssertionError(f"{spec.name}: no module in a family's package (rl_kernel_core/<family>/)")


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(backends={"triton": "m"}, glue="function"), "must include torch"),
        (dict(backends={"torch": "m", "cuda": "m"}, glue="function"), r"must name backends from .* got \['cuda'\]"),
        (
            dict(backends={"torch": "m", "native": "m"}, glue="function"),
            "native_group of test_op must be set exactly when native",
        ),
        (dict(backends={"torch": "m"}, glue="function", native_group="loss"), "native_group of test_op"),
        (dict(backends={"torch": "m"}, glue="kernel"), "glue of test_op must be one of"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        OpSpec("test_op", None, **fields)
