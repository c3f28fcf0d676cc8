"""Hook (d): vLLM's forward in rl-kernel's batch-invariant mode (``RL_KERNEL_VLLM_BATCH_INVARIANT=1``).

Goal: a sampled token's log-prob returned by vLLM has the same bits as the trainer's recomputation
of the whole sequence (transformers under :func:`rl_kernel_core.batch_invariant` with
:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention`), whatever else shares the engine step.
In each vLLM process the hook:

* turns the mode on (:func:`rl_kernel_core.set_batch_invariant_mode`): the model's ``aten``
  matmuls, means and log-softmax run rl-kernel's fixed-reduction-order kernels, and on the CPU
  ``silu`` (vLLM's ``SiluAndMul`` on a rank's gate half) the same vector code for every element;
* registers :mod:`rl_kernel_vllm.attention`'s backend in place of the platform's default entry of
  vLLM's attention-backend registry (``CPU_ATTN`` / ``FLASH_ATTN``), and selects that entry;
* makes vLLM's CPU linear layers call ``torch.nn.functional.linear`` (routed) instead of the
  oneDNN/SGL kernels vLLM packs weights for;
* computes RMSNorm with the residual added in the model dtype first, as transformers does (vLLM's
  native fused add-norm takes the mean square of the unrounded fp32 sum);
* fills every rotary layer's ``cos_sin_cache`` with the values the model's transformers rotary
  module gives (:func:`rl_kernel_core.batch_invariant_mode.api_rope.cos_sin_table`: inverse frequencies from the
  CPU, ``cos``/``sin`` on the device): vLLM computes its table on the GPU, where ``pow`` and scalar
  division round differently, and scales ``linear`` ropes' positions instead of their frequencies;
* at tensor parallel size >= 3, sums the tensor-parallel group's partials in rank order after
  gathering them (:mod:`rl_kernel_vllm.tensor_parallel`), the sum the trainer's
  ``use_row_parallel_split`` computes; refuses pipeline and context parallelism;
* runs a Qwen3-MoE's sparse blocks as the trainer's (:mod:`rl_kernel_vllm.moe`: router, top-k,
  experts and combine of :mod:`rl_kernel_core.batch_invariant_mode.api_moe`; its steps eager on CUDA);
* configures the engine so that no other arithmetic sneaks in: compilation mode ``NONE`` (no
  ``torch.compile`` fusion), ``custom_ops=["none"]`` (vLLM's native PyTorch RMSNorm, rotary and
  SiLU-and-mul instead of its fused kernels) and no cascade attention; on CUDA, unless the user
  asked for ``enforce_eager`` or no graphs, every batch up to vLLM's largest capture size (decode,
  prefill or mixed) runs as a full CUDA graph (``cudagraph_mode=FULL``: a replay launches the
  kernels the eager step does, on the step's inputs padded to the captured size, and every kernel
  of the mode gives a row the same bits whatever the other rows; larger steps run eagerly; a
  Qwen3-MoE runs eagerly), announced once per process.

Refused with an error naming the setting (at engine configuration): a model architecture outside
:data:`ARCHITECTURES`, a rope type outside
:data:`~rl_kernel_core.batch_invariant_mode.api_rope.COVERED_ROPE_TYPES`, quantization, speculative decoding, LoRA, a KV-cache dtype other than the
model's, an ``attention_backend`` other than the platform's default entry, and on CUDA a
``max_num_seqs`` above :data:`~rl_kernel_core.batch_invariant_mode.api_attention.PAGED_MAX_SEQS`. Attention layers
the backend does not cover are refused when built (:mod:`rl_kernel_vllm.attention`). Prefix
caching stays on: a cached block holds the bits a recomputation would give (not separately tested).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from rl_kernel_core import adapters
from rl_kernel_core.batch_invariant_mode.api_attention import PAGED_MAX_SEQS
from rl_kernel_core.batch_invariant_mode.api_rope import COVERED_ROPE_TYPES, cos_sin_table, rope_type
from rl_kernel_core.batch_invariant_mode.api import set_batch_invariant_mode
from rl_kernel_vllm import moe, tensor_parallel
from rl_kernel_vllm._log import log_once

ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM") + moe.ARCHITECTURES
"""Architectures whose vLLM forward, with these patches, is op for op transformers' forward (the MoE
ones with :mod:`rl_kernel_vllm.moe`'s blocks)."""

OVERRIDES: tuple[str, ...] = (
    "batch-invariant mode: compilation mode NONE, compilation_config.custom_ops=['none'], no cascade attention, "
    "full CUDA graphs for every batch kind (CUDA, dense models), attention through rl-kernel's fixed-order attention "
    "over the paged KV cache, matmuls/means/log-softmax through rl-kernel's batch-invariant kernels, "
    "rotary tables from the model's transformers rope, tensor-parallel sums (3+ ranks) in rank order",
)
"""The vLLM settings this hook changes, announced once per process when it is live."""

