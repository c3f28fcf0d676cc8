"""The VLM consistency chain: a tiny random transformers Qwen2-VL (vision tower, patch merger,
language model with 3-D rotary positions; and a Qwen2.5-VL in fp32) gives each response token the same log-prob bits in
``generate`` over a KV cache and in a training forward, across batch sizes, image counts per batch
and padding side, with batch-invariant mode on (fp32 and bf16, on CPU and on CUDA); the control group (mode
off) shows the drift."""

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract
from rl_kernel_core.batch_invariant_mode import api_hf, api_vlm
from rl_kernel_core.tools.consistency import chain, vlm
from rl_kernel_core.tools.random_model import tiny_text_config

transformers = pytest.importorskip("transformers")

PAD = 0
IMAGE_IDS = (120, 121, 122, 123)  # image, video, vision start, vision end
NEW_TOKENS = 5


def _model(seed: int, dtype: torch.dtype, family: str = "qwen2_vl", device: str = "cpu"):
    """A random tiny Qwen2-VL, or Qwen2.5-VL (its vision tower: windowed attention in block 0, full in
    block 1, RMSNorm, a gated MLP)."""
    text = tiny_text_config(
        vocab_size=128,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=PAD,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    patches = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    tokens = dict(
        image_token_id=IMAGE_IDS[0],
        video_token_id=IMAGE_IDS[1],
        vision_start_token_id=IMAGE_IDS[2],
        vision_end_token_id=IMAGE_IDS[3],
    )
    if family == "qwen2_vl":
        cfg = transformers.Qwen2VLConfig(
            text_config=text,
            **tokens,
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, **patches),
        )
        model_class = transformers.Qwen2VLForConditionalGeneration
    else:
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text,
            **tokens,
            vision_config=dict(
                depth=2,
                hidden_size=32,
                out_hidden_size=64,
                intermediate_size=64,
                num_heads=2,
                window_size=16,
                fullatt_block_indexes=[1],
                **patches,
            ),
        )
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    return model_class(cfg).eval().to(device=device, dtype=dtype), cfg


