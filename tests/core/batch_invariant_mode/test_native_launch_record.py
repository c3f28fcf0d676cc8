"""The Python half of the C++ launcher (:mod:`rl_kernel_core.batch_invariant_mode.triton_launch`), on the CPU:
how a compiled kernel's signature becomes the argument kinds the extension packs, which launches
it refuses to take over, the switch and the reason it gives. The launches themselves are GPU tests
(``tests/core/batch_invariant_mode/test_native_launch.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_kernel_core.batch_invariant_mode import triton as tbi
from rl_kernel_core.batch_invariant_mode import triton_launch as native_launch
from rl_kernel_core.switches import SwitchError

_POINTER_NAMES = [
    "a_ptr",
    "b_ptr",
    "bias_ptr",
    "c_ptr",
    "M",
    "N",
    "K",
    "stride_am",
    "stride_ak",
    "stride_bk",
    "stride_bn",
    "stride_cm",
    "stride_cn",
    "n_progs",
]
_TMA_NAMES = ["a_desc", "b_desc", "bias_ptr", "c_desc", "c_ptr", "M", "N", "K", "stride_cm"]


class _FakeExtension:
    """The extension's argument_names (what the C++ plans pass), without a GPU."""

    def argument_names(self):
        return {
            "_persistent_matmul_kernel": _POINTER_NAMES,
            "_tma_matmul_kernel": _TMA_NAMES,
            "_row_stats_kernel": ["x_ptr", "out_ptr", "L", "stride_row", "eps"],
        }


@pytest.fixture
def fake_extension(monkeypatch):
    ext = _FakeExtension()
    monkeypatch.setattr(native_launch, "_ext", ext)
    monkeypatch.setattr(native_launch, "_serving", ext)
    monkeypatch.setattr(native_launch, "_loaded", True)
    monkeypatch.setattr(native_launch, "_checked_kernels", set())
    return ext


def _compiled(signature: dict, **metadata):
    md = dict(
        num_ctas=1,
        launch_pdl=False,
        launch_cooperative_grid=False,
        global_scratch_size=0,
        profile_scratch_size=0,
        num_warps=8,
        shared=196608,
        tensordesc_meta=None,
    )
    md.update(metadata)
    return SimpleNamespace(function=0x1234, metadata=SimpleNamespace(**md), src=SimpleNamespace(signature=signature))


_TMA_SIGNATURE = {
    "a_desc": "tensordesc<bf16[128, 64]>",
    "b_desc": "tensordesc<bf16[256, 64]>",
    "bias_ptr": "*bf16",
    "c_desc": "constexpr",
    "c_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_cm": "i32",
}
"""The TMA matmul kernel's signature as Triton compiles it: bf16 descriptors of 128 x 64 and 256 x 64 tiles."""


def _pointer_signature(**overrides):
    sig = {
        "a_ptr": "*bf16",
        "b_ptr": "*bf16",
        "bias_ptr": "*bf16",
        "c_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_am": "i32",
        "stride_ak": "constexpr",
        "stride_bk": "constexpr",
        "stride_bn": "i32",
        "stride_cm": "i32",
        "stride_cn": "constexpr",
        "n_progs": "i64",
        "HAS_BIAS": "constexpr",
        "IEEE": "constexpr",
        "UPCAST_DOT": "constexpr",
        "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr",
        "BLOCK_K": "constexpr",
        "GROUP_M": "constexpr",
    }
    sig.update(overrides)
    return sig


def _params(kernel):
    return kernel.flavour(False).params


def test_a_pointer_kernels_signature_becomes_the_argument_kinds(fake_extension):
    record = native_launch._launch_record(
        "_persistent_matmul_kernel", _params(tbi._persistent_matmul_kernel), _compiled(_pointer_signature())
    )
    assert record is not None
    function, num_warps, shared, kinds, layouts = record
    assert (function, num_warps, shared, layouts) == (0x1234, 8, 196608, [])
    # pointers; i32; the ==1 strides Triton specialized into the kernel; n_progs as an i64
    assert kinds == [1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 2, 2, 0, 3]


def test_a_tma_kernels_descriptors_take_their_layouts(fake_extension):
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    metas = [
        {"swizzle": 3, "elem_size": 2, "elem_type": 8, "block_size": [128, 64], "fp4_padded": False},
        {"swizzle": 3, "elem_size": 2, "elem_type": 8, "block_size": [256, 64], "fp4_padded": False},
    ]
    record = native_launch._launch_record(
        "_tma_matmul_kernel", _params(tbi._tma_matmul_kernel), _compiled(_TMA_SIGNATURE, tensordesc_meta=metas)
    )
    assert record is not None
    _, _, _, kinds, layouts = record
    assert kinds == [5, 5, 1, 0, 1, 2, 2, 2, 2]
    assert layouts == [[3, 2, TMA_DTYPE_DEVICE_TO_HOST[8], 128, 64], [3, 2, TMA_DTYPE_DEVICE_TO_HOST[8], 256, 64]]


