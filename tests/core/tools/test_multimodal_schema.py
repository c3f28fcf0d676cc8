"""The multimodal batch schema: built from a real Qwen2-VL processor's output, its 3-D positions
against transformers' own ``get_rope_index``, and validation errors naming field and position."""

import dataclasses
import random
from typing import Any, Callable

import numpy as np
import pytest
import torch

from rl_kernel_core._checks import brief
from rl_kernel_core.contract import assert_close

from rl_kernel_core.tools.multimodal.schema import MultimodalBatch, ProcessorFingerprint, Span
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
            tokens = batch.input_ids[b][s.start : s.end]
            assert bool((tokens == 4).all()) == (s.kind == "image")
        assert sum(s.length for s in spans) == batch.input_ids[b].shape[0]
    assert batch.vision_token_offsets == [[0, counts[0]], [counts[0] + counts[1]]]
    assert batch.media_ids == batch.media_cache_keys
    assert len({k for keys in batch.media_cache_keys for k in keys}) == 3
    assert (
        batch.fingerprint.image_token_id == 4
        and batch.fingerprint.merge_size == 2
        and batch.fingerprint.patch_size == 14
    )
    assert batch.loss_spans[1] == [Span("text", batch.input_ids[1].shape[0] - 2, 2)]


def test_positions_match_transformers_get_rope_index(seed):
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=1, embed_dim=16, num_heads=2, hidden_size=16, mlp_ratio=2, spatial_merge_size=2, patch_size=14
        ),
    )
    model = Qwen2VLModel(config)
    for side in ("left", "right"):
        batch, encoded = build(seed, padding_side=side)
        expected, _ = model.get_rope_index(
            encoded["input_ids"],
            encoded["mm_token_type_ids"],
            encoded["image_grid_thw"],
            attention_mask=encoded["attention_mask"],
        )
        assert batch.position_ids.shape == (3, *encoded["input_ids"].shape)
        assert torch.equal(batch.position_ids, expected)


def test_processor_positions_and_media_ids_are_taken_as_given(seed):
    processor = tiny_processor()
    encoded = dict(encode(processor, seed))
    encoded["position_ids"] = torch.randint(0, 50, (3, *encoded["input_ids"].shape))
    batch = MultimodalBatch.from_processor(
        processor, encoded, loss_spans=answer_spans(encoded), media_ids=[["a", "b"], ["c"]]
    )
    assert torch.equal(batch.position_ids, encoded["position_ids"]) and batch.media_ids == [["a", "b"], ["c"]]


def test_padding_side_does_not_change_the_sequences(seed):
    left, _ = build(seed, padding_side="left")
    right, _ = build(seed, padding_side="right")
    assert all(torch.equal(a, b) for a, b in zip(left.input_ids, right.input_ids))
    assert left.modality_spans == right.modality_spans and left.media_cache_keys == right.media_cache_keys
    assert all(torch.equal(left.real_positions(b), right.real_positions(b)) for b in range(2))
    assert torch.equal(
        left.padded_input_ids(1)[left.attention_mask.bool()], right.padded_input_ids(1)[right.attention_mask.bool()]
    )


def test_fingerprint_follows_the_processor_settings():
    base = ProcessorFingerprint.of(tiny_processor())
    assert ProcessorFingerprint.of(tiny_processor()) == base
    assert ProcessorFingerprint.of(tiny_processor(merge_size=1)).merge_size == 1
    other = tiny_processor()
    other.chat_template = other.chat_template + " "
    assert ProcessorFingerprint.of(other).chat_template_sha256 != base.chat_template_sha256


def _broken(batch, field, value):
    return dataclasses.replace(batch, **{field: value})


