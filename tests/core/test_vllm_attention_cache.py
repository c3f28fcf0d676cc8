"""rl_kernel_vllm.attention's paged-cache layout: what ``write_cache`` stores at a slot mapping,
``gather_index`` reads back in position order, bit for bit (pure torch, no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from rl_kernel_vllm.attention import gather_index, split_cache, write_cache


def test_written_tokens_are_gathered_back_in_position_order():
    gen = torch.Generator().manual_seed(0)
    num_blocks, heads, block_size, d = 12, 2, 4, 8
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * d)
    key_cache, value_cache = split_cache(kv_cache, d)
    seq_lens = [5, 1, 9]
    tables = torch.randperm(num_blocks, generator=gen)[:9].view(3, 3)  # each sequence's blocks, shuffled
    keys = [torch.randn(n, heads, d, generator=gen) for n in seq_lens]
    values = [torch.randn(n, heads, d, generator=gen) for n in seq_lens]
    # written in two steps (a prefill of all but the last token, then one decode token each), with padding
    for step in ("prefill", "decode"):
        slots, ks, vs = [], [], []
        for b, n in enumerate(seq_lens):
            positions = range(n - 1) if step == "prefill" else [n - 1]
            for p in positions:
                slots.append(int(tables[b, p // block_size]) * block_size + p % block_size)
                ks.append(keys[b][p])
                vs.append(values[b][p])
        slots.append(-1)  # a padded token
        pad = torch.full((1, heads, d), float("nan"))
        write_cache(
            key_cache,
            value_cache,
            torch.cat([torch.stack(ks), pad]),
            torch.cat([torch.stack(vs), pad]),
            torch.tensor(slots, dtype=torch.int32),
        )
    blocks, rows = gather_index(tables.to(torch.int32), seq_lens, block_size, key_cache.device)
    k, v = key_cache[blocks, :, rows], value_cache[blocks, :, rows]
    assert torch.equal(k, torch.cat(keys)) and torch.equal(v, torch.cat(values))


def test_trainer_digests_in_vllm_layout():
    from rl_kernel_core.digest import named_digests, row_digests
    from rl_kernel_vllm.weights import in_engine_layout

    gen = torch.Generator().manual_seed(2)
    q, k, v, g, u, n = (torch.randn(r, 4, generator=gen) for r in (4, 2, 2, 6, 6, 1))
    hf = [
        ("m.0.attn.q_proj.weight", q),
        ("m.0.attn.k_proj.weight", k),
        ("m.0.attn.v_proj.weight", v),
        ("m.0.mlp.up_proj.weight", u),
        ("m.0.mlp.gate_proj.weight", g),
        ("m.0.norm.weight", n[0]),
    ]
    out = in_engine_layout(named_digests(hf))
    assert sorted(out) == ["m.0.attn.qkv_proj.weight", "m.0.mlp.gate_up_proj.weight", "m.0.norm.weight"]
    assert torch.equal(out["m.0.attn.qkv_proj.weight"], row_digests(torch.cat([q, k, v])))
    assert torch.equal(out["m.0.mlp.gate_up_proj.weight"], row_digests(torch.cat([g, u])))


@pytest.mark.parametrize(
    "bad, message",
    [
        ([1.0, 2.0], "m.0.attn.q_proj.weight: row_digests: t must be a torch.Tensor, got list"),
        (
            torch.eye(2).to_sparse(),
            "m.0.attn.q_proj.weight: row_digests: t must be a dense (strided) tensor, got layout sparse_coo",
        ),
    ],
)
def test_a_pushed_tensor_that_cannot_be_digested_is_named(bad, message):
    from rl_kernel_vllm.weights import trainer_digest

    with pytest.raises((TypeError, ValueError)) as info:
        trainer_digest("m.0.attn.q_proj.weight", bad, {"m.0.attn.qkv_proj.weight": torch.bfloat16})
    assert str(info.value) == message
    wide = torch.randn(3, 2, dtype=torch.complex128)  # was a KeyError (16-byte elements)
    assert trainer_digest("m.0.norm.weight", wide, {}).shape == (3,)
