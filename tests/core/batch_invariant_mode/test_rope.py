"""Rotary values shared by the engine and the trainer (rl_kernel_core.batch_invariant_mode.api_rope): the table is
transformers' own rotary output for every drawn architecture, rope type, theta and head_dim; a
trainer's rotary modules get the CPU build's frequencies however the model was built; dynamic rope
types are refused by name. Seeded draws; the seed is printed."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention
from rl_kernel_core.batch_invariant_mode.api_rope import (
    COVERED_ROPE_TYPES,
    check_rope,
    cos_sin_table,
    reference_rotary,
    rope_type,
    use_cpu_rope_frequencies,
)
from rl_kernel_core.tools.random_model import hf_config


def _config(rng: random.Random):
    arch = rng.choice(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
    head_dim, heads = rng.choice([16, 32, 64]), rng.choice([1, 2, 4])
    kind = rng.choice(COVERED_ROPE_TYPES)
    params = {"rope_type": kind, "rope_theta": 10 ** rng.uniform(4, 6)}
    if kind == "linear":
        params["factor"] = rng.choice([1.5, 2.0, 3.0])
    elif kind == "llama3":
        params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    elif kind == "yarn":
        params.update(factor=4.0, original_max_position_embeddings=64)
    config = hf_config(
        arch,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        head_dim=head_dim,
        num_key_value_heads=1,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=256,
        rope_parameters=params,
    )
    return arch, config


def test_table_is_transformers_rotary_output(seed):
    rng = random.Random(seed)
    for i in range(12):
        arch, config = _config(rng)
        cos, sin = cos_sin_table(config, 256, torch.device("cpu"))
        model = getattr(transformers, arch)(config)
        positions = torch.tensor([rng.sample(range(256), 40)])
        want_cos, want_sin = model.model.rotary_emb(torch.empty(0), positions)
        assert torch.equal(cos[positions[0]], want_cos[0]) and torch.equal(sin[positions[0]], want_sin[0]), (
            f"seed={seed} draw {i}: {arch} {config.rope_parameters}"
        )


def test_trainer_frequencies_are_the_cpu_build(seed):
    _, config = _config(random.Random(seed))
    model = transformers.AutoModelForCausalLM.from_config(config)
    rotary = model.get_submodule("model.rotary_emb")
    inv_freq, original = rotary.get_buffer("inv_freq"), rotary.get_buffer("original_inv_freq")
    want = reference_rotary(config).get_buffer("inv_freq")
    inv_freq.mul_(1 + 2**-20)  # as a GPU build's pow may round a frequency differently
    assert not torch.equal(inv_freq, want)
    use_mode_attention(model)
    assert torch.equal(inv_freq, want) and torch.equal(original, want)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_dynamic_rope_types_are_refused_by_name(kind):
    extra = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8} if kind == "longrope" else {}
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        rope_parameters={"rope_type": kind, "rope_theta": 1e4, "factor": 2.0, **extra},
    )
    assert rope_type(config) == kind
    with pytest.raises(ValueError, match=f"rope_type '{kind}' is not covered"):
        check_rope(config, "config")
    assert (
        use_cpu_rope_frequencies(
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    hidden_size=32,
                    num_attention_heads=2,
                    num_hidden_layers=1,
                    intermediate_size=16,
                    vocab_size=32,
                    rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
                )
            )
        )
        == []
    )


@pytest.mark.gpu
def test_a_model_built_on_the_gpu_gets_the_cpu_frequencies(seed):
    """A transformers model constructed on CUDA computes its inverse frequencies with CUDA's pow (what
    vLLM's own table does); use_mode_attention gives it the CPU build's, bitwise. Prints how many of
    the drawn configurations' frequencies CUDA rounded otherwise."""
    rng = random.Random(seed)
    differed = 0
    for i in range(16):
        _, config = _config(rng)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        inv_freq = model.get_submodule("model.rotary_emb").get_buffer("inv_freq")
        want = reference_rotary(config).get_buffer("inv_freq").cuda()
        differed += int(not torch.equal(inv_freq, want))
        use_mode_attention(model)
        assert torch.equal(inv_freq, want), f"seed={seed} draw {i}: {config.rope_parameters}"
    print(f"configurations whose CUDA-built frequencies differed from the CPU build: {differed} of 16")
