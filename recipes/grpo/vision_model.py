"""The vision recipe's policy: a tiny Qwen2-VL (vision tower, patch merger, language model with
3-D rotary positions) with random weights, and its processor, built locally and saved as an
ordinary HF directory (``AutoModelForImageTextToText`` loads the model, :func:`load_processor` the
processor), so the recipe runs offline.

The processor is transformers' own ``Qwen2VLProcessor``: its image processor (the PIL backend,
which needs no torchvision) resizes each image to a multiple of ``patch_size * merge_size`` within
``[min_pixels, max_pixels]`` and flattens it into patches; the processor expands each
``<|image_pad|>`` of the chat template into ``grid_t * grid_h * grid_w / merge_size**2`` copies.
It is built without a video processor (:func:`load_processor`): Qwen2-VL's needs torchvision,
which the CPU environment does not have, and the recipe has no videos.

The built directory is a cache (``runs/models/vision-<preset>-<digest>``), reused by every later
run with the same shape, seed and texts; :func:`check_cache` refuses one that was damaged since
(a file missing, truncated or edited) with :class:`CacheError`, one line naming the file and
saying to delete the directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from transformers import Qwen2VLProcessor

from .model import TURN_END, TURN_START, build_path, train_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
# Qwen2-VL's ChatML: an image item becomes <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}" + TURN_START + "{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}"
    + VISION_START
    + IMAGE_PAD
    + VISION_END
    + "{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    + TURN_END
    + "\n{% endfor %}{% if add_generation_prompt %}"
    + TURN_START
    + "assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VisionShape:
    """The local VLM's shape (language model, vision tower) and its image processor's settings."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_embed_dim: int
    vision_heads: int
    patch_size: int
    merge_size: int
    max_pixels: int
    tokenizer_vocab: int


PRESETS: dict[str, VisionShape] = {
    # a 32x32 image is 8x8 patches of 4 pixels, 16 tokens after the 2x2 merge; minutes on a 2-core CPU
    "tiny": VisionShape(64, 192, 2, 4, 2, (2, 3, 3), 2, 32, 2, 4, 2, 32 * 32, 384),
}


def image_processor(shape: VisionShape, max_pixels: int | None = None):
    """transformers' Qwen2-VL image processor (PIL backend) for ``shape``; ``max_pixels`` overrides
    the shape's resolution budget (a smaller one gives fewer patches, so fewer image tokens)."""
    from transformers import Qwen2VLImageProcessorPil

    factor = shape.patch_size * shape.merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=shape.patch_size,
        merge_size=shape.merge_size,
        temporal_patch_size=2,
        min_pixels=factor * factor,
        max_pixels=max_pixels or shape.max_pixels,
    )


class CacheError(ValueError):
    """A cached model directory that cannot be used as it is; the message (one line) names the
    file and says to delete the directory, which the next run rebuilds."""


CACHE_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)
"""The files of a finished build (every one checked by :func:`check_cache`)."""


def _damaged(path: Path, name: str, why: str) -> CacheError:
    return CacheError(
        f"{path / name}: {why}; the model cache is damaged: delete the directory {path} and run again (it is rebuilt)"
    )


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return type(exc).__name__ + (f": {text[:160]}" if text else "")


