"""The multimodal batch schema: built from a real Qwen2-VL processor's output, its 3-D positions
against transformers' own ``get_rope_index``, and validation errors naming field and position."""

import dataclasses

import numpy as np
import pytest
import torch

from rl_kernel_core.contract import assert_close

from rl_kernel_core.multimodal.schema import MultimodalBatch, ProcessorFingerprint, Span
from tiny_vlm_processor import IMAGE, random_images, tiny_processor

TEXTS = [f"<|im_start|> w1 {IMAGE} w2 w3 {IMAGE} <|im_end|> w5 w6 w7", f"w4 {IMAGE} w5 w9"]
SIZES = [(56, 84), (28, 56), (56, 56)]


def encode(processor, seed, *, padding_side="right", texts=TEXTS, sizes=SIZES):
    processor.tokenizer.padding_side = padding_side
    images = random_images(np.random.default_rng(seed), sizes)
    return processor(text=texts, images=images, padding=True, return_tensors="pt")


def answer_spans(encoded, lengths=(3, 2)):
    """The last ``lengths[b]`` real tokens of each sequence as its loss span."""
    real = encoded["attention_mask"].sum(-1).tolist()
    return [[(n - k, k)] for n, k in zip(real, lengths)]


def build(seed, **kwargs):
    processor = tiny_processor()
    encoded = encode(processor, seed, **kwargs)
    return MultimodalBatch.from_processor(processor, encoded, loss_spans=answer_spans(encoded)), encoded


def test_from_processor_finds_each_image_and_its_tokens(seed):
    batch, encoded = build(seed)
    counts = [int(t * h * w) // 4 for t, h, w in encoded["image_grid_thw"].tolist()]
    image_spans = [[s for s in spans if s.kind == "image"] for spans in batch.modality_spans]
    assert [[s.length for s in spans] for spans in image_spans] == [counts[:2], counts[2:]]
    for b, spans in enumerate(batch.modality_spans):
        for s in spans:
            tokens = batch.input_ids[b][s.start:s.end]
            assert bool((tokens == 4).all()) == (s.kind == "image")
        assert sum(s.length for s in spans) == batch.input_ids[b].shape[0]
    assert batch.vision_token_offsets == [[0, counts[0]], [counts[0] + counts[1]]]
    assert batch.media_ids == batch.media_cache_keys
    assert len({k for keys in batch.media_cache_keys for k in keys}) == 3
    assert batch.fingerprint.image_token_id == 4 and batch.fingerprint.merge_size == 2 and batch.fingerprint.patch_size == 14
    assert batch.loss_spans[1] == [Span("text", batch.input_ids[1].shape[0] - 2, 2)]


def test_positions_match_transformers_get_rope_index(seed):
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    config = Qwen2VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=16, mlp_ratio=2, spatial_merge_size=2, patch_size=14),
    )
    model = Qwen2VLModel(config)
    for side in ("left", "right"):
        batch, encoded = build(seed, padding_side=side)
        expected, _ = model.get_rope_index(encoded["input_ids"], encoded["mm_token_type_ids"], encoded["image_grid_thw"],
                                           attention_mask=encoded["attention_mask"])
        assert batch.position_ids.shape == (3, *encoded["input_ids"].shape)
        assert torch.equal(batch.position_ids, expected)


def test_processor_positions_and_media_ids_are_taken_as_given(seed):
    processor = tiny_processor()
    encoded = dict(encode(processor, seed))
    encoded["position_ids"] = torch.randint(0, 50, (3, *encoded["input_ids"].shape))
    batch = MultimodalBatch.from_processor(processor, encoded, loss_spans=answer_spans(encoded), media_ids=[["a", "b"], ["c"]])
    assert torch.equal(batch.position_ids, encoded["position_ids"]) and batch.media_ids == [["a", "b"], ["c"]]


def test_padding_side_does_not_change_the_sequences(seed):
    left, _ = build(seed, padding_side="left")
    right, _ = build(seed, padding_side="right")
    assert all(torch.equal(a, b) for a, b in zip(left.input_ids, right.input_ids))
    assert left.modality_spans == right.modality_spans and left.media_cache_keys == right.media_cache_keys
    assert all(torch.equal(left.real_positions(b), right.real_positions(b)) for b in range(2))
    assert torch.equal(left.padded_input_ids(1)[left.attention_mask.bool()], right.padded_input_ids(1)[right.attention_mask.bool()])


def test_fingerprint_follows_the_processor_settings():
    base = ProcessorFingerprint.of(tiny_processor())
    assert ProcessorFingerprint.of(tiny_processor()) == base
    assert ProcessorFingerprint.of(tiny_processor(merge_size=1)).merge_size == 1
    other = tiny_processor()
    other.chat_template = other.chat_template + " "
    assert ProcessorFingerprint.of(other).chat_template_sha256 != base.chat_template_sha256