@pytest.mark.parametrize(
    "metadata",
    [
        dict(num_ctas=2),
        dict(launch_pdl=True),
        dict(launch_cooperative_grid=True),
        dict(global_scratch_size=128),
        dict(profile_scratch_size=64),
    ],
)
def test_launches_the_extension_does_not_make_stay_with_triton(fake_extension, metadata):
    assert (
        native_launch._launch_record(
            "_persistent_matmul_kernel",
            _params(tbi._persistent_matmul_kernel),
            _compiled(_pointer_signature(), **metadata),
        )
        is None
    )


def test_an_argument_type_or_descriptor_it_cannot_pack_stays_with_triton(fake_extension):
    assert (
        native_launch._launch_record(
            "_persistent_matmul_kernel", _params(tbi._persistent_matmul_kernel), _compiled(_pointer_signature(M="fp16"))
        )
        is None
    )
    # descriptors not lowered to TMA (no tensordesc_meta) are passed differently: not taken over
    assert (
        native_launch._launch_record("_tma_matmul_kernel", _params(tbi._tma_matmul_kernel), _compiled(_TMA_SIGNATURE))
        is None
    )


def test_a_kernel_whose_arguments_drifted_from_the_cpp_plan_raises(fake_extension, monkeypatch):
    monkeypatch.setattr(fake_extension, "argument_names", lambda: {"_persistent_matmul_kernel": _POINTER_NAMES[:-1]})
    with pytest.raises(RuntimeError, match="bind_triton_launch.cpp passes _persistent_matmul_kernel's arguments as"):
        native_launch._launch_record(
            "_persistent_matmul_kernel", _params(tbi._persistent_matmul_kernel), _compiled(_pointer_signature())
        )


def test_the_plans_in_cpp_name_the_kernels_runtime_arguments():
    """The names the C++ plans pass, as the extension states them, are the kernels' own."""
    for kernel, names in (
        (tbi._persistent_matmul_kernel, _POINTER_NAMES),
        (tbi._tma_matmul_kernel, _TMA_NAMES),
        (tbi._row_stats_kernel, ["x_ptr", "out_ptr", "L", "stride_row", "eps"]),
    ):
        assert [p.name for p in _params(kernel) if not p.is_constexpr] == names
    from rl_kernel_core import native_build

    source = (native_build.SOURCE_DIR / "bind_triton_launch.cpp").read_text()
    for names in (_POINTER_NAMES, _TMA_NAMES):
        assert ", ".join(f'"{n}"' for n in names[:3]) in source


def test_a_refusal_other_than_no_plan_raises():
    native_launch._check_kept("k", "kept")
    native_launch._check_kept("k", "unplanned")
    with pytest.raises(RuntimeError, match="C\\+\\+ launcher refused k: the compiled kernel takes 3 arguments"):
        native_launch._check_kept("k", "the compiled kernel takes 3 arguments, the plan passes 14")


def _fresh(monkeypatch):
    for name, value in (("_loaded", False), ("_ext", None), ("_serving", None), ("_reason", None)):
        monkeypatch.setattr(native_launch, name, value)


def test_the_switch_off_gives_its_reason_and_no_warning(monkeypatch, recwarn):
    _fresh(monkeypatch)
    monkeypatch.setenv(native_launch.SWITCH, "off")
    assert native_launch.extension() is None
    assert native_launch.unavailable_reason() == f"{native_launch.SWITCH}=0"
    assert native_launch.stats() == {}
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_malformed_switch_raises_naming_it(monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.setenv(native_launch.SWITCH, "maybe")
    with pytest.raises(SwitchError, match=f"{native_launch.SWITCH} must be one of .* got 'maybe'"):
        native_launch.extension()


def test_an_extension_that_cannot_be_built_is_said_once(monkeypatch):
    from rl_kernel_core import native_build

    _fresh(monkeypatch)
    monkeypatch.delenv(native_launch.SWITCH, raising=False)
    monkeypatch.setattr(native_build, "unavailable_reason", lambda: "no CUDA device is visible")
    with pytest.warns(RuntimeWarning, match="launch through Triton.*no CUDA device is visible"):
        assert native_launch.extension() is None
    assert native_launch.unavailable_reason() == "no CUDA device is visible"
    assert native_launch.set_enabled(True) is False