@pytest.mark.parametrize(
    "field, make, message",
    [
        (
            "loss_spans",
            lambda b, n: [[Span("text", n[0] - 2, 9)], b.loss_spans[1]],
            r"loss_spans\[0\]\[0\]: start \d+ \+ length 9 exceeds the sequence length \d+",
        ),
        (
            "loss_spans",
            lambda b, n: [b.loss_spans[0], [Span("text", 0, 1)]],
            r"loss_spans\[1\]\[0\]: start 0 must be >= 1",
        ),
        (
            "loss_spans",
            lambda b, n: [[Span("text", 3, 2)], b.loss_spans[1]],
            r"loss_spans\[0\]\[0\]: tokens \[3, 5\) overlap image 0",
        ),
        (
            "loss_spans",
            lambda b, n: [b.loss_spans[0], [Span("image", 1, 1)]],
            r"loss_spans\[1\]\[0\]: loss spans score text tokens",
        ),
        (
            "modality_spans",
            lambda b, n: [b.modality_spans[0][:-1], b.modality_spans[1]],
            r"modality_spans\[0\]: cover tokens \[0, \d+\), expected the whole sequence",
        ),
        (
            "modality_spans",
            lambda b, n: [b.modality_spans[0], [Span("text", 0, 1), *b.modality_spans[1][1:]]],
            r"modality_spans\[1\]\[1\]: starts at 2, expected 1",
        ),
        (
            "modality_spans",
            lambda b, n: [b.modality_spans[0], [Span("audio", 0, n[1])]],
            r"modality_spans\[1\]\[0\]: kind must be one of",
        ),
        (
            "vision_token_offsets",
            lambda b, n: [b.vision_token_offsets[0], [0]],
            r"vision_token_offsets\[1\]\[0\]: must be \d+",
        ),
        ("media_ids", lambda b, n: [["x"], ["y"]], r"media_ids\[0\]: must hold one entry per media item \(2\), got 1"),
        (
            "media_cache_keys",
            lambda b, n: [b.media_cache_keys[0]],
            r"media_cache_keys: must be a list with one entry per sequence",
        ),
        ("position_ids", lambda b, n: b.position_ids[:2], r"position_ids: must have shape"),
        (
            "input_ids",
            lambda b, n: [b.input_ids[0][:-1], b.input_ids[1]],
            r"attention_mask\[0\]: \d+ real tokens, but input_ids\[0\] holds",
        ),
        (
            "input_ids",
            lambda b, n: [b.input_ids[0].to(torch.int32), b.input_ids[1]],
            r"input_ids\[0\]: must be a 1-D int64 tensor",
        ),
    ],
)
def test_validate_names_the_field_and_position(seed, field, make, message):
    batch, _ = build(seed)
    lengths = [t.shape[0] for t in batch.input_ids]
    with pytest.raises(ValueError, match=message):
        _broken(batch, field, make(batch, lengths)).validate()


def test_a_loss_span_over_a_tool_observation_is_refused(seed):
    """Tool observation tokens are not the policy's: a loss span that scores one is refused."""
    batch, _ = build(seed)
    scored = batch.loss_spans[1][0]
    spans = [
        dataclasses.replace(m, kind="tool") if m.start <= scored.start < m.end else m for m in batch.modality_spans[1]
    ]
    tool = next(m for m in spans if m.kind == "tool")
    with pytest.raises(
        ValueError,
        match=rf"loss_spans\[1\]\[0\]: tokens \[{scored.start}, {scored.end}\) overlap tool at "
        rf"\[{tool.start}, {tool.end}\)",
    ):
        dataclasses.replace(batch, modality_spans=[batch.modality_spans[0], spans]).validate()