def check_cache(path: Path, shape: VisionShape) -> None:
    """Raise :class:`CacheError` unless ``path`` holds a usable build of ``shape``: every file of
    :data:`CACHE_FILES` present, the JSON files parse as objects, the image processor's and the
    vision tower's patch and merge sizes are the shape's, the tokenizer loads with the config's
    vocabulary size and image token, and the model loads from the weights with no tensor missing,
    unexpected or of another shape (a truncated ``model.safetensors`` fails there)."""
    for name in CACHE_FILES:
        if not (path / name).is_file():
            raise _damaged(path, name, "missing")
    configs: dict[str, Any] = {}
    for name in CACHE_FILES[:-1]:
        try:
            configs[name] = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise _damaged(path, name, f"not readable as JSON ({_reason(exc)})") from None
        if not isinstance(configs[name], dict):
            raise _damaged(path, name, f"must hold a JSON object, got {type(configs[name]).__name__}")
    vision, images = configs["config.json"].get("vision_config"), configs["preprocessor_config.json"]
    if not isinstance(vision, dict):
        raise _damaged(path, "config.json", f"vision_config must be a JSON object, got {type(vision).__name__}")
    for name, settings, key, want in (
        ("config.json", vision, "spatial_merge_size", shape.merge_size),
        ("config.json", vision, "patch_size", shape.patch_size),
        ("preprocessor_config.json", images, "merge_size", shape.merge_size),
        ("preprocessor_config.json", images, "patch_size", shape.patch_size),
    ):
        if settings.get(key) != want:
            where = f"vision_config.{key}" if name == "config.json" else key
            raise _damaged(path, name, f"{where} must be {want} (the preset's), got {settings.get(key)!r}")
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.utils import logging

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        image_id, size = tokenizer.convert_tokens_to_ids(IMAGE_PAD), len(tokenizer)
    except Exception as exc:  # tokenizers and transformers raise many kinds for a file they cannot read
        raise _damaged(path, "tokenizer.json", f"the tokenizer does not load ({_reason(exc)})") from None
    text = configs["config.json"].get("text_config")
    vocab = text.get("vocab_size") if isinstance(text, dict) else None
    if size != vocab:  # the model was built with one embedding row per token
        raise _damaged(
            path,
            "tokenizer.json",
            f"the tokenizer holds {size} tokens, but config.json's text_config.vocab_size is {vocab!r}",
        )
    if image_id != configs["config.json"].get("image_token_id"):
        raise _damaged(
            path,
            "tokenizer.json",
            f"{IMAGE_PAD} is token {image_id}, but config.json's image_token_id is "
            f"{configs['config.json'].get('image_token_id')!r}",
        )
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # the load report and progress bar: the error below says what is wrong, in one line
    logging.disable_progress_bar()
    try:
        _, info = Qwen2VLForConditionalGeneration.from_pretrained(
            path, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except Exception as exc:  # safetensors, transformers and torch raise many kinds for weights they cannot read
        raise _damaged(path, "model.safetensors", f"the model does not load ({_reason(exc)})") from None
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    for kind, what in (
        ("missing_keys", "tensors missing"),
        ("unexpected_keys", "tensors the model does not have"),
        ("mismatched_keys", "tensors of another shape than config.json's model"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if names:
            more = f" and {len(names) - 2} more" if len(names) > 2 else ""
            raise _damaged(path, "model.safetensors", f"{what}: {', '.join(names[:2])}{more}")


def build_local_vlm(preset: str, out_dir: Path, texts: Iterable[str], seed: int = 0) -> Path:
    """Build (once) and return an HF directory holding the ``preset`` VLM, its tokenizer and
    processor under ``out_dir``; the name carries a digest of the shape, seed and texts. A build
    found there is checked first (:func:`check_cache`: :class:`CacheError` when damaged), as is
    a directory left without some of its files (an interrupted copy or deletion)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    shape = PRESETS[preset]
    texts = list(texts)
    path, built = build_path(
        out_dir,
        f"vision-{preset}",
        [asdict(shape), seed, CHAT_TEMPLATE, texts],
        ("config.json", "preprocessor_config.json"),
    )
    if built or path.exists():  # a build is renamed into place whole: a directory there is one, maybe damaged since
        check_cache(path, shape)
        return path
    tokenizer = train_tokenizer(
        texts, shape.tokenizer_vocab, (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD), CHAT_TEMPLATE
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    eos = tokenizer.eos_token_id
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            max_position_embeddings=4096,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": list(shape.mrope_section),
            },
        ),
        vision_config=dict(
            depth=shape.vision_depth,
            embed_dim=shape.vision_embed_dim,
            hidden_size=shape.hidden_size,
            mlp_ratio=2,
            num_heads=shape.vision_heads,
            patch_size=shape.patch_size,
            spatial_merge_size=shape.merge_size,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = eos
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    image_processor(shape).save_pretrained(tmp)
    tmp.rename(path)
    return path


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    """transformers' ``Qwen2VLProcessor`` (its ``__init__`` and ``__call__`` unchanged) whose
    sub-processors are the image processor and the tokenizer: ``ProcessorMixin`` takes them from
    this list, so the video processor it would require (torchvision) is not asked for."""

    @classmethod
    def get_attributes(cls):
        return ["image_processor", "tokenizer"]


def load_processor(model_dir: Path, max_pixels: int | None = None):
    """The ``Qwen2VLProcessor`` of a directory :func:`build_local_vlm` wrote (or any with a
    tokenizer and a Qwen2-VL image processor config); ``max_pixels`` overrides the image
    processor's resolution budget."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    images = Qwen2VLImageProcessorPil.from_pretrained(model_dir, **({"max_pixels": max_pixels} if max_pixels else {}))
    return Qwen2VLImageOnlyProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
