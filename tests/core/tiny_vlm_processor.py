"""A Qwen2-VL processor built offline: transformers' ``Qwen2VLProcessor`` logic over a word-level
tokenizer with Qwen's vision tokens and the PIL image processor (the core tier has no
torchvision, which Qwen2-VL's video processor needs; images only)."""

from __future__ import annotations

import numpy as np

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]


def tiny_processor(*, max_pixels: int = 28 * 28 * 64, merge_size: int = 2, words: int = 40):
    """A ``Qwen2VLProcessor`` subclass without a video processor: vocabulary ``<unk>``, ``<pad>``,
    Qwen's vision and turn tokens, then ``w0 .. w{words-1}`` split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    vocab = ["<unk>", "<pad>", *SPECIAL, *(f"w{i}" for i in range(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", additional_special_tokens=SPECIAL
    )
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels, merge_size=merge_size)
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=TEMPLATE)


def random_images(rng: np.random.Generator, sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    """RGB uint8 images of the given (height, width)."""
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


IMAGE = "<|vision_start|> <|image_pad|> <|vision_end|>"
