"""A planted corruption for the weight-check test: in vLLM's worker process, the first weight sync
that loads :data:`PARAMETER` leaves one bit of it flipped (the lowest mantissa bit of element
:data:`ELEMENT`); later syncs load it intact.

Named in ``VERL_USE_EXTERNAL_MODULES``, so ``import verl`` imports it in every process of the run;
it acts only where vLLM is already loaded when verl is (vLLM's worker, which imports verl's worker
extension), as :mod:`grpo.verl_cpu` does.
"""

from __future__ import annotations

import functools
import sys

import torch

PARAMETER = "model.layers.0.mlp.down_proj.weight"
ELEMENT = (1, 2)


def plant() -> None:
    """Wrap vLLM's ``Qwen3ForCausalLM.load_weights`` (verl's sync calls it per bucket) to flip the bit once."""
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    load = Qwen3ForCausalLM.load_weights
    if getattr(load, "_flip_bit", False):
        return
    flipped = False

    @functools.wraps(load)
    def load_weights(self, weights):
        nonlocal flipped
        names: list[str] = []

        def seen(source):
            for name, tensor in source:
                names.append(name)
                yield name, tensor

        loaded = load(self, seen(weights))
        if not flipped and PARAMETER in names:
            flipped = True
            with torch.no_grad():
                raw = dict(self.named_parameters())[PARAMETER].data
                raw.view({2: torch.int16, 4: torch.int32}[raw.element_size()])[ELEMENT] ^= 1
        return loaded

    setattr(load_weights, "_flip_bit", True)
    Qwen3ForCausalLM.load_weights = load_weights


if "vllm" in sys.modules:
    plant()