# platform -> (registry entry replaced, our class in rl_kernel_vllm.attention)
BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("CPU_ATTN", "CPUAttentionBackend"),
    "cuda": ("FLASH_ATTN", "FlashAttentionBackend"),
}

RMS_NORM_TARGET = "vllm.model_executor.layers.layernorm:RMSNorm.forward_native"
ROTARY_TARGET = "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase.__init__"
ROTARY_CLASSES: tuple[str, ...] = (
    "RotaryEmbedding",
    "Llama3RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
)
"""vLLM's rotary classes for the covered rope types, whose table :func:`_trainer_rope_table` replaces."""
CPU_GEMM_TARGET = "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm"


def _platform_key(platform: Any) -> str:
    if platform.is_cpu():
        return "cpu"
    if platform.is_cuda():
        return "cuda"
    raise ValueError(f"RL_KERNEL_VLLM_BATCH_INVARIANT=1 covers vLLM on CPU and CUDA, not on {platform.device_name}")


def check_config(vllm_config: Any, entry: str) -> list[str]:
    """Refuse what the mode does not cover and set what it needs on ``vllm_config`` (a
    ``VllmConfig`` being finalised); returns the settings changed, for the log."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model = vllm_config.model_config
    refusals = []
    archs: list[str] = []
    if model is not None:
        archs = list(getattr(model, "architectures", None) or [])
        if not set(archs) & set(ARCHITECTURES):
            refusals.append(f"model architecture {archs} (covered: {', '.join(ARCHITECTURES)})")
        if moe.is_moe(archs):
            refusals += moe.refusals(vllm_config, _text_config(model))
        if getattr(model, "quantization", None):
            refusals.append(f"quantization={model.quantization!r}")
        kind = rope_type(_text_config(model))
        if kind not in COVERED_ROPE_TYPES:
            refusals.append(f"rope_type={kind!r} (covered: {', '.join(COVERED_ROPE_TYPES)})")
    max_seqs = getattr(vllm_config.scheduler_config, "max_num_seqs", None)
    if entry == BACKENDS["cuda"][0] and max_seqs is not None and max_seqs > PAGED_MAX_SEQS:
        refusals.append(f"max_num_seqs={max_seqs} (at most {PAGED_MAX_SEQS} on CUDA: the paged attention's limit)")
    if vllm_config.speculative_config is not None:
        refusals.append("speculative decoding (speculative_config is set)")
    if vllm_config.lora_config is not None:
        refusals.append("LoRA (enable_lora=True)")
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype != "auto":
        refusals.append(f"kv_cache_dtype={cache_dtype!r} (only 'auto')")
    attention = vllm_config.attention_config
    wanted = AttentionBackendEnum[entry]
    if attention.backend not in (None, wanted):
        refusals.append(f"attention_backend={attention.backend.name} (the mode replaces {entry}; leave it unset)")
    refusals += tensor_parallel.refusals(vllm_config, None if model is None else _text_config(model))
    if refusals:
        raise ValueError("RL_KERNEL_VLLM_BATCH_INVARIANT=1 does not cover: " + "; ".join(refusals))
    changed = tensor_parallel.settle(vllm_config)
    if attention.backend is None:
        attention.backend = wanted
        changed.append(f"attention_backend={entry}")
    compilation = vllm_config.compilation_config
    if compilation.mode != CompilationMode.NONE:
        compilation.mode = CompilationMode.NONE
        changed.append("compilation mode NONE (no torch.compile)")
    if compilation.cudagraph_mode != CUDAGraphMode.NONE:  # NONE: enforce_eager or the user's choice, kept
        graphs = CUDAGraphMode.FULL if entry == BACKENDS["cuda"][0] and not moe.is_moe(archs) else CUDAGraphMode.NONE
        if compilation.cudagraph_mode != graphs:
            compilation.cudagraph_mode = graphs
            if graphs == CUDAGraphMode.NONE:
                compilation.cudagraph_capture_sizes = []
            changed.append(f"cudagraph_mode={graphs.name}")
    if model is not None and not model.disable_cascade_attn:
        model.disable_cascade_attn = True
        changed.append("disable_cascade_attn=True")
    if list(compilation.custom_ops) != ["none"]:
        compilation.custom_ops = ["none"]
        changed.append("custom_ops=['none']")
    return changed


def _wrap_check_and_update_config(entry: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        function = original.__func__ if isinstance(original, classmethod) else original

        def check_and_update_config(cls, vllm_config):
            function(cls, vllm_config)
            changed = check_config(vllm_config, entry)
            if changed:
                log_once(
                    "batch-invariant config",
                    "rl_kernel_vllm (pid %d) batch-invariant mode sets: %s",
                    os.getpid(),
                    ", ".join(changed),
                )

        return classmethod(check_and_update_config)

    return make


def _routed_cpu_gemm(original: Any) -> Callable[..., None]:
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        if getattr(layer, "weight", None) is None or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        # keep the weight and call F.linear, which the mode routes (vLLM would pack the weight
        # for a oneDNN/SGL kernel whose blocking depends on the batch)
        setattr(layer, "cpu_linear", torch.nn.functional.linear)

    return dispatch_cpu_unquantized_gemm


def _hf_rms_norm(original: Any) -> Callable[..., Any]:
    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if getattr(self, "variance_size_override", None) is not None or not getattr(self, "has_weight", True):
            raise ValueError(
                "RL_KERNEL_VLLM_BATCH_INVARIANT=1 does not cover an RMSNorm with variance_size_override "
                "or without weight"
            )
        if residual is not None:
            x = x + residual  # in the model dtype, as transformers adds the residual
            residual = x
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight.data * h.to(dtype)
        return out if residual is None else (out, residual)

    return forward_native


def _text_config(model_config: Any) -> Any:
    return getattr(model_config, "hf_text_config", None) or model_config.hf_config


def _trainer_rope_table(original: Any) -> Callable[..., None]:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        cache = getattr(self, "cos_sin_cache", None)
        if cache is None:
            return
        from vllm.config import get_current_vllm_config_or_none

        kind = type(self).__name__
        vllm_config = get_current_vllm_config_or_none()
        if kind not in ROTARY_CLASSES or not self.is_neox_style or len(getattr(self, "scaling_factors", [1.0])) != 1:
            raise ValueError(
                f"RL_KERNEL_VLLM_BATCH_INVARIANT=1 does not cover vLLM's {kind} (neox style "
                f"{self.is_neox_style}; covered: {', '.join(ROTARY_CLASSES)}, neox style, one scaling factor)"
            )
        if vllm_config is None or vllm_config.model_config is None:
            raise ValueError(
                f"RL_KERNEL_VLLM_BATCH_INVARIANT=1: vLLM built a {kind} outside a model's construction "
                f"(no current vLLM config), so its table cannot be matched to the model's transformers rope"
            )
        cos, sin = cos_sin_table(_text_config(vllm_config.model_config), cache.shape[0], cache.device)
        if not cos.shape[1] == self.rotary_dim == cache.shape[1]:
            raise ValueError(
                f"RL_KERNEL_VLLM_BATCH_INVARIANT=1: vLLM's {kind} rotates {self.rotary_dim} dims, "
                f"transformers' rope for this config {cos.shape[1]}"
            )
        half = self.rotary_dim // 2
        self.cos_sin_cache = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).to(cache.dtype)

    return __init__


def _defining_class(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose own namespace holds ``name`` (the platform classes inherit it)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    raise adapters.TargetMissing(f"{cls.__qualname__} has no attribute {name!r}")


def install(patches: adapters.Patches) -> dict[str, Any]:
    """Install the hook in this process (see the module docstring); returns its status entry.

    Every target is located before anything changes, so a vLLM whose targets moved is left untouched."""
    targets: dict[str, str] = {}
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend

        entry, ours = BACKENDS[_platform_key(current_platform)]
        member = AttentionBackendEnum[entry]
        owner = _defining_class(type(current_platform), "check_and_update_config")
        config_target = f"{owner.__module__}:{owner.__qualname__}.check_and_update_config"
        wanted = [
            (config_target, _wrap_check_and_update_config(entry)),
            (RMS_NORM_TARGET, _hf_rms_norm),
            (ROTARY_TARGET, _trainer_rope_table),
            (tensor_parallel.TARGET, tensor_parallel.ordered_all_reduce),
        ]
        if current_platform.is_cpu():
            wanted.append((CPU_GEMM_TARGET, _routed_cpu_gemm))
        wanted += moe.TARGETS
        for target, _ in wanted:
            adapters.locate(target)
    except (adapters.TargetMissing, ImportError, KeyError, AttributeError, ValueError) as exc:
        return {"live": False, "targets": targets, "problems": [f"batch_invariant: {exc}"], "overrides": []}
    previous = _ATTN_OVERRIDES.get(member)

    def undo_backend() -> None:
        if previous is None:
            _ATTN_OVERRIDES.pop(member, None)
        else:
            _ATTN_OVERRIDES[member] = previous

    register_backend(member, f"rl_kernel_vllm.attention.{ours}")
    patches.on_restore(undo_backend)
    targets[f"attention backend {entry}"] = f"rl_kernel_vllm.attention.{ours}"
    for target, make in wanted:
        targets[target] = patches.install(target, make)
    set_batch_invariant_mode(True)

    def mode_off() -> None:
        set_batch_invariant_mode(False)

    patches.on_restore(mode_off)
    return {"live": True, "targets": targets, "problems": [], "overrides": list(OVERRIDES)}