def test_image_tokens_where_the_span_says_text_are_refused(seed):
    batch, _ = build(seed)
    ids = batch.input_ids[1].clone()
    text = batch.modality_spans[1][0]
    spans = [
        Span("text", 0, 1),
        Span("image", 1, text.length - 1 + batch.modality_spans[1][1].length, 0),
        *batch.modality_spans[1][2:],
    ]
    ids[1 : text.end] = 4
    with pytest.raises(ValueError, match=r"modality_spans\[1\]\[1\]: token \d+ is \d+, not the image token 4"):
        dataclasses.replace(
            batch, input_ids=[batch.input_ids[0], batch.input_ids[1]], modality_spans=[batch.modality_spans[0], spans]
        ).validate()


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
        MultimodalBatch.from_processor(
            processor,
            {**encoded, "video_grid_thw": torch.ones(1, 3, dtype=torch.long)},
            loss_spans=answer_spans(encoded),
        )
    with pytest.raises(ValueError, match=r"encoded\['input_ids'\]: must be an integer tensor, got list"):
        MultimodalBatch.from_processor(
            processor, {**encoded, "input_ids": encoded["input_ids"].tolist()}, loss_spans=answer_spans(encoded)
        )
    with pytest.raises(ValueError, match=r"encoded\['pixel_values'\]: \d+ patch rows, but image_grid_thw needs"):
        MultimodalBatch.from_processor(
            processor, {**encoded, "pixel_values": encoded["pixel_values"][1:]}, loss_spans=answer_spans(encoded)
        )


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
            positions = real[s.start - 1 : s.end - 1]
            assert torch.equal(targets[b, positions], batch.input_ids[b][s.start : s.end])
            want = rk.linear_logprob(hidden[b, positions], weight, batch.input_ids[b][s.start : s.end])
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
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", additional_special_tokens=["<image>"]
    )
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default"
    )
    pictures = random_images(np.random.default_rng(seed % 2**32), [(40, 40), (30, 50), (40, 40)])
    encoded = processor(
        text=["w1 <image> w2 w3", "w3 w4 <image> w5 <image> w6"], images=pictures, padding=True, return_tensors="pt"
    )
    per_image = 4 - 1  # (28 / 14)² patches, the CLS feature dropped ("default" strategy)
    batch = MultimodalBatch.from_processor(processor, encoded, loss_spans=[[(5, 1)], [(9, 1)]])
    assert [[(s.start, s.length) for s in spans if s.kind == "image"] for spans in batch.modality_spans] == [
        [(1, per_image)],
        [(2, per_image), (6, per_image)],
    ]
    assert (
        batch.fingerprint.patch_size == 14
        and batch.fingerprint.merge_size is None
        and batch.fingerprint.image_token_id == 2
    )
    assert batch.position_ids.shape == encoded["input_ids"].shape
    assert batch.real_positions(1).tolist() == list(range(10))
    assert len({k for keys in batch.media_cache_keys for k in keys}) == 3


