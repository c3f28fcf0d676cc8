"""Rotary position embeddings with one set of bits on both sides of the identity.

transformers computes a rotary layer's inverse frequencies once, in fp32 on the CPU (where
``from_pretrained`` builds the model), and each forward forms ``cos``/``sin`` of ``position *
inv_freq`` on the model's device. An inference engine builds its own table: vLLM computes it on the
GPU at start, where ``pow`` and scalar division round differently from the CPU's (its own source
says so), and applies ``linear`` scaling to the positions instead of the frequencies, so a rollout
and a trainer that agree on every other op still disagree from the first attention layer on
whenever a frequency differs in its last bit.

Both sides take their rotary values from transformers' own code here:

* :func:`cos_sin_table`: the ``cos``/``sin`` table of positions ``0..rows-1`` computed by the
  model's transformers rotary module, built on the CPU, run on the table's device (the engine
  side: :mod:`rl_kernel_vllm.batch_invariant` puts it in vLLM's ``cos_sin_cache``);
* :func:`use_cpu_rope_frequencies`: a transformers model's rotary modules get the frequencies a
  CPU build computes, however the model was built (on a GPU, under a meta device, loaded by a
  framework), so the trainer never depends on where it was constructed.

Covered rope types (:data:`COVERED_ROPE_TYPES`): those whose values depend on the position alone.
``dynamic`` and ``longrope`` change the frequencies with the sequence length seen in a forward,
which an engine's precomputed table cannot follow: refused by name.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

COVERED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
"""Rope types whose rotary values are a function of the position alone (no dynamic rescaling)."""


def rope_type(config: Any) -> str:
    """The rope type of a transformers config: ``rope_parameters["rope_type"]`` (transformers 5),
    else ``rope_scaling["rope_type"]``/``["type"]``, else ``"default"``."""
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(config, field, None)
        if isinstance(params, dict):
            found = params.get("rope_type", params.get("type"))
            if found is not None:
                return str(found)
    return "default"


def check_rope(config: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` and the rope type unless it is covered."""
    kind = rope_type(config)
    if kind not in COVERED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_type {kind!r} is not covered (covered: {', '.join(COVERED_ROPE_TYPES)}; "
            f"its frequencies change with the sequence length, which a precomputed table cannot follow)"
        )


def reference_rotary(config: Any) -> torch.nn.Module:
    """The transformers rotary module of ``config``'s architecture (``<Prefix>RotaryEmbedding`` of
    ``architectures[0] = <Prefix>ForCausalLM``), built on the CPU as ``from_pretrained`` builds it.

    Raises:
        ValueError: no architecture, or transformers has no such rotary class.
    """
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if not archs or not model_type or not archs[0].endswith("ForCausalLM"):
        raise ValueError(
            f"config: expected architectures ['<Prefix>ForCausalLM'] and a model_type, got {archs} and {model_type!r}"
        )
    name = archs[0][: -len("ForCausalLM")] + "RotaryEmbedding"
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        cls = getattr(module, name)
    except (ImportError, AttributeError):
        raise ValueError(f"config: transformers has no {name} for model_type {model_type!r}") from None
    with torch.device("cpu"):
        return cls(config)


def cos_sin_table(config: Any, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[rows, rotary_dim]`` fp32: what ``config``'s transformers rotary module
    returns on ``device`` for positions ``0..rows-1`` (its inverse frequencies from the CPU)."""
    check_rope(config, "config")
    rotary = reference_rotary(config).to(device)
    positions = torch.arange(rows, device=device)[None]
    cos, sin = rotary(torch.empty(0, dtype=torch.float32, device=device), positions)
    return cos[0], sin[0]


def use_cpu_rope_frequencies(model: torch.nn.Module) -> list[str]:
    """Give every transformers rotary module of ``model`` whose rope type is covered (a module with an
    ``inv_freq`` buffer, a ``config`` and a ``rope_type`` in :data:`COVERED_ROPE_TYPES`) the inverse
    frequencies its CPU build computes, in place; returns their names. Other rotary modules (a
    vision tower's, a dynamic rope's) are left as they are: an engine refuses those rope types
    (:func:`check_rope`)."""
    names = []
    for name, module in model.named_modules():
        inv_freq = getattr(module, "inv_freq", None)
        if (
            not isinstance(inv_freq, torch.Tensor)
            or getattr(module, "rope_type", None) not in COVERED_ROPE_TYPES
            or getattr(module, "config", None) is None
        ):
            continue
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        with torch.no_grad():
            inv_freq.copy_(fresh.inv_freq)
            if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
                module.original_inv_freq.copy_(fresh.inv_freq)
        names.append(name)
    return names
