"""The consistency chain: a Qwen3-style decoder's per-token log-probs of a fixed set of sequences,
bitwise identical across batch sizes, left/right padding, packed layout and KV-cache decoding vs
one full forward with batch-invariant mode on; the control group (mode off) is measured.

What holds in backward with the mode on, and is asserted bitwise: a sequence's gradient with respect
to its own token activations (every op on that path is row-wise, or a fixed-shape tile of its own
sequence). What does not: weight gradients, which sum over all rows of the batch (the GEMM's
reduction dim is the token count, so its blocking changes with the batch); they are asserted to the
contract's gradient tolerance only.
"""

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract
from rl_kernel_core.tools.consistency import chain
from rl_kernel_core.tools.consistency.model import TinyConfig, TinyDecoder

CONFIG = TinyConfig()
GPU_CONFIG = TinyConfig(
    vocab_size=32000, hidden_size=512, num_layers=3, num_heads=8, num_kv_heads=4, head_dim=128, intermediate_size=1536
)


def _setup(seed, device="cpu", count=8, max_len=22, config=CONFIG, dtype=torch.float32):
    torch.manual_seed(seed)
    model = TinyDecoder(config).to(device=device, dtype=dtype)
    seqs = [s.to(device) for s in chain.fixed_sequences(config.vocab_size, count, 6, max_len, seed)]
    return model, seqs


def _assert_all_equal(got, expected, what):
    for b, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"{what}: sequence {b} differs by {float((g - e).abs().max()):.3g}"


def _check_invariance(model, seqs, sizes):
    with rk.batch_invariant(), torch.no_grad():
        ref = chain.packed_logprobs(model, seqs)
        for n in sizes:
            _assert_all_equal(chain.packed_logprobs(model, seqs[:n]), ref[:n], f"packed batch of {n}")
            _assert_all_equal(chain.packed_logprobs(model, seqs[-n:]), ref[-n:], f"packed batch of the last {n}")
        _assert_all_equal(chain.packed_logprobs(model, seqs[::-1]), ref[::-1], "packed batch in reverse order")
        for side in ("left", "right"):
            _assert_all_equal(chain.padded_logprobs(model, seqs, side), ref, f"{side}-padded batch")
        _assert_all_equal(chain.decode_logprobs(model, seqs, prompt_len=4), ref, "KV-cache decode")


def test_mode_on_logprobs_bitwise_across_batch_sizes_padding_packing_and_decode(seed):
    model, seqs = _setup(seed)
    _check_invariance(model, seqs, sizes=(1, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mode_on_logprobs_bitwise_on_gpu_up_to_64_sequences(seed, dtype):
    model, seqs = _setup(seed, device="cuda", count=64, max_len=200, config=GPU_CONFIG, dtype=dtype)
    _check_invariance(model, seqs, sizes=(1, 3, 8, 17, 33))


@pytest.mark.gpu
def test_mode_on_backward_on_gpu(seed):
    model, seqs = _setup(seed, device="cuda", count=16, max_len=120, config=GPU_CONFIG, dtype=torch.bfloat16)
    with rk.batch_invariant():
        alone_act, _ = _grads(model, seqs[5:6], 0)
        batch_act, _ = _grads(model, seqs, 5)
    assert torch.equal(alone_act, batch_act), "a sequence's activation gradient changed with the batch"


@pytest.mark.gpu
def test_mode_off_drift_on_gpu_is_measured(seed):
    """Control group on the GPU: cuBLAS and SDPA pick kernels by shape; the drift is printed."""
    model, seqs = _setup(seed, device="cuda", count=64, max_len=200, config=GPU_CONFIG, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = chain.packed_logprobs(model, seqs)
        drift = {
            "batch of 1": chain.max_abs_diff(chain.packed_logprobs(model, seqs[:1]), ref[:1]),
            "decode": chain.max_abs_diff(chain.decode_logprobs(model, seqs[:8], prompt_len=4), ref[:8]),
        }
    print(f"mode off drift on GPU (bf16): {drift}")
    assert all(d == d for d in drift.values())
    assert max(drift.values()) > 0.0, (
        f"mode off gave bitwise equal log-probs, so the mode-on checks show nothing: {drift}"
    )


def _grads(model, seqs, index):
    """Gradient of sequence ``index``'s summed log-prob w.r.t. its token activations and the weights."""
    acts = []

    def keep(mod, inp, out):
        acts.append(out)
        out.retain_grad()

    hook = model.embed_tokens.register_forward_hook(keep)
    try:
        lp = chain.packed_logprobs(model, seqs)
        model.zero_grad()
        lp[index].sum().backward()
    finally:
        hook.remove()
    start = sum(len(s) for s in seqs[:index])
    act_grad = acts[0].grad[start : start + len(seqs[index])].clone()
    return act_grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_mode_on_backward_activation_grads_bitwise_weight_grads_within_contract(seed):
    model, seqs = _setup(seed, count=5, max_len=14)
    with rk.batch_invariant():
        alone_act, alone_w = _grads(model, seqs[2:3], 0)
        batch_act, batch_w = _grads(model, seqs, 2)
    assert torch.equal(alone_act, batch_act), "a sequence's activation gradient changed with the batch"
    tol = contract.tolerance("gradient", torch.float32)
    for name, g in alone_w.items():
        bound = tol.atol * float(g.abs().max()) + tol.rtol * batch_w[name].abs()
        assert bool(((batch_w[name] - g).abs() <= bound).all()), f"weight gradient {name} beyond the contract"


def test_mode_off_drift_is_measured(seed):
    """Control group: the same comparisons with the mode off give finite, measured differences
    within the log-prob contract (bitwise equality is not promised there), and some are nonzero,
    which is what makes the mode-on checks mean something on this machine."""
    model, seqs = _setup(seed, count=4, max_len=20)
    with torch.no_grad():
        ref = chain.packed_logprobs(model, seqs)
        drift = {
            "batch of 1": chain.max_abs_diff(chain.packed_logprobs(model, seqs[:1]), ref[:1]),
            "left padding": chain.max_abs_diff(chain.padded_logprobs(model, seqs, "left"), ref),
            "decode": chain.max_abs_diff(chain.decode_logprobs(model, seqs, prompt_len=3), ref),
        }
    tol = contract.tolerance("logprob", torch.float32)
    for what, d in drift.items():
        assert 0.0 <= d <= tol.atol + tol.rtol * max(float(r.abs().max()) for r in ref), f"{what}: {d}"
    if max(drift.values()) == 0.0:
        pytest.skip(f"this machine's CPU kernels gave bitwise equal log-probs with the mode off too: {drift}")


def test_max_abs_diff_measures_the_largest_gap(seed):
    a = [torch.randn(5), torch.randn(3)]
    b = [a[0].clone(), a[1].clone()]
    assert chain.max_abs_diff(a, b) == 0.0
    b[1][2] += 0.25
    assert chain.max_abs_diff(a, b) == pytest.approx(0.25, rel=1e-6)


def test_layouts_reject_bad_arguments(seed):
    model, seqs = _setup(seed, count=2, max_len=8)
    with pytest.raises(ValueError, match="side"):
        chain.padded_logprobs(model, seqs, "middle")
    with pytest.raises(ValueError, match="prompt_len"):
        chain.decode_logprobs(model, seqs, prompt_len=50)
