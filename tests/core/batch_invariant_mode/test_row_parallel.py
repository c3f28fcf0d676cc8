"""The trainer's row-parallel split at any tensor parallel size: ``use_row_parallel_split(model, N)``
gives, bit for bit under the batch-invariant mode, the explicit rank-ordered sum of N ranks' partial
products (float32 accumulation in rank order 0..N-1, one rounding to the model dtype), the sum a
vLLM engine at TP=N computes under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1``; sizes that do not divide the
model's dims are refused by name."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.batch_invariant_mode import api_hf
from rl_kernel_core.batch_invariant_mode.api_row_parallel import check_split, rank_order_sum

transformers = pytest.importorskip("transformers")


def _fold(parts: list[torch.Tensor]) -> torch.Tensor:
    """The oracle: numpy's float32 additions in rank order, then torch's rounding to the parts' dtype."""
    acc = parts[0].float().numpy().copy()
    for p in parts[1:]:
        acc = np.add(acc, p.float().numpy(), dtype=np.float32)
    return torch.from_numpy(acc).to(parts[0].dtype)


def _model(rng: random.Random, parts: int, dtype: torch.dtype):
    heads = parts * rng.choice([1, 2])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    cfg = transformers.Qwen3Config(
        vocab_size=97,
        hidden_size=rng.choice([32, 48]),
        num_hidden_layers=2,
        intermediate_size=parts * rng.choice([4, 8, 12]),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=rng.choice([8, 16]),
        max_position_embeddings=64,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rank_order_sum_is_the_float32_fold_in_rank_order(seed, dtype):
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        shape = tuple(
            int(s) for s in torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
        )
        scale = torch.exp2(torch.randint(-6, 7, (n, 1), generator=gen).float())
        parts = [(torch.randn(shape, generator=gen) * scale[r]).to(dtype) for r in range(n)]
        before = [p.clone() for p in parts]
        out = rank_order_sum(parts)
        assert out.dtype == dtype and out.shape == shape
        assert torch.equal(out, _fold(parts)), f"seed={seed} n={n} shape={shape}"
        assert all(torch.equal(p, b) for p, b in zip(parts, before)), "the partials were modified"
        if n == 2:  # two partials: the model-dtype addition, in either order
            assert torch.equal(out, parts[0] + parts[1]) and torch.equal(out, parts[1] + parts[0])


def test_rank_order_sum_rounds_once_to_the_model_dtype():
    """bf16 partials 1, 2**-8, 2**-8: float32 accumulation gives 1 + 2**-7 (exact in bf16), where
    adding in bf16 rank by rank rounds 1 + 2**-8 to 1 (ties to even) twice."""
    parts = [
        torch.tensor([1.0, -1.0]).bfloat16(),
        torch.tensor([2**-8, -(2**-8)]).bfloat16(),
        torch.tensor([2**-8, -(2**-8)]).bfloat16(),
    ]
    assert rank_order_sum(parts).tolist() == [1 + 2**-7, -1 - 2**-7]
    assert ((parts[0] + parts[1]) + parts[2]).tolist() == [1.0, -1.0]


def test_rank_order_sum_refuses_mixed_partials():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match=r"parts\[1\]: expected shape \(3,\), dtype torch.float32"):
        rank_order_sum([a, torch.zeros(4)])
    with pytest.raises(ValueError, match=r"parts\[2\]: .*got shape \(3,\), dtype torch.bfloat16"):
        rank_order_sum([a, a, a.bfloat16()])
    with pytest.raises(TypeError, match="parts: expected floating tensors, got dtype torch.int64"):
        rank_order_sum([torch.zeros(3, dtype=torch.long)] * 3)
    with pytest.raises(ValueError, match="parts: expected at least one"):
        rank_order_sum([])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_parallel_split_equals_the_rank_ordered_sum_of_partial_products(seed, dtype):
    """For drawn N (1..8) and dims divisible by N: each decoder layer's o_proj and down_proj, split,
    give bitwise the oracle's rank-ordered sum of the N ranks' products (rank r: the r-th contiguous
    slice of the input features times the weight's matching columns, a contiguous copy as the
    engine rank holds it, under the mode's matmul); the whole model's logits follow; bf16 at N >= 2
    differs from the unsplit layer (the partials' extra roundings), within their bound."""
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(3):
        parts = rng.randint(1, 8)
        model = _model(rng, parts, dtype)
        ids = torch.randint(3, 97, (2, rng.randint(2, 9)), generator=torch.Generator().manual_seed(seed))
        layers = [(name, module) for name, module in model.named_modules() if name.endswith(api_hf.ROW_PARALLEL)]
        xs = {name: torch.randn(3, 4, m.in_features).to(dtype) for name, m in layers}
        with torch.no_grad(), rk.batch_invariant():
            whole = {name: m(xs[name]) for name, m in layers}
            names = api_hf.use_row_parallel_split(model, parts)
            assert names == ([] if parts == 1 else [n for n, _ in layers]), names
            for name, m in layers:
                w = m.in_features // parts
                ranks = [
                    torch.nn.functional.linear(
                        xs[name][..., r * w : (r + 1) * w].contiguous(), m.weight[:, r * w : (r + 1) * w].clone()
                    )
                    for r in range(parts)
                ]
                split = m(xs[name])
                assert torch.equal(split, _fold(ranks)), f"seed={seed} parts={parts} {name}"
                if parts == 1:
                    assert torch.equal(split, whole[name])
                else:  # each partial and the sum round once more (eps 2**-8 in bf16), beside the float32 accumulation
                    eps = 2**-8 if dtype == torch.bfloat16 else 2**-23
                    size = xs[name].float().abs() @ m.weight.float().abs().T
                    bound = ((parts + 2) * eps + m.in_features * 2**-23) * size
                    assert ((split.float() - whole[name].float()).abs() <= bound).all(), (
                        f"seed={seed} parts={parts} {name}"
                    )
            logits = model(input_ids=ids).logits
            again = model(input_ids=ids).logits
        assert torch.equal(logits, again)


def test_row_parallel_split_refuses_what_it_cannot_reproduce():
    rng = random.Random(0)
    model = _model(rng, 4, torch.float32)  # 4 or 8 heads, intermediate a multiple of 4
    heads = model.config.num_attention_heads
    with pytest.raises(ValueError, match=f"^parts=3 does not divide the model's num_attention_heads={heads}"):
        api_hf.use_row_parallel_split(model, 3)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"^parts: expected an integer >= 1, got {bad}$"):
            api_hf.use_row_parallel_split(model, bad)
    wrong: list[Any] = [True, 2.0, "2"]
    for value in wrong:
        with pytest.raises(TypeError, match=r"^parts: expected an integer >= 1, got .* \((bool|float|str)\)$"):
            api_hf.use_row_parallel_split(model, value)
    cfg = transformers.Qwen3Config(num_attention_heads=8, intermediate_size=36)
    with pytest.raises(ValueError, match="^tensor_parallel_size=8 does not divide the model's intermediate_size=36"):
        check_split(cfg, 8, "tensor_parallel_size")
    check_split(cfg, 4, "tensor_parallel_size")
    check_split(None, 5)
    biased = _model(rng, 2, torch.float32)
    biased.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(biased.config.hidden_size))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj: a row-parallel linear with a bias"):
        api_hf.use_row_parallel_split(biased, 2)