def _broken(batch, field, value):
    return dataclasses.replace(batch, **{field: value})


@pytest.mark.parametrize("field, make, message", [
    ("loss_spans", lambda b, n: [[Span("text", n[0] - 2, 9)], b.loss_spans[1]],
     r"loss_spans\[0\]\[0\]: start \d+ \+ length 9 exceeds the sequence length \d+"),
    ("loss_spans", lambda b, n: [b.loss_spans[0], [Span("text", 0, 1)]], r"loss_spans\[1\]\[0\]: start 0 must be >= 1"),
    ("loss_spans", lambda b, n: [[Span("text", 3, 2)], b.loss_spans[1]], r"loss_spans\[0\]\[0\]: tokens \[3, 5\) overlap image 0"),
    ("loss_spans", lambda b, n: [b.loss_spans[0], [Span("image", 1, 1)]], r"loss_spans\[1\]\[0\]: loss spans score text tokens"),
    ("modality_spans", lambda b, n: [b.modality_spans[0][:-1], b.modality_spans[1]],
     r"modality_spans\[0\]: cover tokens \[0, \d+\), expected the whole sequence"),
    ("modality_spans", lambda b, n: [b.modality_spans[0], [Span("text", 0, 1), *b.modality_spans[1][1:]]],
     r"modality_spans\[1\]\[1\]: starts at 2, expected 1"),
    ("modality_spans", lambda b, n: [b.modality_spans[0], [Span("audio", 0, n[1])]], r"modality_spans\[1\]\[0\]: kind must be one of"),
    ("vision_token_offsets", lambda b, n: [b.vision_token_offsets[0], [0]], r"vision_token_offsets\[1\]\[0\]: must be \d+"),
    ("media_ids", lambda b, n: [["x"], ["y"]], r"media_ids\[0\]: must hold one entry per media item \(2\), got 1"),
    ("media_cache_keys", lambda b, n: [b.media_cache_keys[0]], r"media_cache_keys: must be a list with one entry per sequence"),
    ("position_ids", lambda b, n: b.position_ids[:2], r"position_ids: must have shape"),
    ("input_ids", lambda b, n: [b.input_ids[0][:-1], b.input_ids[1]], r"attention_mask\[0\]: \d+ real tokens, but input_ids\[0\] holds"),
    ("input_ids", lambda b, n: [b.input_ids[0].to(torch.int32), b.input_ids[1]], r"input_ids\[0\]: must be a 1-D int64 tensor"),
])
def test_validate_names_the_field_and_position(seed, field, make, message):
    batch, _ = build(seed)
    lengths = [t.shape[0] for t in batch.input_ids]
    with pytest.raises(ValueError, match=message):
        _broken(batch, field, make(batch, lengths)).validate()


def test_a_loss_span_over_a_tool_observation_is_refused(seed):
    """Tool observation tokens are not the policy's: a loss span that scores one is refused."""
    batch, _ = build(seed)
    scored = batch.loss_spans[1][0]
    spans = [dataclasses.replace(m, kind="tool") if m.start <= scored.start < m.end else m for m in batch.modality_spans[1]]
    tool = next(m for m in spans if m.kind == "tool")
    with pytest.raises(ValueError, match=rf"loss_spans\[1\]\[0\]: tokens \[{scored.start}, {scored.end}\) overlap tool at "
                                         rf"\[{tool.start}, {tool.end}\)"):
        dataclasses.replace(batch, modality_spans=[batch.modality_spans[0], spans]).validate()


def test_image_tokens_where_the_span_says_text_are_refused(seed):
    batch, _ = build(seed)
    ids = batch.input_ids[1].clone()
    text = batch.modality_spans[1][0]
    spans = [Span("text", 0, 1), Span("image", 1, text.length - 1 + batch.modality_spans[1][1].length, 0), *batch.modality_spans[1][2:]]
    ids[1:text.end] = 4
    with pytest.raises(ValueError, match=r"modality_spans\[1\]\[1\]: token \d+ is \d+, not the image token 4"):
        dataclasses.replace(batch, input_ids=[batch.input_ids[0], batch.input_ids[1]], modality_spans=[batch.modality_spans[0], spans]).validate()


