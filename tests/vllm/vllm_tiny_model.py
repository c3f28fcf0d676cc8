"""A tiny random Qwen2 checkpoint with its own tokenizer, built locally (nothing is downloaded).

The tokenizer is a word-level ``tokenizers`` model trained on a few sentences; the model's vocab
size equals the tokenizer's, ``head_dim`` is 32 (vLLM's CPU attention needs >= 32), weights are
fp32 and drawn from a seeded generator, embeddings untied (so the LM head is its own matrix).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_kernel_core.tools.random_model import randomize_matrices_, tiny_text_config

CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "reinforcement learning from verifiable rewards needs exact log probabilities",
    "one two three four five six seven eight nine ten eleven twelve",
    "a policy samples tokens and a trainer recomputes their log probabilities",
    "red green blue yellow black white orange purple",
)


def build(path: Path, seed: int) -> int:
    """Write tokenizer + ``config.json`` + safetensors weights to ``path``; returns the vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>", "<pad>"]))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    hf_tok.save_pretrained(path)
    vocab = len(hf_tok)
    # transformers types a config's __init__ without the keyword arguments it also accepts (torch_dtype)
    config = Qwen2Config(  # type: ignore[call-arg]
        **tiny_text_config(
            vocab_size=vocab, num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256
        ),
        tie_word_embeddings=False,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        torch_dtype="float32",
    )
    gen = torch.Generator().manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # PreTrainedModel.to typed without self
    randomize_matrices_(model, 0.5, gen)  # wide enough that the next-token distribution is not flat
    model.save_pretrained(path)
    return vocab


def load(path: Path):
    """The saved model as a ``transformers`` ``Qwen2ForCausalLM`` in eval mode (fp32, sdpa)."""
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
