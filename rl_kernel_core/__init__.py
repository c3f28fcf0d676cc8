"""rl-kernel core operators: the public API, re-exported from the modules that hold it.

The re-exports load on first access (PEP 562 ``__getattr__``), so importing a standard-library
module of the package (:mod:`rl_kernel_core.switches`, :mod:`rl_kernel_core.adapters`) does not
import torch: the framework adapters read their switches with them at process start, and an
adapter that is off loads nothing else.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that holds it
_EXPORTS: dict[str, str] = {
    "BackendUnavailableError": "rl_kernel_core.dispatch",
    "batch_invariant": "rl_kernel_core.invariance",
    "fused_linear_policy_loss": "rl_kernel_core.loss",
    "group_advantages": "rl_kernel_core.advantages",
    "is_batch_invariant": "rl_kernel_core.invariance",
    "linear_logprob": "rl_kernel_core.logprob",
    "logprob_from_logits": "rl_kernel_core.logprob",
    "LossSpans": "rl_kernel_core.spans",
    "MultimodalBatch": "rl_kernel_core.multimodal.schema",
    "policy_loss": "rl_kernel_core.loss",
    "ratio_kl": "rl_kernel_core.loss",
    "rms_norm": "rl_kernel_core.invariance",
    "sample": "rl_kernel_core.sampling",
    "set_batch_invariant_mode": "rl_kernel_core.invariance",
    "token_advantages": "rl_kernel_core.rewards",
    "varlen_attention": "rl_kernel_core.attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_kernel_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

