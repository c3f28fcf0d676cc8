"""The vision recipe's model cache (``runs/models/vision-<preset>-<digest>``): a build damaged since
it was written (truncated weights, a corrupt config or tokenizer file, a changed merge size, a
missing file) is refused with one line naming the file and saying to delete the directory, and
the recipe exits 2 with that line instead of a traceback."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

from grpo import vision_data, vision_model  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return vision_model.build_local_vlm(
        "tiny", tmp_path_factory.mktemp("models"), vision_data.vocabulary_texts(), seed=0
    )


def _truncated(name: str, keep: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: keep(len(data))])

    return damage


def _edited(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        settings = json.loads((path / name).read_text())
        change(settings)
        (path / name).write_text(json.dumps(settings))

    return damage


DAMAGES = {
    "weights cut in half": ("model.safetensors", _truncated("model.safetensors", lambda n: n // 2)),
    "weights short of their last byte": ("model.safetensors", _truncated("model.safetensors", lambda n: n - 1)),
    "weights emptied": ("model.safetensors", _truncated("model.safetensors", lambda n: 0)),
    "weights deleted": ("model.safetensors", lambda path: os.unlink(path / "model.safetensors")),
    "config cut in half": ("config.json", _truncated("config.json", lambda n: n // 2)),
    "config not an object": ("config.json", lambda path: (path / "config.json").write_text("[1, 2]")),
    "vision merge size changed": (
        "config.json",
        _edited("config.json", lambda c: c["vision_config"].update(spatial_merge_size=4)),
    ),
    "a layer's width changed": (
        "model.safetensors",
        _edited("config.json", lambda c: c["text_config"].update(intermediate_size=100)),
    ),
    "tokenizer cut in half": ("tokenizer.json", _truncated("tokenizer.json", lambda n: n // 2)),
    "tokenizer vocabulary emptied": (
        "tokenizer.json",
        _edited("tokenizer.json", lambda c: c["model"].update(vocab={}, merges=[])),
    ),
    "tokenizer config cut": ("tokenizer_config.json", _truncated("tokenizer_config.json", lambda n: n - 3)),
    "image processor merge size changed": (
        "preprocessor_config.json",
        _edited("preprocessor_config.json", lambda c: c.update(merge_size=1)),
    ),
    "image processor config deleted": (
        "preprocessor_config.json",
        lambda path: os.unlink(path / "preprocessor_config.json"),
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_cache_is_refused_naming_the_file(built, tmp_path, damage):
    name, apply = DAMAGES[damage]
    copy = tmp_path / built.name
    shutil.copytree(built, copy)
    apply(copy)
    with pytest.raises(vision_model.CacheError) as info:
        vision_model.build_local_vlm("tiny", tmp_path, vision_data.vocabulary_texts(), seed=0)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{copy / name}: "), message
    assert message.endswith(f"the model cache is damaged: delete the directory {copy} and run again (it is rebuilt)"), (
        message
    )


def test_an_intact_cache_is_reused_as_it_is(built, tmp_path):
    copy = tmp_path / built.name
    shutil.copytree(built, copy)
    stamps = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    assert vision_model.build_local_vlm("tiny", tmp_path, vision_data.vocabulary_texts(), seed=0) == copy
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == stamps


def test_the_recipe_exits_2_with_one_line_on_a_damaged_cache(built, tmp_path, monkeypatch, capsys):
    import grpo_vision

    models = tmp_path / "runs" / "models"
    shutil.copytree(built, models / built.name)
    DAMAGES["weights cut in half"][1](models / built.name)
    monkeypatch.setattr(grpo_vision, "ROOT", tmp_path)
    code = grpo_vision.main(["--data", "synthetic", "--out", str(tmp_path / "out"), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        f"[grpo_vision] error: {models / built.name / 'model.safetensors'}: the model does not load ("
    ), err
    assert not (tmp_path / "out" / "off.jsonl").exists()