def test_processor_output_that_disagrees_with_its_grid_is_refused(seed):
    processor = tiny_processor()
    encoded = dict(encode(processor, seed))
    grid = encoded["image_grid_thw"].clone()
    grid[0, 2] += 2
    encoded["image_grid_thw"] = grid
    with pytest.raises(ValueError, match=r"input_ids\[0\]\[\d+\]: image 0 needs \d+ image tokens"):
        MultimodalBatch.from_processor(processor, encoded, loss_spans=answer_spans(encoded))
    encoded["image_grid_thw"] = torch.cat([encoded["image_grid_thw"][:1] * 0 + torch.tensor([1, 2, 2])] * 4)
    with pytest.raises(ValueError, match=r"image_grid_thw"):
        MultimodalBatch.from_processor(processor, encoded, loss_spans=answer_spans(encoded))


def test_bad_processor_arguments_are_refused(seed):
    processor = tiny_processor()
    encoded = dict(encode(processor, seed))
    with pytest.raises(ValueError, match=r"loss_spans must hold one list per sequence \(2\), got 1"):
        MultimodalBatch.from_processor(processor, encoded, loss_spans=[[(3, 1)]])
    with pytest.raises(ValueError, match=r"loss_spans\[0\]\[0\]: must be a Span or a \(start, length\) pair"):
        MultimodalBatch.from_processor(processor, encoded, loss_spans=[[(3, 1, 2)], [(3, 1)]])
    with pytest.raises(ValueError, match=r"video inputs are not covered"):
        MultimodalBatch.from_processor(processor, {**encoded, "video_grid_thw": torch.ones(1, 3, dtype=torch.long)},
                                       loss_spans=answer_spans(encoded))
    with pytest.raises(ValueError, match=r"encoded\['input_ids'\]: must be an integer tensor, got list"):
        MultimodalBatch.from_processor(processor, {**encoded, "input_ids": encoded["input_ids"].tolist()}, loss_spans=answer_spans(encoded))
    with pytest.raises(ValueError, match=r"encoded\['pixel_values'\]: \d+ patch rows, but image_grid_thw needs"):
        MultimodalBatch.from_processor(processor, {**encoded, "pixel_values": encoded["pixel_values"][1:]}, loss_spans=answer_spans(encoded))


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_scored_rows_score_the_loss_spans_tokens(seed, padding_side):
    import rl_kernel_core as rk

    batch, encoded = build(seed, padding_side=padding_side)
    ids = batch.padded_input_ids(1)
    hidden = torch.randn(*ids.shape, 8)
    weight = torch.randn(64, 8)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], 1)], dim=1)
    rows = batch.scored_rows()
    scored = rk.linear_logprob(hidden, weight, targets, loss_spans=rows)
    for b, spans in enumerate(batch.loss_spans):
        real = batch.attention_mask[b].nonzero().flatten()
        for s in spans:
            positions = real[s.start - 1:s.end - 1]
            assert torch.equal(targets[b, positions], batch.input_ids[b][s.start:s.end])
            want = rk.linear_logprob(hidden[b, positions], weight, batch.input_ids[b][s.start:s.end])
            # within the contract: on CPU the torch backend's matmul is not row-invariant (MKL picks
            # its blocking, and under load its thread count, by the call); a wrong row is far off
            assert_close(scored[b, positions], want, "logprob", torch.float32, f"sequence {b} span {s}")
    assert int((scored != 0).sum()) == sum(s.length for spans in batch.loss_spans for s in spans)


def test_llava_processor_one_image_per_run_and_1d_positions(seed):
    """A processor without image_grid_thw (LLaVA: each image one run of its token, pixel_values
    [num_images, C, H, W]) gives one image span per run and 1-D positions."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vocab = ["<unk>", "<pad>", "<image>", *(f"w{i}" for i in range(20))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", additional_special_tokens=["<image>"])
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default")
    pictures = random_images(np.random.default_rng(seed % 2**32), [(40, 40), (30, 50), (40, 40)])
    encoded = processor(text=["w1 <image> w2 w3", "w3 w4 <image> w5 <image> w6"], images=pictures, padding=True, return_tensors="pt")
    per_image = 4 - 1  # (28 / 14)² patches, the CLS feature dropped ("default" strategy)
    batch = MultimodalBatch.from_processor(processor, encoded, loss_spans=[[(5, 1)], [(9, 1)]])
    assert [[(s.start, s.length) for s in spans if s.kind == "image"] for spans in batch.modality_spans] == \
        [[(1, per_image)], [(2, per_image), (6, per_image)]]
    assert batch.fingerprint.patch_size == 14 and batch.fingerprint.merge_size is None and batch.fingerprint.image_token_id == 2
    assert batch.position_ids.shape == encoded["input_ids"].shape
    assert batch.real_positions(1).tolist() == list(range(10))
    assert len({k for keys in batch.media_cache_keys for k in keys}) == 3