def test_grid_sides_not_divisible_by_merge_size_are_refused(seed):
    """An image grid whose sides are not multiples of the merge size gives a token count its
    3-D positions cannot lay out: refused naming the grid row, whatever the token count says."""
    processor = tiny_processor()
    encoded = dict(encode(processor, seed))
    t, h, w = encoded["image_grid_thw"][0].tolist()
    for sides in ([h - 1, w * h // (h - 1)] if (w * h) % (h - 1) == 0 else [1, h * w], [1, h * w]):
        grid = encoded["image_grid_thw"].clone()
        grid[0, 1:] = torch.tensor(sides)  # the same patch and token counts
        with pytest.raises(
            ValueError,
            match=rf"encoded\['image_grid_thw'\]\[0\]: the sides h and w must be multiples of the "
            rf"processor's merge_size 2, got \(t, h, w\) = \[{t}, {sides[0]}, {sides[1]}\]",
        ):
            MultimodalBatch.from_processor(
                processor, {**encoded, "image_grid_thw": grid}, loss_spans=answer_spans(encoded)
            )
    for bad, message in (
        ([[1, 4]], r": must have shape \[num_images, 3\]"),
        ([[0, 4, 6]], r"\[0\]: \(t, h, w\) must each be in"),
        ([[1, -4, 6]], r"\[0\]: \(t, h, w\) must each be in"),
        ([[1, 2**40, 2]], r"\[0\]: \(t, h, w\) must each be in"),
    ):
        with pytest.raises(ValueError, match=r"encoded\['image_grid_thw'\]" + message):
            MultimodalBatch.from_processor(
                processor, {**encoded, "image_grid_thw": torch.tensor(bad)}, loss_spans=answer_spans(encoded)
            )


# Malformed inputs for the schema's entry points: every value below is wrong for the field it is
# drawn for (a wrong type, rank, layout, or a negative or huge size), so each call must raise
# ValueError or TypeError with a one-line message naming that field.
_PLAIN_VALUES: list = [None, True, 3, -1, 2**70, 2.5, "x", b"x", {}, {"a": 1}]
"""Python values that are neither a list nor a tensor."""
_NOT_A_LIST: list = [*_PLAIN_VALUES, torch.tensor(3), torch.zeros(2, 2, dtype=torch.long)]
_NOT_AN_INT: list = [None, True, 2.5, "3", b"3", [], [1], {}, torch.tensor(3), torch.zeros(2, dtype=torch.long)]
_NOT_A_STR: list = [None, True, 3, 2.5, b"x", [], ["x"], {}, torch.tensor(3)]
_BAD_SIZES: list = [-1, -(2**70), 2**70, 2**63]


def _bad_tensors(shape: tuple[int, ...]) -> list:
    """Values wrong for an integer tensor field of ``shape``: float, another rank, sparse, a list,
    not a tensor (None is left to the callers: from_processor reads it as absent)."""
    ones = torch.ones(shape, dtype=torch.long)
    return [
        ones.float(),
        ones.to(torch.complex64),
        ones.reshape(-1)[:1].reshape(()),
        ones[None],
        ones.to_sparse(),
        ones.tolist(),
        "x",
        3,
    ]


def _junk_span(rng: random.Random, span: Span) -> object:
    """A wrong span entry: not a Span, or a Span with one wrong field."""
    field = rng.choice(["entry", "kind", "start", "length", "media_index"])
    if field == "entry":
        return rng.choice([None, 3, "text", (1, 2), [span.kind, span.start, span.length, span.media_index], {}])
    if field == "kind":
        return dataclasses.replace(span, kind=rng.choice(["audio", "", "TEXT", *_NOT_A_STR]))
    if field == "media_index":
        return dataclasses.replace(
            span, media_index=rng.choice([-1, 99, 2**70, *[v for v in _NOT_AN_INT if v is not None]])
        )
    return dataclasses.replace(
        span,
        **{
            field: rng.choice(
                [*_BAD_SIZES, *([0] if field == "length" else []), *[v for v in _NOT_AN_INT if v is not None]]
            )
        },
    )


def _malformed_batch(rng: random.Random, batch: MultimodalBatch) -> tuple[str, str, MultimodalBatch]:
    """(the field's name, what was done, the batch with one wrong value in that field)."""
    field = rng.choice(
        [
            "input_ids",
            "modality_spans",
            "loss_spans",
            "media_ids",
            "vision_token_offsets",
            "media_cache_keys",
            "attention_mask",
            "position_ids",
            "fingerprint",
        ]
    )
    value: Any = getattr(batch, field)
    b = rng.randrange(len(batch))
    if field == "input_ids":
        rows: Any = list(value)
        rows[b] = rng.choice(
            [*_bad_tensors((rows[b].shape[0],)), None, rows[b].to(torch.int32), rows[b][:-1], rows[b][None]]
        )
        return f"input_ids[{b}]", f"input_ids[{b}] = {brief(rows[b])}", dataclasses.replace(batch, input_ids=rows)
    if field == "attention_mask":
        bad = rng.choice([*_bad_tensors(tuple(value.shape)), None, value * 2, value - 1, value[:, :-1], value[:1]])
        return "attention_mask", f"attention_mask = {brief(bad)}", dataclasses.replace(batch, attention_mask=bad)
    if field == "position_ids":
        bad = rng.choice([*_bad_tensors(tuple(value.shape)), None, value[..., :-1], value[:2], value[None]])
        return "position_ids", f"position_ids = {brief(bad)}", dataclasses.replace(batch, position_ids=bad)
    if field == "fingerprint":
        name = rng.choice(
            [
                "whole",
                "processor_class",
                "transformers_version",
                "image_token_id",
                "patch_size",
                "merge_size",
                "chat_template_sha256",
            ]
        )
        if name == "whole":
            bad = rng.choice(_NOT_A_LIST)
            return "fingerprint", f"fingerprint = {brief(bad)}", dataclasses.replace(batch, fingerprint=bad)
        pool = {
            "processor_class": _NOT_A_STR,
            "transformers_version": _NOT_A_STR,
            "chat_template_sha256": [3, b"x", ["x"]],
            "image_token_id": [*_NOT_AN_INT, *_BAD_SIZES],
            "patch_size": [*_NOT_AN_INT[1:], 0, *_BAD_SIZES],
            "merge_size": [*_NOT_AN_INT[1:], 0, *_BAD_SIZES],
        }[name]
        bad = rng.choice(pool)
        fingerprint = dataclasses.replace(value, **{name: bad})
        return (
            f"fingerprint.{name}",
            f"fingerprint.{name} = {brief(bad)}",
            dataclasses.replace(batch, fingerprint=fingerprint),
        )
    level = rng.choice(["whole", "sequence", "entry"])
    if level == "whole":
        bad = rng.choice([*_NOT_A_LIST, value[:-1], [*value, []], tuple(value)])
        return field, f"{field} = {brief(bad)}", _broken(batch, field, bad)
    rows = [list(row) for row in value]
    if level == "sequence" or not rows[b]:
        rows[b] = rng.choice([*_NOT_A_LIST, tuple(rows[b])] if rows[b] else _NOT_A_LIST)
        return f"{field}[{b}]", f"{field}[{b}] = {brief(rows[b])}", _broken(batch, field, rows)
    i = rng.randrange(len(rows[b]))
    if field in ("modality_spans", "loss_spans"):
        rows[b][i] = _junk_span(rng, rows[b][i])
    elif field == "vision_token_offsets":
        rows[b][i] = rng.choice([*_NOT_AN_INT, *_BAD_SIZES])
    else:
        rows[b][i] = rng.choice(_NOT_A_STR)
    return f"{field}[{b}]", f"{field}[{b}][{i}] = {brief(rows[b][i])}", _broken(batch, field, rows)


def _refused(what: str, name: str, call: Callable[[], object], seed: int) -> None:
    try:
        call()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert name in message and "\n" not in message, (
            f"seed {seed}, {what}: the message does not name {name}: {message!r}"
        )
    except Exception as exc:
        raise AssertionError(
            f"seed {seed}, {what}: {type(exc).__name__} instead of ValueError/TypeError: {exc}"
        ) from exc
    else:
        raise AssertionError(f"seed {seed}, {what}: accepted")


def test_validate_refuses_malformed_fields_naming_them(seed):
    """Property (seeded draws): a batch with one wrong value in one field fails ``validate`` with
    ValueError or TypeError naming that field, never IndexError, AttributeError, OverflowError or
    an unpack error."""
    batch, _ = build(seed)
    rng = random.Random(seed)
    for _ in range(300):
        name, what, broken = _malformed_batch(rng, batch)
        _refused(
            what,
            name.split(".")[0].split("[")[0] if name.startswith(("input_ids", "fingerprint")) else name,
            broken.validate,
            seed,
        )


def _malformed_call(rng: random.Random, processor, encoded: dict, spans: list) -> tuple[str, str, Callable[[], object]]:
    """(the argument's name, what was done, a from_processor call with one wrong argument)."""
    what = rng.choice(
        [
            "encoded",
            "input_ids",
            "attention_mask",
            "image_grid_thw",
            "pixel_values",
            "position_ids",
            "loss_spans",
            "loss_spans[b]",
            "loss_spans[b][i]",
            "media_ids",
            "media_ids[b]",
            "media_ids[b][i]",
            "processor",
        ]
    )
    args: dict[str, Any] = {"processor": processor, "encoded": encoded, "loss_spans": spans, "media_ids": None}
    shape = tuple(encoded["input_ids"].shape)
    if what == "encoded":
        args["encoded"] = rng.choice([None, 3, "x", [encoded], encoded["input_ids"]])
    elif what in ("input_ids", "attention_mask", "position_ids"):
        absent = [] if what == "attention_mask" else [None]  # no attention_mask: all ones
        args["encoded"] = {
            **encoded,
            what: rng.choice([*_bad_tensors(shape), *absent, *([encoded[what] * 2] if not absent else [])]),
        }
    elif what == "image_grid_thw":
        grid = encoded["image_grid_thw"]
        args["encoded"] = {
            **encoded,
            what: rng.choice(
                [
                    *_bad_tensors(tuple(grid.shape)),
                    grid[:, :2],
                    grid * 0,
                    -grid,
                    grid + 2**40,
                    grid + 1,
                    grid[:-1],
                    torch.cat([grid, grid[:1]]),
                ]
            ),
        }
    elif what == "pixel_values":
        pixels = encoded["pixel_values"]
        args["encoded"] = {
            **encoded,
            what: rng.choice([None, "x", [1.0], torch.tensor(1.0), pixels[1:], pixels.to_sparse()]),
        }
    elif what.startswith("loss_spans"):
        b = rng.randrange(len(spans))
        if what == "loss_spans":
            args["loss_spans"] = rng.choice([None, 3, "x", {}, torch.tensor([[1, 2]]), spans[:1], [*spans, []]])
        elif what == "loss_spans[b]":
            args["loss_spans"] = [rng.choice([None, 3, "x", {}]) if k == b else s for k, s in enumerate(spans)]
        else:
            bad = rng.choice(
                [
                    None,
                    3,
                    "x",
                    (1, 2, 3),
                    (0, 1),
                    (1, 0),
                    (1, -3),
                    (-1, 2),
                    (2**70, 1),
                    (1, 2**70),
                    ("a", 1),
                    (1.5, 2),
                    (None, 1),
                    (True, 1),
                    Span("image", 1, 1),
                    Span("text", 1, 1, 0),
                ]
            )
            args["loss_spans"] = [[bad] if k == b else s for k, s in enumerate(spans)]
    elif what.startswith("media_ids"):
        ids: list[Any] = [["a", "b"], ["c"]]
        b = rng.randrange(2)
        if what == "media_ids":
            args["media_ids"] = rng.choice([3, "x", {}, torch.tensor([1]), ids[:1], [*ids, []]])
        elif what == "media_ids[b]":
            ids[b] = rng.choice([None, 3, "x", {}, [], ["a", "b", "c"]])
            args["media_ids"] = ids
        else:
            ids[b][0] = rng.choice(_NOT_A_STR)
            args["media_ids"] = ids
    else:
        broken = tiny_processor()
        setting = rng.choice(["image_token_id", "merge_size", "chat_template"])
        if setting == "image_token_id":
            broken.image_token_id, broken.image_token = rng.choice(["4", 2.5, None, [4]]), None
        elif setting == "merge_size":
            broken.image_processor.merge_size = rng.choice([0, -2, 2**40])
        else:
            broken.chat_template = rng.choice([3, ["x"], b"x"])
        args["processor"] = broken
        what = f"processor.{setting}"
    name = what.split(".")[0].replace("[b]", "").replace("[i]", "")
    return (
        name,
        what,
        lambda: MultimodalBatch.from_processor(
            args["processor"], args["encoded"], loss_spans=args["loss_spans"], media_ids=args["media_ids"]
        ),
    )


def test_from_processor_refuses_malformed_arguments_naming_them(seed):
    """Property (seeded draws): ``from_processor`` with one wrong argument (the processor output,
    one of its tensors, the loss spans, the media ids, the processor's settings) raises
    ValueError or TypeError naming it, in one line."""
    processor = tiny_processor()
    encoded = dict(encode(processor, seed))
    spans = answer_spans(encoded)
    rng = random.Random(seed)
    for _ in range(150):
        name, what, call = _malformed_call(rng, processor, encoded, spans)
        _refused(what, name, call, seed)


def test_saved_batch_with_a_malformed_field_is_refused_naming_it(tmp_path, seed):
    """Property (seeded draws): a saved batch with one field replaced by a wrong value (of a
    type ``torch.load(weights_only=True)`` reads back) is refused by ``storage.load`` with a
    one-line ValueError naming the file and that field."""
    from rl_kernel_core.tools.multimodal import storage

    batch, _ = build(seed)
    path = str(tmp_path / "batch.pt")
    storage.save(batch, path)
    saved = torch.load(path, weights_only=True)
    rng = random.Random(seed)
    loadable: list[Any] = [
        *_PLAIN_VALUES,
        [],
        [[]],
        [None],
        (1, 2),
        torch.tensor(3),
        torch.zeros(2, 3, 4, dtype=torch.long),
        torch.rand(4),
        torch.ones(5, dtype=torch.long).to_sparse(),
        torch.zeros(1, dtype=torch.long).expand(6),
        [torch.ones(3, dtype=torch.long).to_sparse()],
        [torch.zeros(1, dtype=torch.long).expand(2**20)] * 2,
    ]
    for _ in range(60):
        field = rng.choice([k for k in saved if k != "format"] + ["format"])
        bad = rng.choice([v for v in loadable if not (field == "format" and v is None)])
        torch.save({**saved, field: bad}, path)
        _refused(f"{field} = {brief(bad)}", field, lambda: storage.load(path), seed)
        with pytest.raises(ValueError, match=r"batch\.pt: "):
            storage.load(path)
