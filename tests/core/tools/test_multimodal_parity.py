"""Processor-layout parity: rollout vs training multimodal batches; each planted mismatch is
caught and named."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from rl_kernel_core.tools.multimodal import parity
from rl_kernel_core.tools.multimodal.schema import MultimodalBatch, Span
from tiny_vlm_processor import IMAGE, random_images, tiny_processor

TEXTS = [f"<|im_start|> w1 {IMAGE} w2 w3 {IMAGE} <|im_end|> w5 w6 w7", f"w4 {IMAGE} w5 w9 w11"]
SIZES = [(56, 84), (28, 56), (56, 56)]


def side(seed, *, padding_side="right", answer=3, **processor_kwargs):
    processor = tiny_processor(**processor_kwargs)
    processor.tokenizer.padding_side = padding_side
    encoded = processor(
        text=TEXTS, images=random_images(np.random.default_rng(seed), SIZES), padding=True, return_tensors="pt"
    )
    real = encoded["attention_mask"].sum(-1).tolist()
    return MultimodalBatch.from_processor(processor, encoded, loss_spans=[[(n - answer, answer)] for n in real])


def test_same_layout_padded_on_either_side_agrees(seed):
    rollout, training = side(seed, padding_side="left"), side(seed, padding_side="right")
    assert parity.compare(rollout, training) == []
    parity.check(rollout, training)


def test_only_the_image_token_count_per_image_differs(seed):
    # the training side's image processor resizes to fewer pixels: same text, same images,
    # same fingerprint, fewer image tokens for some images
    rollout, training = side(seed), side(seed, max_pixels=28 * 28 * 2)
    assert rollout.fingerprint == training.fingerprint
    lines = parity.compare(rollout, training)
    image = rollout.modality_spans[0][1]
    fewer = training.modality_spans[0][1].length
    assert image.length != fewer
    assert lines[0] == (
        f"modality_spans[0] image 0: rollout image at {image.start}, {image.length} tokens vs training image "
        f"at {image.start}, {fewer} tokens ({image.length} vs {fewer} image tokens)"
    )
    assert lines[1].startswith("attention_mask[0]: rollout")
    with pytest.raises(parity.ParityError, match=r"^modality_spans\[0\] image 0: "):
        parity.check(rollout, training)


def test_image_count_difference_at_the_same_length_is_named_first(seed):
    # one image's tokens moved to another image: the total stays, the per-image counts do not
    rollout = side(seed)
    spans = list(rollout.modality_spans[0])
    first, second = [i for i, s in enumerate(spans) if s.kind == "image"]
    a, b = spans[first], spans[second]
    text = spans[first + 1]
    moved = [
        *spans[:first],
        Span("image", a.start, a.length - 1, 0),
        Span("text", a.end - 1, text.length, None),
        Span("image", text.end - 1, b.length + 1, 1),
        *spans[second + 1 :],
    ]
    ids = rollout.input_ids[0].clone()
    ids[a.end - 1 : text.end - 1] = rollout.input_ids[0][text.start : text.end]
    ids[text.end - 1] = 4
    offsets = [0, a.length - 1]
    training = dataclasses.replace(
        rollout,
        input_ids=[ids, rollout.input_ids[1]],
        modality_spans=[moved, rollout.modality_spans[1]],
        vision_token_offsets=[offsets, rollout.vision_token_offsets[1]],
    )
    lines = parity.compare(rollout, training)
    assert lines[0] == (
        f"modality_spans[0] image 0: rollout image at {a.start}, {a.length} tokens vs training image at "
        f"{a.start}, {a.length - 1} tokens ({a.length} vs {a.length - 1} image tokens)"
    )
    assert lines[1].startswith(f"input_ids[0][{a.end - 1}]: rollout 4 vs training")


def _fault(name):
    def token(batch):
        ids = batch.input_ids[1].clone()
        ids[1] = 7 if int(ids[1]) != 7 else 8
        return dataclasses.replace(batch, input_ids=[batch.input_ids[0], ids])

    def position_3d(batch):
        pos = batch.position_ids.clone()
        pos[1, 0, 5] += 1
        return dataclasses.replace(batch, position_ids=pos)

    def position_1d(batch):
        return dataclasses.replace(batch, position_ids=batch.position_ids[0])

    def loss(batch):
        (span,) = batch.loss_spans[0]
        return dataclasses.replace(
            batch, loss_spans=[[Span("text", span.start + 1, span.length - 1)], batch.loss_spans[1]]
        )

    def media(batch):
        return dataclasses.replace(batch, media_ids=[batch.media_ids[0], ["other"]])

    def cache_key(batch):
        return dataclasses.replace(
            batch, media_cache_keys=[["sha256:0", batch.media_cache_keys[0][1]], batch.media_cache_keys[1]]
        )

    def fingerprint(batch):
        return dataclasses.replace(
            batch, fingerprint=dataclasses.replace(batch.fingerprint, chat_template_sha256="0" * 64)
        )

    return {
        "token": token,
        "position_3d": position_3d,
        "position_1d": position_1d,
        "loss": loss,
        "media": media,
        "cache_key": cache_key,
        "fingerprint": fingerprint,
    }[name]


@pytest.mark.parametrize(
    "fault, first",
    [
        ("token", "input_ids[1][1]: rollout "),
        ("position_3d", "position_ids[0][5]: rollout "),
        ("position_1d", "position_ids[0]: rollout 3-D vs training 1-D positions"),
        ("loss", "loss_spans[0][0]: rollout text at "),
        ("media", "media_ids[1][0]: rollout 'sha256:"),
        ("cache_key", "media_cache_keys[0][0]: rollout 'sha256:"),
        ("fingerprint", "fingerprint.chat_template_sha256: rollout '"),
    ],
)
def test_each_planted_mismatch_is_named_first(seed, fault, first):
    rollout = side(seed)
    training = _fault(fault)(side(seed, padding_side="left"))
    lines = parity.compare(rollout, training)
    assert lines and lines[0].startswith(first), lines
    with pytest.raises(parity.ParityError) as info:
        parity.check(rollout, training)
    assert str(info.value) == lines[0]


def test_position_mismatch_names_the_token_and_its_three_axes(seed):
    rollout = side(seed)
    training = _fault("position_3d")(side(seed))
    (line,) = parity.compare(rollout, training)
    before = rollout.real_positions(0)[:, 5].tolist()
    after = list(before)
    after[1] += 1
    assert line == f"position_ids[0][5]: rollout {before} vs training {after}"


def test_sequence_count_and_malformed_sides(seed):
    rollout = side(seed)
    one = dataclasses.replace(
        rollout,
        **{
            f.name: getattr(rollout, f.name)[:1]
            for f in dataclasses.fields(rollout)
            if f.name not in ("fingerprint", "position_ids")
        },
        position_ids=rollout.position_ids[:, :1],
    )
    assert parity.compare(rollout, one)[0] == "sequence count: rollout 2 vs training 1"
    broken = dataclasses.replace(rollout, loss_spans=[[Span("text", 0, 1)], rollout.loss_spans[1]])
    with pytest.raises(ValueError, match=r"^training batch: loss_spans\[0\]\[0\]: start 0 must be >= 1"):
        parity.compare(rollout, broken)
    with pytest.raises(TypeError, match="rollout must be a MultimodalBatch, got dict"):
        parity.compare({}, rollout)  # type: ignore[arg-type]


def test_saved_batches_round_trip(tmp_path, seed):
    from rl_kernel_core.tools.multimodal import storage

    batch = side(seed, padding_side="left")
    path = str(tmp_path / "batch.pt")
    storage.save(batch, path)
    loaded = storage.load(path)
    assert parity.compare(batch, loaded) == []
    assert loaded.fingerprint == batch.fingerprint and loaded.vision_token_offsets == batch.vision_token_offsets
    assert torch.equal(loaded.attention_mask, batch.attention_mask) and torch.equal(
        loaded.position_ids, batch.position_ids
    )


def test_cli_parity_of_saved_multimodal_batches(tmp_path, capsys, seed):
    from rl_kernel_core.tools import cli
    from rl_kernel_core.tools.multimodal import storage

    paths = [str(tmp_path / "rollout.pt"), str(tmp_path / "training.pt")]
    storage.save(side(seed, padding_side="left"), paths[0])
    storage.save(side(seed), paths[1])
    capsys.readouterr()
    assert cli.main(["consistency", "--parity", *paths]) == 0
    assert capsys.readouterr().out.strip() == "input parity: ok"
    storage.save(side(seed, max_pixels=28 * 28 * 2), paths[1])
    assert cli.main(["consistency", "--parity", *paths, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)["parity"]
    assert result.startswith("modality_spans[0] image 0: rollout image at ") and "image tokens)" in result, result


def test_cli_parity_refuses_bad_multimodal_files_in_one_line(tmp_path, capsys, seed):
    from rl_kernel_core.tools import cli
    from rl_kernel_core.tools.consistency import parity as text_parity
    from rl_kernel_core.tools.multimodal import storage

    good, bad = str(tmp_path / "rollout.pt"), str(tmp_path / "training.pt")
    storage.save(side(seed), good)
    saved = torch.load(good, weights_only=True)

    def refused(content, expected):
        torch.save(content, bad)
        assert cli.main(["consistency", "--parity", good, bad]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err

    refused(
        {**saved, "loss_spans": [[["text", 0, 2, None]], saved["loss_spans"][1]]},
        "training.pt: loss_spans[0][0]: start 0 must be >= 1",
    )
    refused(
        {**saved, "modality_spans": [saved["modality_spans"][0], [["text", 0]]]},
        "training.pt: modality_spans[1][0] must be [kind, start, length, media_index], got ['text', 0]",
    )
    refused({**saved, "fingerprint": {"processor_class": "X"}}, "training.pt: fingerprint must be a dict of")
    refused({k: v for k, v in saved.items() if k != "position_ids"}, "training.pt: missing field position_ids")
    refused(
        {**saved, "input_ids": [t.float() for t in saved["input_ids"]]},
        "training.pt: input_ids[0]: must be a 1-D int64 tensor",
    )
    with open(bad, "wb") as f:
        f.write(b"not a torch file")
    assert cli.main(["consistency", "--parity", good, bad]) == 2
    assert (
        "training.pt: not a batch written by rl_kernel_core.tools.consistency.parity.save or rl_kernel_core.tools.multimodal.storage.save"
        in capsys.readouterr().err
    )
    text = text_parity.from_sequences([torch.tensor([5, 6, 7])], "left", [0], 0)
    text_parity.save(text, bad)
    assert cli.main(["consistency", "--parity", good, bad]) == 2
    assert "holds a multimodal batch but" in capsys.readouterr().err


def _bomb(saved: dict, n: int = 2**27) -> dict:
    """A consistent two-sequence text batch of ``n`` tokens a row whose tensors are all stride-0
    views of one element each: a few KB on disk, gigabytes once any check reads every token."""
    return {
        **saved,
        "input_ids": [torch.full((1,), 5, dtype=torch.long).expand(n)] * 2,
        "modality_spans": [[["text", 0, n, None]]] * 2,
        "loss_spans": [[["text", 1, n - 1, None]]] * 2,
        "media_ids": [[], []],
        "vision_token_offsets": [[], []],
        "media_cache_keys": [[], []],
        "attention_mask": torch.ones(1, 1, dtype=torch.long).expand(2, n),
        "position_ids": torch.zeros(1, 1, 1, dtype=torch.long).expand(3, 2, n),
    }


def test_cli_parity_refuses_expanded_sparse_and_mistyped_fields_in_one_line(tmp_path, capsys, seed):
    """Expanded views (the memory bomb: stride-0 [2, 2**27] tensors in a file of a few KB),
    sparse or quantized tensors and fields of the wrong type exit 2 (not 1, the mismatch code) with
    one line naming the file and the field, before any tensor is read element by element."""
    from rl_kernel_core.tools import cli
    from rl_kernel_core.tools.multimodal import storage

    good, bad = str(tmp_path / "rollout.pt"), str(tmp_path / "training.pt")
    storage.save(side(seed), good)
    saved = torch.load(good, weights_only=True)
    mask, positions = saved["attention_mask"], saved["position_ids"]
    spans = saved["modality_spans"]
    image = next(i for i, s in enumerate(spans[0]) if s[0] == "image")
    cases = [
        (
            _bomb(saved),
            "training.pt: input_ids[0] must be a dense tensor, got shape (134217728,) over 1 stored elements",
        ),
        # expanded views of the right shape and values a check would accept: refused all the same
        (
            _bomb(saved, 2**12),
            "training.pt: input_ids[0] must be a dense tensor, got shape (4096,) over 1 stored elements",
        ),
        (
            {**saved, "position_ids": positions[:, :, :1].expand_as(positions)},
            "training.pt: position_ids must be a dense tensor, got shape (3, 2, ",
        ),
        (
            {**saved, "attention_mask": mask[:1].expand_as(mask)},
            "training.pt: attention_mask must be a dense tensor, got shape (2, ",
        ),
        (
            {**saved, "attention_mask": mask.to_sparse()},
            "training.pt: attention_mask must be a dense tensor, got layout sparse_coo",
        ),
        (
            {**saved, "input_ids": [saved["input_ids"][0], saved["input_ids"][1].to_sparse()]},
            "training.pt: input_ids[1] must be a dense tensor, got layout sparse_coo",
        ),
        (
            {**saved, "position_ids": positions.to_sparse()},
            "training.pt: position_ids must be a dense tensor, got layout sparse_coo",
        ),
        (
            {**saved, "fingerprint": {**saved["fingerprint"], "image_token_id": "4"}},
            "training.pt: fingerprint.image_token_id: must be an int in [0, 2**63), got str '4'",
        ),
        (
            {**saved, "fingerprint": {**saved["fingerprint"], "image_token_id": 2**64}},
            "training.pt: fingerprint.image_token_id: ",
        ),
        (
            {**saved, "fingerprint": {**saved["fingerprint"], "merge_size": 2.0}},
            "training.pt: fingerprint.merge_size: ",
        ),
        (
            {**saved, "fingerprint": {**saved["fingerprint"], "processor_class": None}},
            "training.pt: fingerprint.processor_class: ",
        ),
        (
            {**saved, "media_ids": [[torch.tensor([1, 2])] * len(saved["media_ids"][0]), saved["media_ids"][1]]},
            "training.pt: media_ids[0][0]: must be a str, got an int64 tensor of shape (2,)",
        ),
        (
            {**saved, "media_cache_keys": [saved["media_cache_keys"][0], [7]]},
            "training.pt: media_cache_keys[1][0]: must be a str, got int 7",
        ),
        (
            {**saved, "vision_token_offsets": [["0", "16"], saved["vision_token_offsets"][1]]},
            "training.pt: vision_token_offsets[0][0]: must be an int, got str '0'",
        ),
        (
            {
                **saved,
                "modality_spans": [
                    [[*s[:3], torch.tensor([0, 1])] if i == image else s for i, s in enumerate(spans[0])],
                    spans[1],
                ],
            },
            f"training.pt: modality_spans[0][{image}]: media_index must be None or an int, got Tensor",
        ),
        (
            {**saved, "modality_spans": [[[torch.zeros(9, 9), *s[1:]] for s in spans[0]], spans[1]]},
            "training.pt: modality_spans[0][0]: kind must be one of ['text', 'image', 'video', 'tool'], got a float32 tensor of shape (9, 9)",
        ),
        ({**saved, "attention_mask": mask * 3}, "training.pt: attention_mask: must hold 0 and 1 only, got 3 at ["),
        (
            {**saved, "input_ids": tuple(saved["input_ids"])},
            "training.pt: input_ids must be a list of 1-D int64 tensors",
        ),
        ({**saved, "fingerprint": {1: 2}}, "training.pt: fingerprint must be a dict of ['chat_template_sha256', "),
    ]
    for content, message in cases:
        torch.save(content, bad)
        if content is cases[0][0]:
            assert (tmp_path / "training.pt").stat().st_size < 8192  # the bomb is a few KB on disk
        code = cli.main(["consistency", "--parity", good, bad])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (message, code, err)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_cli_parity_refuses_a_fifo_without_waiting_for_a_writer(tmp_path, seed):
    """A FIFO in place of a saved batch exits 2 at once, naming it (reading it would block until
    some process writes to it). In a subprocess with a timeout: a hang fails the test."""
    from rl_kernel_core.tools.multimodal import storage

    good, fifo = str(tmp_path / "training.pt"), str(tmp_path / "rollout.pt")
    storage.save(side(seed), good)
    os.mkfifo(fifo)
    for args in ([fifo, good], [good, fifo]):
        proc = subprocess.run(
            [sys.executable, "-m", "rl_kernel_core.cli", "consistency", "--parity", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr
        assert (
            proc.stderr.count("\n") == 1
            and f"--parity {fifo}: must be a regular file holding a saved batch, got a FIFO" in proc.stderr
        )
    with pytest.raises(ValueError, match="rollout.pt: must be a regular file holding a saved batch, got a FIFO"):
        storage.load(fifo)
    with pytest.raises(ValueError, match="must be a regular file holding a saved batch, got a directory"):
        storage.load(str(tmp_path))
