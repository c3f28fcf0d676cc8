"""Mixture-of-experts blocks under the batch-invariant mode (rl_kernel_core.batch_invariant_mode.api_moe): routing
with ties broken by expert index, the experts and combine against an fp64 formula, every row's bits
independent of the batch, and transformers' Qwen3-MoE patched by use_mode_attention: untouched with
the mode off, rollout (KV cache, one token per step) bitwise equal to the training forward with it
on, gradients through the router and the experts. Seeded draws; the seed is printed."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract
from rl_kernel_core.batch_invariant_mode import api_hf
from rl_kernel_core.batch_invariant_mode.api_moe import route, router_logits, sparse_moe, use_mode_moe
from rl_kernel_core.tools.consistency import chain, hf, parity
from rl_kernel_core.tools.random_model import randomize_matrices_, tiny_text_config

transformers = pytest.importorskip("transformers")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _weights(rng: random.Random, dtype: torch.dtype):
    e, h, i = rng.choice([4, 6, 8, 12]), rng.choice([32, 64]), rng.choice([16, 24, 48])
    k = rng.randint(1, min(4, e))
    gate = torch.randn(e, h).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h) * 0.2).to(dtype)
    down = (torch.randn(e, h, i) * 0.2).to(dtype)
    return gate, gate_up, down, k


def test_route_breaks_ties_by_expert_index_and_renormalises():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = route(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]] and ids.dtype == torch.int64 and weights.dtype == torch.float32
    probs = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(weights.double(), probs.gather(1, ids), rtol=1e-6, atol=0)
    normed, same = route(logits, 3, normalize=True)
    assert same.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(normed.sum(-1), torch.ones(2), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="top_k: expected 1..5"):
        route(logits, 6, normalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_rows_do_not_depend_on_their_place_in_the_batch(seed, dtype):
    # every expert count: on the CPU a narrow product (5-7, 9-11 columns on MKL) rounded a row by
    # its position in the mode's 32-row tile until the router padded its width
    rng = random.Random(seed)
    for e in range(1, 41):
        w, x = torch.randn(e, 32).to(dtype), torch.randn(100, 32).to(dtype)
        with rk.batch_invariant():
            full = router_logits(x, w)
            for start in rng.sample(range(1, 60), 4):
                assert torch.equal(router_logits(x[start : start + 40], w), full[start : start + 40]), (
                    f"seed={seed}: {e} experts, rows from {start}"
                )
        torch.testing.assert_close(full.double(), x.double() @ w.double().T, rtol=1e-2, atol=1e-2 * e**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_match_an_fp64_formula(seed, dtype):
    rng = random.Random(seed)
    gate, gate_up, down, k = _weights(rng, dtype)
    x = torch.randn(rng.randint(1, 70), gate.shape[1]).to(dtype)
    normalize = rng.random() < 0.5
    out = sparse_moe(x, gate, gate_up, down, k, normalize)
    assert out.dtype == dtype and out.shape == x.shape
    # fp64 formula on the same routing (the routing itself is checked above)
    weights, ids = route(torch.nn.functional.linear(x, gate), k, normalize)
    want = torch.zeros(x.shape, dtype=torch.float64)
    xd, gu, dn = x.double(), gate_up.double(), down.double()
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(ids[t, j])
            g, u = (gu[e] @ xd[t]).chunk(2)
            want[t] += weights[t, j].double() * (dn[e] @ (torch.nn.functional.silu(g) * u))
    if dtype == torch.float32:
        contract.assert_close(out.double(), want, "reduction", torch.float32, name=f"seed={seed} experts")
    else:  # bf16 products round each expert's intermediate and output to bf16
        torch.testing.assert_close(
            out.double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()), msg=lambda m: f"seed={seed}: {m}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_bitwise_independent_of_the_batch(seed, dtype, device):
    rng = random.Random(seed)
    gate, gate_up, down, k = _weights(rng, dtype)
    gate, gate_up, down = gate.to(device), gate_up.to(device), down.to(device)
    x = torch.randn(rng.randint(40, 120), gate.shape[1]).to(dtype).to(device)
    x[5] = x[9]  # the same token twice in one batch
    normalize = rng.random() < 0.5
    with rk.batch_invariant():
        full = sparse_moe(x, gate, gate_up, down, k, normalize)
        rows = torch.tensor(rng.sample(range(x.shape[0]), rng.randint(1, 9)), device=device)
        part = sparse_moe(x[rows], gate, gate_up, down, k, normalize)
        alone = sparse_moe(x[rows[:1]], gate, gate_up, down, k, normalize)
    assert torch.equal(full[rows], part), f"seed={seed}"
    assert torch.equal(full[rows[:1]], alone), f"seed={seed}"
    assert torch.equal(full[5], full[9]), f"seed={seed}"


@pytest.mark.gpu
def test_rows_are_bitwise_independent_of_the_batch_at_qwen3_30b_a3b_widths(seed):
    """One sparse block of Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8, intermediate 768,
    bf16) on CUDA: a prefill-sized batch against decode-sized subsets of it."""
    gen = torch.Generator("cuda").manual_seed(seed)
    gate = (torch.randn(128, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    gate_up = (torch.randn(128, 1536, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    down = (torch.randn(128, 2048, 768, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(2048, 2048, device="cuda", generator=gen).bfloat16()
    with rk.batch_invariant():
        full = sparse_moe(x, gate, gate_up, down, 8, True)
        for n in (1, 3, 64, 512):
            rows = torch.randperm(2048, device="cuda", generator=gen)[:n]
            assert torch.equal(sparse_moe(x[rows], gate, gate_up, down, 8, True), full[rows]), f"seed={seed} n={n}"


def _tiny_moe(seed: int, dtype: torch.dtype, top_k: int, normalize: bool):
    cfg = transformers.Qwen3MoeConfig(
        **tiny_text_config(vocab_size=101, intermediate_size=96, max_position_embeddings=128),
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=top_k,
        norm_topk_prob=normalize,
    )
    torch.manual_seed(seed)
    model = randomize_matrices_(transformers.Qwen3MoeForCausalLM(cfg).eval(), 0.3)
    return model.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_moe_rollout_equals_training_bitwise_and_off_is_untouched(seed, dtype, device):
    rng = random.Random(seed)
    model = _tiny_moe(seed, dtype, rng.choice([1, 2, 3]), rng.random() < 0.5).to(device)
    ids = torch.randint(3, 101, (3, 11), device=device)
    with torch.no_grad():
        shipped = model(ids).logits
    api_hf.use_mode_attention(model)
    assert use_mode_moe(model) == []  # already patched by use_mode_attention; a second call changes nothing
    with torch.no_grad():
        assert torch.equal(model(ids).logits, shipped), f"seed={seed}: mode off changed the model"
        seqs = [s.to(device) for s in chain.fixed_sequences(101, 5, 7, 14, seed)]
        batch = parity.from_sequences(seqs, "right", [0] * 5, 0)
        with rk.batch_invariant():
            training = hf.training_logprobs(model, batch)
            rollout = hf.rollout_logprobs(model, seqs, 5, 2, pad_id=0)
    for b, (r, t) in enumerate(zip(rollout, training)):
        assert torch.equal(r, t), f"seed={seed}: sequence {b}: rollout and training differ"


def test_gradients_flow_through_router_and_experts(seed):
    model = _tiny_moe(seed, torch.float32, 2, True)
    shipped = copy.deepcopy(model)
    api_hf.use_mode_attention(model)
    ids = torch.randint(3, 101, (2, 9))
    with rk.batch_invariant():
        model(ids, labels=ids).loss.backward()
    shipped(ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), shipped.named_parameters()):
        if "mlp" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"seed={seed} {name}: {m}")


def test_an_uncovered_experts_layout_is_refused():
    model = _tiny_moe(0, torch.float32, 2, True)
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match=r"model.layers.1.mlp: batch-invariant MoE covers concatenated, untransposed"):
        use_mode_moe(model)
