"""Random-weight ``transformers`` causal LMs built locally (nothing is downloaded), for benchmarks,
engine sweeps and tests.

:func:`hf_config` makes an architecture's config from keyword arguments (:func:`tiny_text_config`
gives those of a tiny text model), :func:`randomize_matrices_` redraws a model's matrices from a
generator, and :func:`random_causal_lm` does both for a whole model. ``transformers`` is imported
on first use, so importing this module needs only torch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    """Config keyword arguments of a tiny Qwen-shaped text model (hidden 64, intermediate 128, 2 layers,
    4 query heads of 16 dims over 2 key-value heads, vocab 256, 1024 positions), updated with ``overrides``."""
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "max_position_embeddings": 1024,
        **overrides,
    }


def hf_config(architecture: str, **kwargs: Any):
    """The config of ``architecture`` (a ``transformers`` class name such as ``Qwen3ForCausalLM``)
    built from ``kwargs``, with ``architectures`` set to it.

    Qwen2's config has no ``head_dim`` (it is ``hidden_size // num_attention_heads`` there): for
    ``Qwen2ForCausalLM`` a ``head_dim`` in ``kwargs`` must equal that and is then left out, so one
    set of keyword arguments serves every architecture; another value raises ``ValueError``.
    """
    import transformers

    head_dim = kwargs.pop("head_dim", None) if architecture == "Qwen2ForCausalLM" else None
    config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**kwargs)
    if head_dim is not None and head_dim != config.hidden_size // config.num_attention_heads:
        raise ValueError(
            f"hf_config: head_dim={head_dim} for Qwen2ForCausalLM, whose head_dim is hidden_size // "
            f"num_attention_heads = {config.hidden_size} // {config.num_attention_heads}"
        )
    config.architectures = [architecture]
    return config


def randomize_matrices_(model: torch.nn.Module, std: float, generator: Optional[torch.Generator] = None):
    """Redraw every matrix of ``model`` (each parameter of two or more dims, in parameter order) as
    fp32 N(0, std^2) from ``generator`` (torch's global one when None), rounded to the parameter's
    dtype; vectors (norm weights, biases) keep their values. Returns ``model``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32) * std)
    return model


def random_causal_lm(
    architecture: str, config: dict[str, Any], *, dtype: torch.dtype, device: str, seed: int, std: float
):
    """A ``transformers`` ``architecture`` model of ``config`` (keyword arguments of
    :func:`hf_config`; special ids bos 0, eos 1, pad 2) built on ``device`` in ``dtype``, its
    matrices N(0, std^2) from a ``device`` generator seeded with ``seed``
    (:func:`randomize_matrices_`): the same seed gives the same bits on the same device."""
    import transformers

    hf = hf_config(architecture, **config, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, architecture)(hf).to(dtype)
    return randomize_matrices_(model, std, gen)
