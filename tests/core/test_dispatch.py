"""Backend choice: explicit backends fail loudly with a reason, auto records what it skipped."""

import logging

import pytest
import torch

from rl_kernel_core import dispatch, ops
from rl_kernel_core.dispatch import BackendUnavailableError


@pytest.fixture
def toy_op():
    """An op served by torch and by triton (where x > 0), gone from dispatch after the test."""
    name = "test_toy_op"
    with (
        dispatch.override(name, "torch", lambda x: ("torch", x)),
        dispatch.override(
            name, "triton", lambda x: ("triton", x), supports=lambda x: None if x > 0 else "x must be positive"
        ),
    ):
        yield name


@pytest.fixture
def torch_only_op():
    """An op only torch serves, gone from dispatch after the test."""
    name = "test_torch_only_op"
    with dispatch.override(name, "torch", lambda x: ("torch", x)):
        yield name


def test_auto_on_cpu_picks_torch_and_records_why_others_were_skipped(toy_op, caplog):
    with caplog.at_level(logging.INFO, logger="rl_kernel"):
        impl = dispatch.select(toy_op, "auto", torch.device("cpu"), 1)
    assert impl(1) == ("torch", 1)
    decision = dispatch.explain(toy_op)
    assert decision.backend == "torch" and decision.requested == "auto"
    assert "native" in decision.skipped and "triton" in decision.skipped
    assert "CUDA" in decision.skipped["triton"]
    assert any(toy_op in r.getMessage() and "backend=torch" in r.getMessage() for r in caplog.records)


def test_choice_is_logged_once(toy_op, caplog):
    with caplog.at_level(logging.INFO, logger="rl_kernel"):
        for _ in range(3):
            dispatch.select(toy_op, "auto", torch.device("cpu"), 1)
    assert sum(toy_op in r.getMessage() for r in caplog.records) == 1


def test_explicit_backend_that_cannot_run_raises_with_reason(toy_op):
    with pytest.raises(BackendUnavailableError, match="triton needs CUDA tensors"):
        dispatch.select(toy_op, "triton", torch.device("cpu"), 1)
    with pytest.raises(BackendUnavailableError, match="native"):
        dispatch.select(toy_op, "native", torch.device("cpu"), 1)