def _prompts(seed: int, cfg, dtype: torch.dtype) -> list[vlm.Sample]:
    """Four prompts with 1, 2, 1 and 3 images of different grids, text around them."""
    g = torch.Generator().manual_seed(seed)

    def text():
        return torch.randint(2, IMAGE_IDS[0], (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()

    layouts = [[(1, 4, 4)], [(1, 2, 6), (1, 4, 4)], [(1, 6, 4)], [(1, 4, 2), (1, 2, 2), (1, 4, 4)]]
    out = []
    for grids in layouts:
        p = vlm.image_prompt([text() for _ in range(len(grids) + 1)], grids, cfg, g)
        out.append(
            vlm.Sample(p.input_ids, p.mm_token_type_ids, p.pixel_values.to(dtype), p.image_grid_thw, p.prompt_len)
        )
    return out


def _layouts(model, prompts):
    """Rollout log-probs (one generate over all prompts), and the same tokens' log-probs in other
    rollout batches and in training forwards of several batch sizes, image counts and padding sides."""
    samples, rollout = vlm.generate_logprobs(model, prompts, NEW_TOKENS, PAD, IMAGE_IDS)
    others = {
        "generate, batch of 1 (2 images)": (
            [1],
            vlm.generate_logprobs(model, prompts[1:2], NEW_TOKENS, PAD, IMAGE_IDS)[1],
        ),
        "generate, batch of 2 (1 + 3 images)": (
            [0, 3],
            vlm.generate_logprobs(model, [prompts[0], prompts[3]], NEW_TOKENS, PAD, IMAGE_IDS)[1],
        ),
        "training, right-padded batch of 4": ([0, 1, 2, 3], vlm.training_logprobs(model, samples, "right", PAD)),
        "training, left-padded batch of 4": ([0, 1, 2, 3], vlm.training_logprobs(model, samples, "left", PAD)),
        "training, batch of 1": ([3], vlm.training_logprobs(model, samples[3:], "right", PAD)),
        "training, left-padded batch of 2 (3 + 1 images)": (
            [3, 2],
            vlm.training_logprobs(model, [samples[3], samples[2]], "left", PAD),
        ),
    }
    return samples, rollout, others


DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


@DEVICES
@pytest.mark.parametrize(
    "dtype, family", [(torch.float32, "qwen2_vl"), (torch.bfloat16, "qwen2_vl"), (torch.float32, "qwen2_5_vl")]
)
def test_mode_on_generate_equals_training_bitwise_across_batches_images_and_padding(seed, dtype, family, device):
    model, cfg = _model(seed, dtype, family, device)
    assert api_vlm.use_mode_vlm(model) == ["model.visual.patch_embed.proj"]
    prompts = _prompts(seed, cfg, dtype)
    with torch.no_grad():
        with rk.batch_invariant():
            samples, rollout, others = _layouts(model, prompts)
        off = vlm.training_logprobs(model, samples, "right", PAD)
    for what, (rows, lps) in others.items():
        for r, lp in zip(rows, lps):
            assert lp.shape == (NEW_TOKENS,) and torch.equal(lp, rollout[r]), (
                f"{what}: sample {r} differs from the rollout by {float((lp - rollout[r]).abs().max()):.3g}"
            )
    # the mode changes kernels, not meaning: the library path (sdpa, full attention in the vision
    # tower, causal in the language model) gives the same values within the contract
    for r, (a, b) in enumerate(zip(rollout, off)):
        contract.assert_close(a, b, "logprob", dtype, name=f"sample {r}, mode on vs off")


BF16_MODEL_DRIFT_BOUND = 0.5


CONTROL_SEEDS = 5


@DEVICES
def test_mode_off_drift_is_measured(seed, device):
    """Control group: the same comparisons with the mode off give finite differences, and some are
    nonzero (in fp32 or bf16), which is what makes the mode-on checks mean something on this machine.

    At these sizes cuBLAS and sdpa can give equal bits for every layout of one seed's token counts
    (seen on an H200), so the control tries up to CONTROL_SEEDS models (seed, seed + 1, ...) and
    needs a nonzero drift in one of them; every one is held to the bounds.

    fp32 drift is held to one op's log-prob contract. bf16 drift compounds bf16 rounding through
    the whole model (0.166 was seen for one seed), which one op's contract does not bound, so it is
    held to a sanity bound, BF16_MODEL_DRIFT_BOUND: a mismatched layout gives differences of the
    log-probs' own size, several nats."""
    drift: dict[str, float] = {}
    for s in range(seed, seed + CONTROL_SEEDS):
        for dtype in (torch.float32, torch.bfloat16):
            model, cfg = _model(s, dtype, device=device)
            api_vlm.use_mode_vlm(model)
            with torch.no_grad():
                _, rollout, others = _layouts(model, _prompts(s, cfg, dtype))
            tol = contract.tolerance("logprob", dtype)
            bound = tol.atol + tol.rtol * max(float(r.abs().max()) for r in rollout)
            if dtype == torch.bfloat16:
                bound = BF16_MODEL_DRIFT_BOUND
            for what, (rows, lps) in others.items():
                d = chain.max_abs_diff(lps, [rollout[r] for r in rows])
                assert 0.0 <= d <= bound, f"seed {s}, {contract.dtype_key(dtype)} {what}: {d}"
                drift[f"seed {s}, {contract.dtype_key(dtype)} {what}"] = d
        if max(drift.values()) > 0.0:
            break
    print(f"mode off drift: {drift}")
    assert max(drift.values()) > 0.0, (
        f"mode off gave bitwise equal log-probs everywhere, so the mode-on checks show nothing: {drift}"
    )


@pytest.mark.parametrize(
    "conv, shape",
    [
        (torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4)), (5, 3, 2, 4, 4)),  # Qwen2-VL's patch embedding
        (torch.nn.Conv2d(3, 8, 4, stride=4, bias=False), (2, 3, 10, 13)),  # whole images, a remainder dropped
    ],
)
def test_patch_product_equals_the_convolution_and_is_batch_invariant(seed, conv, shape):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(conv)
    x = torch.randn(shape)
    expected = conv(x)
    assert api_vlm.use_mode_patch_convolutions(model) == ["0"] and type(conv).__name__.startswith("ModePatch")
    assert torch.equal(conv(x), expected), "mode off must be the library convolution"
    with torch.no_grad(), rk.batch_invariant():
        got = conv(x)
        alone = conv(x[1:2])
    contract.assert_close(got, expected, "reduction", torch.float32, name="patch product vs convolution")
    assert torch.equal(alone, got[1:2]), "a patch's embedding changed with the batch"


def test_use_mode_vlm_keeps_parameters_and_is_idempotent(seed):
    model, _ = _model(seed, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    assert api_vlm.use_mode_vlm(model) == api_vlm.use_mode_vlm(model) == ["model.visual.patch_embed.proj"]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    assert [id(p) for p in model.parameters()] == params


def test_use_mode_patch_convolutions_refuses_a_convolution_it_cannot_route():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1))
    with pytest.raises(ValueError, match="convolution '0'.*not a patchify convolution"):
        api_vlm.use_mode_patch_convolutions(model)


def test_layouts_reject_bad_arguments(seed):
    model, cfg = _model(seed, torch.float32)
    prompts = _prompts(seed, cfg, torch.float32)
    with pytest.raises(ValueError, match="side must be 'left' or 'right', got 'middle'"):
        vlm.pad(prompts, "middle", PAD)
    with pytest.raises(ValueError, match="at least one sample"):
        vlm.pad([], "left", PAD)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        vlm.generate_logprobs(model, prompts, 0, PAD)
    with pytest.raises(ValueError, match=r"one more piece than grids \(2\), got 1"):
        vlm.image_prompt([[5]], [(1, 4, 4)], cfg)
    with pytest.raises(ValueError, match=r"t == 1 and h, w multiples of 2, got \(1, 3, 4\)"):
        vlm.image_prompt([[5], [6]], [(1, 3, 4)], cfg)
    with pytest.raises(ValueError, match="at least one image grid"):
        vlm.image_prompt([[5]], [], cfg)


def test_mode_attention_full_attention_needs_as_many_queries_as_keys(seed):
    """A full-attention call (a vision block's) with fewer queries than keys has no bottom-right
    reading; the mode refuses it rather than attend causally."""
    torch.manual_seed(seed)
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with (
        rk.batch_invariant(),
        pytest.raises(ValueError, match="full attention needs as many queries as keys; got Lq=3, Lk=5"),
    ):
        api_hf.mode_attention(torch.nn.Module(), q, kv, kv, None, is_causal=False)
