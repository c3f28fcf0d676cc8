"""Write a randomly initialised Hugging Face checkpoint with a real model's shapes (no download).

``python benchmarks/make_random_model.py --preset qwen3-0.6b --dtype bfloat16 --out DIR``: the config
of the preset, weights drawn N(0, 0.02) from a seeded generator (norm weights 1), no tokenizer
(engines run with token ids: ``skip_tokenizer_init=True``). Other scripts call
:func:`write_random_model`. ``tiny`` is a two-layer Qwen3 for CPU smoke runs of those scripts.
A preset with ``num_experts`` is a ``Qwen3MoeForCausalLM``: ``qwen3-30b-a3b-8l`` has Qwen3-30B-A3B's
widths (128 experts, top-8) at 8 of its 48 layers; ``tiny-moe`` is its CPU smoke size.
"""

from __future__ import annotations

import argparse

import torch

from rl_kernel_core.tools.random_model import random_causal_lm, tiny_text_config

QWEN3_RELEASED = dict(
    vocab_size=151936,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)
"""What Qwen3-0.6B's and Qwen3-1.7B's configs share; they differ in the widths."""

TINY = tiny_text_config(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
"""A two-layer Qwen3 for CPU smoke runs."""

QWEN3_30B_A3B_WIDTHS = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4)
QWEN3_30B_A3B_EXPERTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
TINY_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)

PRESETS = {
    "qwen3-0.6b": dict(QWEN3_RELEASED, hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(QWEN3_RELEASED, hidden_size=2048, intermediate_size=6144),
    # Qwen3-30B-A3B at 8 of its 48 layers
    "qwen3-30b-a3b-8l": dict(
        QWEN3_RELEASED, **QWEN3_30B_A3B_WIDTHS, **QWEN3_30B_A3B_EXPERTS, num_hidden_layers=8, tie_word_embeddings=False
    ),
    "tiny-moe": dict(TINY, **TINY_EXPERTS, tie_word_embeddings=False),
    "tiny": TINY,
}


def architecture(preset: str) -> str:
    """The model class of ``preset``: ``Qwen3MoeForCausalLM`` where it has experts, else ``Qwen3ForCausalLM``."""
    return "Qwen3MoeForCausalLM" if "num_experts" in PRESETS[preset] else "Qwen3ForCausalLM"


def write_random_model(preset: str, out: str, *, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Save a random :func:`architecture` model with ``PRESETS[preset]``'s config to ``out``; return ``out``.

    Matrices (every parameter of 2 or more dims) are N(0, 0.02) from a generator seeded with
    ``seed``; norm weights are 1. Built on the GPU when there is one. ``dtype``: a torch dtype name
    (``bfloat16``, ``float16``, ``float32``), the dtype the weights are saved in.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    arch = architecture(preset)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_causal_lm(arch, PRESETS[preset], dtype=getattr(torch, dtype), device=device, seed=seed, std=0.02)
    model.save_pretrained(out)
    print(
        f"wrote {preset} ({arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype}) to {out}"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b", help="model shapes")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="weight dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    args = parser.parse_args()
    write_random_model(args.preset, args.out, dtype=args.dtype, seed=args.seed)


if __name__ == "__main__":
    main()
