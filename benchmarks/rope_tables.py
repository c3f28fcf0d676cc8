"""vLLM's rotary table against transformers' rotary values, entry by entry, on the device vLLM builds it.

For each configuration (architecture, ``rope_theta``, head_dim, rope type) this builds vLLM's rotary
layer as its model construction does (``get_rope`` on the GPU as the default device, under a current
vLLM config; the plugin not installed) and transformers' rotary module as ``from_pretrained`` does
(on the CPU, then moved), and compares, in the model dtype, vLLM's ``cos_sin_cache`` with
transformers' ``cos``/``sin`` at every position below ``max_position_embeddings``: the number of
differing entries, the first differing position, and how many inverse frequencies differ between
vLLM's computation on the GPU and on the CPU. Also checks that
:func:`rl_kernel_core.batch_invariant_mode.api_rope.cos_sin_table` (what the batch-invariant hook puts in vLLM's
table) equals transformers' values everywhere.

``python benchmarks/rope_tables.py --out rope_tables.json`` (needs vLLM; ``--device cpu`` compares vLLM's CPU table)
"""

from __future__ import annotations

import argparse
import json
import sys

from typing import Any

import torch

CONFIGS: list[tuple[str, float, int, dict[str, Any]]] = [
    # (architecture, rope_theta, head_dim, rope parameters beyond theta)
    ("Qwen3ForCausalLM", 1e6, 128, {"rope_type": "default"}),
    ("Qwen3ForCausalLM", 1e4, 128, {"rope_type": "default"}),
    ("LlamaForCausalLM", 5e5, 64, {"rope_type": "default"}),
    (
        "LlamaForCausalLM",
        5e5,
        64,
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    (
        "LlamaForCausalLM",
        5e5,
        128,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    ("Qwen2ForCausalLM", 1e6, 128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}),
    ("Qwen3ForCausalLM", 1e6, 128, {"rope_type": "linear", "factor": 2.0}),
    ("Qwen3ForCausalLM", 1e6, 128, {"rope_type": "linear", "factor": 3.0}),
    ("Qwen3ForCausalLM", 123456.7, 64, {"rope_type": "default"}),
]
MAX_POSITIONS = 32768


def config_of(arch: str, theta: float, head_dim: int, params: dict, dtype: torch.dtype):
    from rl_kernel_core.tools.random_model import hf_config

    heads = 16
    return hf_config(
        arch,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=8,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=256,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={**params, "rope_theta": theta},
        dtype=dtype,
        head_dim=head_dim,
    )


def compare(arch: str, theta: float, head_dim: int, params: dict, dtype: torch.dtype, device: str) -> dict:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from rl_kernel_core.batch_invariant_mode.api_rope import cos_sin_table, reference_rotary

    config = config_of(arch, theta, head_dim, params, dtype)
    with set_current_vllm_config(VllmConfig()), torch.device(device):
        rotary = get_rope(
            head_dim, MAX_POSITIONS, is_neox_style=True, rope_parameters=dict(config.rope_parameters), dtype=dtype
        )
        gpu_inv = rotary._compute_inv_freq(theta).cpu() if params["rope_type"] == "default" else None
    with torch.device("cpu"):
        cpu_inv = rotary._compute_inv_freq(theta) if params["rope_type"] == "default" else None
    cache = rotary.cos_sin_cache
    rows = min(cache.shape[0], MAX_POSITIONS)
    hf = reference_rotary(config).to(device)
    cos, sin = hf(torch.empty(0, dtype=dtype, device=device), torch.arange(rows, device=device)[None])
    half = head_dim // 2
    want = torch.cat((cos[0, :, :half], sin[0, :, :half]), -1)
    got = cache[:rows].to(device=device, dtype=dtype)
    differs = (got != want).any(-1)
    ours_cos, ours_sin = cos_sin_table(config, rows, torch.device(device))
    ours = torch.cat((ours_cos[:, :half], ours_sin[:, :half]), -1).to(dtype)
    return {
        "architecture": arch,
        "rope_theta": theta,
        "head_dim": head_dim,
        "rope": params,
        "dtype": str(dtype),
        "positions": rows,
        "vllm_entries_differing": int((got != want).sum()),
        "vllm_positions_differing": int(differs.sum()),
        "vllm_first_differing_position": int(differs.nonzero()[0]) if bool(differs.any()) else None,
        "inv_freq_gpu_vs_cpu_differing": None if gpu_inv is None else int((gpu_inv != cpu_inv).sum()),
        "rl_kernel_table_entries_differing": int((ours != want).sum()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", help="where vLLM builds its table (default cuda)")
    args = parser.parse_args()
    rows = []
    for arch, theta, head_dim, params in CONFIGS:
        for dtype in (torch.bfloat16, torch.float32):
            r = compare(arch, theta, head_dim, params, dtype, args.device)
            rows.append(r)
            print(
                f"{arch:18s} theta {theta:9.1f} hd {head_dim:3d} {params['rope_type']:7s} {str(dtype)[6:]:9s}: "
                f"vLLM table differs at {r['vllm_positions_differing']:5d}/{r['positions']} positions "
                f"(first {r['vllm_first_differing_position']}), inv_freq GPU vs CPU {r['inv_freq_gpu_vs_cpu_differing']}; "
                f"rl-kernel's table differs at {r['rl_kernel_table_entries_differing']} entries",
                flush=True,
            )
    from rl_kernel_vllm.consistency import _versions

    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"command": " ".join(sys.argv), "versions": _versions(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
