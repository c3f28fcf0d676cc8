"""Qwen3-MoE under the identity on vLLM's CPU build (rl_kernel_vllm.moe, rl_kernel_core.batch_invariant_mode.api_moe).

A tiny Qwen3-MoE (2 layers; 6-12 experts, top-1 to top-3, renormalised or not, drawn by the harness)
runs through the consistency harness with both switches on: every sampled (and, where drawn, prompt)
token's log-prob is bitwise the transformers trainer's under the mode; the control (both off: vLLM's
fused MoE against transformers as shipped) runs beside it and its gap is printed. Engine
configurations the mode does not cover for an MoE model are refused by name before any work.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rl_kernel_vllm import batch_invariant, harness


def test_tiny_moe_rollout_is_bitwise_the_trainers(tmp_path, seed):
    rows = harness.sweep(1, seed, "cpu", tmp_path, control=True, architecture=harness.MOE)
    assert rows and "skipped" not in rows[0], rows
    print(harness.line(rows[0]))
    assert harness.passed(rows[0]), (
        f"seed={seed} (rerun: python -m rl_kernel_vllm.harness --seed {seed} "
        f"--draws 1 --architecture {harness.MOE}):\n{harness.line(rows[0])}"
    )
    assert "error" not in rows[0]["off"], rows[0]["off"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    spec = harness.draw(random.Random(0), "cpu", harness.MOE)
    path = tmp_path_factory.mktemp("moe") / "model"
    harness.write_model(spec, path, "cpu")
    return path


def _config(model_dir: Path, **engine):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=64, **engine).create_engine_config()


@pytest.mark.parametrize(
    "engine, refused",
    [
        ({"enable_expert_parallel": True}, "enable_expert_parallel=True for an MoE model"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 for an MoE model (only 1)"),
        ({"data_parallel_size": 2}, "data_parallel_size=2 for an MoE model (only 1)"),
    ],
)
def test_uncovered_parallelism_is_refused_by_name(moe_dir, engine, refused, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = _config(moe_dir, **engine)
    with pytest.raises(ValueError, match=r"RL_KERNEL_VLLM_BATCH_INVARIANT=1 does not cover: .*" + _escape(refused)):
        batch_invariant.check_config(config, "CPU_ATTN")


@pytest.mark.parametrize(
    "change, refused",
    [
        ({"shared_expert_intermediate_size": 32}, "shared experts (shared_expert_intermediate_size=32)"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' for an MoE model (only 'silu')"),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, "quantization='fp8'"),
    ],
)
def test_uncovered_experts_are_refused_by_name(moe_dir, tmp_path, change, refused, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = tmp_path / "model"
    model.mkdir()
    for f in moe_dir.iterdir():
        (model / f.name).symlink_to(f)
    config = json.loads((moe_dir / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, **change}))
    try:
        engine_config = _config(model)
    except Exception as exc:  # vLLM itself refuses the configuration first: no engine without rl-kernel either
        pytest.skip(f"vLLM refuses {change} on its own: {exc}")
    with pytest.raises(ValueError, match=r"RL_KERNEL_VLLM_BATCH_INVARIANT=1 does not cover: .*" + _escape(refused)):
        batch_invariant.check_config(engine_config, "CPU_ATTN")


def test_returning_routed_experts_is_refused(moe_dir, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = _config(moe_dir)
    # vllm-cpu 0.32 refuses the switch itself (it needs Model Runner V2); the GPU release takes it
    config.aux_output_config.enable_return_routed_experts = True
    with pytest.raises(ValueError, match=r"does not cover: .*enable_return_routed_experts=True"):
        batch_invariant.check_config(config, "CPU_ATTN")


def test_other_moe_architectures_are_refused(moe_dir, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = _config(moe_dir)
    config.model_config.model_arch_config.architectures = ["MixtralForCausalLM"]
    with pytest.raises(ValueError, match=r"model architecture \['MixtralForCausalLM'\]"):
        batch_invariant.check_config(config, "CPU_ATTN")


def _escape(text: str) -> str:
    import re

    return re.escape(text)
