"""The recipe's policy model: an HF causal LM from ``--model``, or one built locally.

The local model is a Qwen3-style decoder with random weights and a byte-level BPE tokenizer
trained on the problems' text with ``tokenizers``, with Qwen's ChatML turn tokens and chat
template (verl builds prompts from chat messages and treats a ``qwen3`` model as ChatML), saved as
an ordinary HF directory (so
``AutoModelForCausalLM``/``AutoTokenizer`` and verl load it), so the recipe runs offline.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

EOS = "<|endoftext|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
# Qwen's ChatML (without tools or thinking)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """A decoder's shape: what ``Qwen3Config`` needs, and the tokenizer's trained vocabulary.

    ``vocab_size`` None: the model's vocabulary is the trained tokenizer's ids, no more (a small
    data set trains fewer than ``tokenizer_vocab``), so verl's vLLM server, which masks the ids
    past the tokenizer, and verl's trainer normalise over the same ids. A number: the model has
    that many ids whatever the tokenizer covers (a real checkpoint's shape).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: Optional[int]
    tokenizer_vocab: int
    tie_word_embeddings: bool


PRESETS: dict[str, Shape] = {
    # finishes the whole recipe (two runs and the report) on a 2-core CPU in minutes
    "tiny": Shape(64, 192, 2, 2, 1, 32, None, 512, False),
    # Qwen3-0.6B's shapes (D=1024, 28 layers, V=151936); the tokenizer uses the first ids only
    "qwen3-0.6b": Shape(1024, 3072, 28, 16, 8, 128, 151936, 8192, True),
}


def train_tokenizer(
    texts: Iterable[str], vocab: int, extra_special: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
):
    """A byte-level BPE tokenizer of at most ``vocab`` ids trained on ``texts``, with the ChatML
    turn tokens and ``extra_special`` as special tokens (ids 0, 1, 2, then ``extra_special``'s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS, TURN_START, TURN_END, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, chat_template=chat_template)


def build_path(out_dir: Path, name: str, key: list, files: tuple[str, ...]) -> tuple[Path, bool]:
    """``out_dir/<name>-<digest of key>`` (``key``: what the build depends on, JSON-serialisable)
    and whether a finished build is there (every one of ``files`` present)."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    path = Path(out_dir) / f"{name}-{digest}"
    return path, all((path / f).is_file() for f in files)


def build_local_model(preset: str, out_dir: Path, texts: Iterable[str], seed: int = 0) -> Path:
    """Build (once) and return an HF model directory for ``preset`` under ``out_dir``.

    ``texts`` trains the tokenizer (GSM8K questions and answers). The directory name carries a
    digest of the shape, the seed and the texts, so a cached build is reused only when identical.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = PRESETS[preset]
    texts = list(texts)
    path, built = build_path(
        out_dir, preset, [asdict(shape), seed, CHAT_TEMPLATE, texts], ("config.json", "tokenizer.json")
    )
    if built:
        return path
    tokenizer = train_tokenizer(texts, shape.tokenizer_vocab)
    config = Qwen3Config(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size or len(tokenizer),
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path
