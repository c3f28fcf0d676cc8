"""``rl_kernel_core.tools.random_model``: the config's architecture-specific fields and the weights' seed."""

from __future__ import annotations

import pytest
import torch

from rl_kernel_core.tools.random_model import hf_config, random_causal_lm

pytest.importorskip("transformers")

HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, intermediate_size=48, **HEADS)


def test_qwen2_takes_the_head_dim_its_sizes_imply():
    config = hf_config("Qwen2ForCausalLM", **TINY)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.hidden_size // config.num_attention_heads == TINY["head_dim"]


def test_qwen2_refuses_a_head_dim_its_sizes_do_not_imply():
    with pytest.raises(ValueError, match=r"head_dim=16 for Qwen2ForCausalLM.*32 // 4"):
        hf_config("Qwen2ForCausalLM", **{**TINY, "head_dim": 16})


def test_qwen3_keeps_its_own_head_dim():
    assert hf_config("Qwen3ForCausalLM", **{**TINY, "head_dim": 16}).head_dim == 16


def test_the_seed_fixes_every_matrix():
    def build(seed: int):
        return random_causal_lm("Qwen3ForCausalLM", TINY, dtype=torch.bfloat16, device="cpu", seed=seed, std=0.02)

    a, b, c = build(7).state_dict(), build(7).state_dict(), build(8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