def test_interpreter_allows_explicit_triton_on_cpu_and_supports_is_consulted(toy_op, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.select(toy_op, "triton", torch.device("cpu"), 2)(2) == ("triton", 2)
    with pytest.raises(BackendUnavailableError, match="x must be positive"):
        dispatch.select(toy_op, "triton", torch.device("cpu"), -1)
    # auto never picks the interpreter
    assert dispatch.select(toy_op, "auto", torch.device("cpu"), 2)(2) == ("torch", 2)


def test_env_default_and_bad_names(toy_op, monkeypatch):
    monkeypatch.setenv("RL_KERNEL_BACKEND", "torch")
    assert dispatch.default_backend() == "torch"
    assert dispatch.select(toy_op, None, torch.device("cpu"), 1)(1) == ("torch", 1)
    monkeypatch.setenv("RL_KERNEL_BACKEND", "triton")
    with pytest.raises(BackendUnavailableError, match="triton needs CUDA"):
        dispatch.select(toy_op, "auto", torch.device("cpu"), 1)
    monkeypatch.setenv("RL_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="RL_KERNEL_BACKEND"):
        dispatch.default_backend()
    with pytest.raises(ValueError, match="backend"):
        dispatch.select(toy_op, "fastest", torch.device("cpu"), 1)


def test_missing_implementation_is_named(toy_op):
    with pytest.raises(BackendUnavailableError, match="has no torch implementation"):
        dispatch.select("test_unregistered_op", "torch", torch.device("cpu"))


def test_preference_order(toy_op, monkeypatch):
    # both backends runnable on CPU here, so only the order decides which one auto takes
    monkeypatch.setattr(dispatch, "_device_reason", lambda backend, device, explicit: None)
    dispatch.set_preference(toy_op, ("triton", "torch"))
    assert dispatch.select(toy_op, "auto", torch.device("cpu"), 1)(1) == ("triton", 1)
    dispatch.set_preference(toy_op, ("torch", "triton"))
    assert dispatch.select(toy_op, "auto", torch.device("cpu"), 1)(1) == ("torch", 1)
    assert dispatch.select(toy_op, "auto", torch.device("cpu"), -1)(-1) == ("torch", -1)
    dispatch.set_preference(toy_op, ("triton", "torch"))
    assert dispatch.select(toy_op, "auto", torch.device("cpu"), -1)(-1) == ("torch", -1)  # triton refuses x <= 0
    with pytest.raises(ValueError, match="order"):
        dispatch.set_preference(toy_op, ("gpu",))


def test_backend_status_names_native_reason():
    status = dispatch.backend_status()
    assert status["torch"] is None
    if not torch.cuda.is_available():
        assert status["native"] and ("CPU-only" in status["native"] or "CUDA" in status["native"])


def test_backends_that_do_not_declare_an_op_are_never_loaded_for_it(torch_only_op, monkeypatch):
    name = torch_only_op
    loaded = []
    monkeypatch.setattr(
        dispatch, "_ensure_loaded", lambda backend, op: None if backend == "torch" else loaded.append(backend)
    )
    assert dispatch.select(name, "auto", torch.device("cuda"), 1)(1) == ("torch", 1)
    assert loaded == []
    assert dispatch.explain(name).skipped == {
        "native": f"{name} has no native implementation",
        "triton": f"{name} has no triton implementation",
    }
    with pytest.raises(BackendUnavailableError, match="has no native implementation"):
        dispatch.select(name, "native", torch.device("cuda"), 1)
    assert loaded == []


def test_registering_an_undeclared_op_is_refused():
    with pytest.raises(ValueError, match="rl_kernel_core.ops.OPS"):
        dispatch.register("test_undeclared_op", "triton")


def test_env_backend_is_a_preference_for_ops_it_does_not_serve(torch_only_op, monkeypatch, caplog):
    name = torch_only_op
    monkeypatch.setenv("RL_KERNEL_BACKEND", "native")
    with caplog.at_level(logging.INFO, logger="rl_kernel"):
        assert dispatch.select(name, None, torch.device("cpu"), 1)(1) == ("torch", 1)
    assert "RL_KERNEL_BACKEND=native" in dispatch.explain(name).skipped["native"]
    assert any("RL_KERNEL_BACKEND=native" in r.getMessage() for r in caplog.records)
    with pytest.raises(BackendUnavailableError, match="native"):  # an explicit backend stays strict
        dispatch.select(name, "native", torch.device("cpu"), 1)


def test_override_and_scope_leave_the_registry_as_they_found_it(monkeypatch):
    """A stand-in, a preference and the decisions taken inside the block are gone after it."""
    before = (
        dict(dispatch.REGISTRY.impls),
        dict(dispatch.REGISTRY.preference),
        dispatch.explain(),
        set(dispatch.REGISTRY.logged),
    )
    with dispatch.override("sample", "flashinfer", lambda *args: "stand-in", any_device=True):
        dispatch.set_preference("sample", ("flashinfer", "torch"))
        assert dispatch.select("sample", "auto", torch.device("cpu"))() == "stand-in"
        assert dispatch.explain("sample").backend == "flashinfer"
    with dispatch.REGISTRY.scoped():
        dispatch.set_preference("logprob_from_logits", ("torch",))
    after = (
        dict(dispatch.REGISTRY.impls),
        dict(dispatch.REGISTRY.preference),
        dispatch.explain(),
        set(dispatch.REGISTRY.logged),
    )
    assert after == before and not dispatch.REGISTRY.stand_ins
    with pytest.raises(ValueError, match="backend must be one of"):
        with dispatch.override("sample", "cuda", lambda: None):
            pass


def test_a_decision_names_the_route_its_kernels_last_took(monkeypatch):
    """``Decision.route``: the backend's own route until a launch of its kernels records another."""
    monkeypatch.setattr(dispatch.REGISTRY, "routes", {})
    decision = dispatch.Decision("op", "auto", "triton", "cuda", kernels="toy_kernels")
    assert decision.route == "triton"
    dispatch.ran("toy_kernels", "triton+cpp_launch")
    assert decision.route == "triton+cpp_launch"
    assert dispatch.Decision("op", "auto", "native", "cuda").route == "native"


def test_every_route_a_launch_records_is_in_the_manifest():
    """The routes passed to ``dispatch.ran`` anywhere in the package are keys of ``ops.ROUTES``."""
    import ast
    from pathlib import Path

    recorded = set()
    for path in Path(dispatch.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "ran"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dispatch"
            ):
                recorded |= {
                    c.value for c in ast.walk(node.args[1]) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
    assert {"triton", "triton+sm90", "triton+cpp_launch"} <= recorded <= set(ops.ROUTES)
    assert set(ops.BACKENDS) <= set(ops.ROUTES)


def test_triton_registers_exactly_what_it_declares():
    pytest.importorskip("triton")
    import importlib

    for module in ops.modules("triton").values():
        importlib.import_module(module)
    registered = {op for (op, backend) in dispatch.REGISTRY.impls if backend == "triton"}
    assert registered == dispatch.SERVES["triton"]


@pytest.mark.gpu
def test_native_registers_exactly_what_it_declares():
    import importlib

    for module in ops.modules("native").values():
        importlib.import_module(module)
    registered = {op for (op, backend) in dispatch.REGISTRY.impls if backend == "native"}
    assert registered == dispatch.SERVES["native"]


def test_an_op_loads_only_its_own_module():
    """The first call of an op imports the one backend module that serves it, and of the rest of the
    backend only the shared JIT wrapper and tile tables."""
    import subprocess
    import sys

    code = (
        "import os, sys, torch; os.environ['TRITON_INTERPRET'] = '1'\n"
        "import rl_kernel_core as rk\n"
        "rk.group_advantages(torch.randn(8), group_size=4, backend='triton')\n"
        "backend = lambda m: m.startswith(('rl_kernel_core.triton.', 'rl_kernel_core.native')) or m.startswith('rl_kernel_core.') and m.count('.') == 2 and m.rsplit('.', 1)[1].startswith(('triton', 'native'))\n"
        "loaded = sorted(m for m in sys.modules if backend(m))\n"
        "assert loaded == ['rl_kernel_core.advantages.triton', 'rl_kernel_core.triton._jit', 'rl_kernel_core.triton.tuning'], loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_decisions_kept_between_calls_follow_the_inputs_the_environment_and_the_registry(toy_op, monkeypatch):
    """select keeps what does not depend on the inputs; supports is still asked on every call, and
    a changed RL_KERNEL_BACKEND, TRITON_INTERPRET, preference or stand-in takes effect at once."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.set_preference(toy_op, ("triton", "torch"))
    cpu = torch.device("cpu")
    assert dispatch.select(toy_op, "auto", cpu, 2)(2) == ("torch", 2)  # auto never interprets
    assert dispatch.select(toy_op, "triton", cpu, 2)(2) == ("triton", 2)
    with pytest.raises(BackendUnavailableError, match="x must be positive"):  # asked again, refused
        dispatch.select(toy_op, "triton", cpu, -1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="triton needs CUDA tensors"):
        dispatch.select(toy_op, "triton", cpu, 2)
    with dispatch.override(toy_op, "triton", lambda x: ("stand-in", x), any_device=True):
        assert dispatch.select(toy_op, "auto", cpu, 3)(3) == ("stand-in", 3)
        assert dispatch.explain(toy_op).backend == "triton" and dispatch.explain(toy_op).skipped == {}
        with dispatch.override(
            toy_op,
            "triton",
            lambda x: ("positive", x),
            any_device=True,
            supports=lambda x: None if x > 0 else "x must be positive",
        ):
            assert dispatch.select(toy_op, "auto", cpu, -3)(-3) == ("torch", -3)
            assert dispatch.explain(toy_op).skipped == {"triton": "x must be positive"}
            assert dispatch.select(toy_op, "auto", cpu, 3)(3) == ("positive", 3)
            assert dispatch.explain(toy_op).skipped == {}
    assert dispatch.select(toy_op, "auto", cpu, 3)(3) == ("torch", 3)  # the stand-ins are gone
    assert "CUDA" in dispatch.explain(toy_op).skipped["triton"]
    monkeypatch.setenv("RL_KERNEL_BACKEND", "triton")
    with pytest.raises(BackendUnavailableError, match="backend='triton' cannot run: triton needs CUDA"):
        dispatch.select(toy_op, "auto", cpu, 3)
    monkeypatch.delenv("RL_KERNEL_BACKEND")
    dispatch.set_preference(toy_op, ("native",))
    with pytest.raises(BackendUnavailableError, match="no backend can run these inputs: {'native'"):
        dispatch.select(toy_op, "auto", cpu, 3)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


_META_CALLS = {  # op -> (call with meta inputs on a backend, the argument the error names)
    "ratio_kl": (lambda rk, b: rk.ratio_kl(_meta(4, 8), _meta(4, 8), backend=b), "logprob", (4, 8)),
    "policy_loss": (
        lambda rk, b: rk.policy_loss(_meta(4, 8), _meta(4, 8), _meta(4, 8), _meta(4, 8), backend=b),
        "logprob",
        (4, 8),
    ),
    "rms_norm": (lambda rk, b: rk.rms_norm(_meta(3, 8), _meta(8), backend=b), "x", (3, 8)),
    "varlen_attention": (
        lambda rk, b: rk.varlen_attention(
            _meta(8, 2, 4), _meta(8, 2, 4), _meta(8, 2, 4), torch.tensor([0, 3, 8]), backend=b
        ),
        "q",
        (8, 2, 4),
    ),
}


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("op", sorted(_META_CALLS))
def test_meta_tensors_on_a_kernel_backend_are_refused_naming_the_argument(op, interpret, monkeypatch):
    """The Triton interpreter took meta tensors and failed copying their data (a raw
    NotImplementedError); a named kernel backend now refuses them in one line naming the argument,
    while torch and auto run them for their shapes."""
    import rl_kernel_core as rk

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    call, name, shape = _META_CALLS[op]
    with pytest.raises(BackendUnavailableError) as info:
        call(rk, "triton")
    assert str(info.value) == (
        f"{op}: backend='triton' cannot run: {name} is a meta tensor (shape {shape}, no data) "
        "and triton's kernels read data; backend='torch' runs on meta tensors"
    )
    for backend in ("torch", "auto"):
        out = call(rk, backend)
        assert all(t.is_meta for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_meta_cu_seqlens_are_refused_naming_the_argument(backend, which, monkeypatch):
    import rl_kernel_core as rk

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(8, 2, 4)
    cu = {"cu_seqlens_q": torch.tensor([0, 3, 8]), "cu_seqlens_k": torch.tensor([0, 3, 8])}
    cu[which] = cu[which].to("meta")
    with pytest.raises(
        ValueError,
        match=rf"^{which} must hold data \(its offsets are read on the host\), got a meta "
        r"tensor of shape \(3,\)$",
    ):
        rk.varlen_attention(q, q, q, cu["cu_seqlens_q"], cu["cu_seqlens_k"], backend=backend)


def test_meta_inputs_in_a_tuple_are_named_by_field(toy_op, monkeypatch):
    """An op whose backends take a tuple of inputs (``fused_linear_policy_loss``'s
    ``FusedLossInputs``) names the field holding the meta tensor."""
    from typing import NamedTuple

    class Inputs(NamedTuple):
        hidden: torch.Tensor
        weight: torch.Tensor

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(
        BackendUnavailableError, match=r"cannot run: hidden is a meta tensor \(shape \(2, 3\), no data\)"
    ):
        dispatch.select(toy_op, "triton", torch.device("meta"), Inputs(_meta(2, 3), _meta(3, 3)))
