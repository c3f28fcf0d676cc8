"""transformers models patched by ``use_mode_attention`` with the mode off: the control group is the
library default. Every ``scaled_dot_product_attention`` call gets the same mask (None where
transformers skips it) and the same ``is_causal`` as in the unpatched model, over drawn architectures,
batch sizes, padding sides and KV-cache decode steps, so that on CUDA it picks the same kernel.
Seeded draws; the seed is printed."""

from __future__ import annotations

import random

import pytest
import torch

from rl_kernel_core.batch_invariant_mode import api_hf

transformers = pytest.importorskip("transformers")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tiny(rng: random.Random, dtype: torch.dtype):
    arch = rng.choice(["Llama", "Qwen2", "Qwen3", "Qwen3Moe"])
    heads = rng.choice([2, 4])
    config = dict(
        vocab_size=97,
        hidden_size=16 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([1, heads]),
        max_position_embeddings=128,
        pad_token_id=0,
    )
    if arch == "Qwen3Moe":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = getattr(transformers, f"{arch}Config")(**config)
    return arch, getattr(transformers, f"{arch}ForCausalLM")(cfg).eval().to(dtype)


def _sdpa_calls(model, ids, mask, monkeypatch) -> list[tuple]:
    """``(output, mask or None, is_causal)`` of every SDPA call of a prefill and one decode step."""
    calls: list[tuple] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, *args, **kwargs):
        out = sdpa(q, k, v, attn_mask, *args, **kwargs)
        calls.append((out, attn_mask, kwargs.get("is_causal")))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = first.logits[:, -1:].argmax(-1)
        model(
            input_ids=step,
            attention_mask=torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1),
            past_key_values=first.past_key_values,
            use_cache=True,
        )
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_mode_off_hands_sdpa_what_the_unpatched_model_hands_it(seed, device, monkeypatch):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    torch.manual_seed(seed)
    arch, model = _tiny(rng, dtype)
    model = model.to(device)
    batch, length = rng.randint(1, 4), rng.randint(2, 12)
    ids = torch.randint(3, 97, (batch, length), device=device)
    mask = torch.ones_like(ids)
    if rng.random() < 0.5:  # padded rows, on the drawn side
        for row in range(batch):
            pad = rng.randint(0, length - 1)
            if rng.random() < 0.5:
                mask[row, :pad] = 0
            else:
                mask[row, length - pad :] = 0
    shipped = _sdpa_calls(model, ids, mask, monkeypatch)
    api_hf.use_mode_attention(model)
    patched = _sdpa_calls(model, ids, mask, monkeypatch)
    where = f"seed={seed} {arch} {dtype} batch={batch} length={length}"
    assert len(patched) == len(shipped) > 0, where
    for i, ((out, m, causal), (out0, m0, causal0)) in enumerate(zip(patched, shipped)):
        assert causal == causal0, f"{where}: call {i}: is_causal {causal} vs the unpatched model's {causal0}"
        assert (m is None) == (m0 is None), f"{where}: call {i}: mask {type(m)} vs the unpatched model's {type(m0)}"
        assert m is None or torch.equal(m, m0), f"{where}: call {i}: another mask than the unpatched model's"
        assert torch.equal(out, out0), f"{where}: call {i}: another output than the unpatched model's"
