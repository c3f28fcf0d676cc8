"""rl-kernel's attention backend for vLLM: the platform's own backend with its attention computed
by rl-kernel's fixed-order attention over vLLM's paged KV cache.

Used by the batch-invariant hook (:mod:`rl_kernel_vllm.batch_invariant`), which registers these
classes through vLLM's attention-backend registry (``register_backend``) in place of the platform's
default entry: ``CPU_ATTN`` on the CPU build, ``FLASH_ATTN`` on CUDA. The metadata builder and the
cache's shape stay vLLM's; writing this step's keys and values into the cache
(``do_kv_cache_update``, which vLLM calls before ``forward``) and reading them back are ours, in
one plain layout (:func:`split_cache`, vLLM's logical layout): the base backends' own cache kernels
may pack blocks for their ISA.

A query's output has the same bits whether it was computed in a full prefill, a chunk or a decode
step, in any batch: exactly what a trainer running ``varlen_attention`` over the whole sequence
(:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention`) gets.

* CUDA: :func:`rl_kernel_core.batch_invariant_mode.api_attention.paged_attention` reads the keys and values through vLLM's
  block table with ``varlen_attention``'s Triton tiles and arithmetic, and
  :func:`~rl_kernel_core.batch_invariant_mode.api_attention.write_paged_kv` writes the cache; both read every size from
  device memory, and under a CUDA-graph capture the attention launch covers any mix of query counts
  (no ``max_query_len``), so vLLM can capture a step of any batch kind in a full CUDA graph: the
  metadata builder reports ``AttentionCGSupport.ALWAYS`` (the hook runs every batch up to vLLM's
  largest capture size as a full CUDA graph).
* CPU: every running sequence's keys and values are gathered from its cache blocks in position order
  (exact copies) and its queries, the last ``Lq`` positions of the sequence, attend to them with
  ``varlen_attention``'s torch backend (the trainer's on CPU).

Refused at layer construction, naming the setting: attention other than causal decoder
self-attention, sliding windows, ALiBi, logit soft-capping, attention sinks, KV sharing and a
quantized KV cache.

The classes are built on first attribute access (``rl_kernel_vllm.attention.CPUAttentionBackend``,
``...FlashAttentionBackend``), so importing this module imports no vLLM backend the platform lacks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from rl_kernel_core.batch_invariant_mode.api_attention import paged_attention, varlen_attention, write_paged_kv

# our class name -> (vLLM module, its backend class)
BASES: dict[str, tuple[str, str]] = {
    "CPUAttentionBackend": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    "FlashAttentionBackend": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
}


def split_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the key and value caches, each ``[num_blocks, Hkv, block_size, D]``, of vLLM's
    logical cache ``[num_blocks, Hkv, block_size, 2*D]``: a token's key in the first D columns, its
    value in the last D. The backend both writes (:func:`write_cache`) and reads
    (:func:`gather_index`) this layout, whatever packing the base backend's own kernels use."""
    key, value = kv_cache.split(head_size, dim=-1)
    return key, value


def write_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token ``i``'s key/value ``[Hkv, D]`` at slot ``slot_mapping[i]`` (block ``slot //
    block_size``, row ``slot % block_size``); negative slots (padding) are skipped. key/value may
    hold more rows than ``slot_mapping`` (vLLM pads them); the extra rows are ignored."""
    block_size = key_cache.shape[2]
    slots = slot_mapping.long()
    n = slots.shape[0]
    key, value = key[:n], value[:n]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks, rows = slots // block_size, slots % block_size
    key_cache[blocks, :, rows] = key
    value_cache[blocks, :, rows] = value


def gather_index(
    block_table: torch.Tensor, seq_lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, rows)``, each ``[sum(seq_lens)]`` int64: where every sequence's positions live, in
    position order. Position ``p`` of sequence ``b`` is in block ``block_table[b, p // block_size]``
    at row ``p % block_size``."""
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    total = int(sum(seq_lens))
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens, output_size=total)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=device) - starts[seq]
    return block_table.to(device)[seq, pos // block_size].long(), pos % block_size


def step_layout(attn_metadata, block_size: int, device: torch.device):
    """``(blocks, rows, cu_q, cu_k)`` of one engine step on CPU: the gather index (:func:`gather_index`)
    and the host offsets ``varlen_attention`` takes. Computed by the step's first attention layer
    and kept on the step's metadata object, which vLLM shares among the layers of a KV-cache group
    (one host sync per step instead of one per layer)."""
    cached = getattr(attn_metadata, "_rl_kernel_layout", None)
    if cached is not None:
        return cached
    num_reqs = attn_metadata.seq_lens.shape[0]
    seq_lens = attn_metadata.seq_lens.tolist()
    blocks, rows = gather_index(attn_metadata.block_table[:num_reqs], seq_lens, block_size, device)
    cu_q = attn_metadata.query_start_loc[: num_reqs + 1].cpu()
    cu_k = torch.zeros(num_reqs + 1, dtype=torch.int64)
    cu_k[1:] = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0)
    layout = (blocks, rows, cu_q, cu_k)
    attn_metadata._rl_kernel_layout = layout
    return layout


def _check_supported(
    attn_type: Any,
    sliding_window,
    alibi_slopes,
    logits_soft_cap,
    sinks,
    kv_sharing_target_layer_name,
    kv_cache_dtype: str,
) -> None:
    from vllm.v1.attention.backend import AttentionType

    refused = {
        "attn_type": (attn_type != AttentionType.DECODER, f"{attn_type} (only decoder self-attention)"),
        "sliding_window": (sliding_window is not None, sliding_window),
        "alibi_slopes": (alibi_slopes is not None, "set"),
        "logits_soft_cap": (logits_soft_cap not in (None, 0, 0.0), logits_soft_cap),
        "sinks": (sinks is not None, "set"),
        "kv_sharing_target_layer_name": (kv_sharing_target_layer_name is not None, kv_sharing_target_layer_name),
        "kv_cache_dtype": (kv_cache_dtype != "auto", f"{kv_cache_dtype!r} (only 'auto': the model's dtype)"),
    }
    for name, (bad, shown) in refused.items():
        if bad:
            raise ValueError(f"RL_KERNEL_VLLM_BATCH_INVARIANT=1 does not cover this attention layer: {name}={shown}")


def _make_impl(base_impl: type) -> type:
    class Impl(base_impl):
        def __init__(
            self,
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap=None,
            attn_type="decoder",
            kv_sharing_target_layer_name=None,
            sinks=None,
            **kwargs,
        ):
            _check_supported(
                attn_type,
                sliding_window,
                alibi_slopes,
                logits_soft_cap,
                sinks,
                kv_sharing_target_layer_name,
                kv_cache_dtype,
            )
            super().__init__(
                num_heads,
                head_size,
                scale,
                num_kv_heads,
                alibi_slopes,
                sliding_window,
                kv_cache_dtype,
                logits_soft_cap,
                attn_type,
                kv_sharing_target_layer_name,
                sinks,
                **kwargs,
            )

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            """Write this step's keys/values ``[T, Hkv, D]`` into the cache (vLLM calls it before ``forward``)."""
            if kv_cache.is_cuda:
                write_paged_kv(kv_cache, key, value, slot_mapping)
                return
            key_cache, value_cache = split_cache(kv_cache, self.head_size)
            write_cache(key_cache, value_cache, key, value, slot_mapping)

        def forward(
            self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
        ):
            """query ``[T, Hq, D]`` (the step's tokens, padded to T), kv_cache in the base backend's
            layout (this step's keys and values already written) -> ``output`` ``[T, Hq*D]``."""
            if output_scale is not None or output_block_scale is not None:
                raise ValueError("RL_KERNEL_VLLM_BATCH_INVARIANT=1 does not cover fused output quantization")
            if attn_metadata is None:  # vLLM's profiling run
                return output.fill_(0)
            if kv_cache.is_cuda:
                out = output if output.dim() == 3 else output.view(output.shape[0], self.num_heads, self.head_size)
                # a captured graph is replayed for other batches than the capture's: no host bound then
                capturing = torch.cuda.is_current_stream_capturing()
                paged_attention(
                    query,
                    kv_cache,
                    attn_metadata.block_table,
                    attn_metadata.query_start_loc,
                    attn_metadata.seq_lens,
                    None if capturing else attn_metadata.max_query_len,
                    scale=self.scale,
                    out=out,
                )
                return output
            n = attn_metadata.num_actual_tokens
            key_cache, value_cache = split_cache(kv_cache, self.head_size)
            blocks, rows, cu_q, cu_k = step_layout(attn_metadata, key_cache.shape[2], key_cache.device)
            k, v = key_cache[blocks, :, rows], value_cache[blocks, :, rows]
            out = varlen_attention(query[:n], k, v, cu_q, cu_k, causal=True, scale=self.scale)
            output[:n].copy_(out.reshape(output[:n].shape))
            return output

    Impl.__name__ = Impl.__qualname__ = "RLKernel" + base_impl.__name__
    return Impl


@functools.lru_cache(maxsize=None)
def _backend(name: str) -> type:
    import importlib

    module, cls_name = BASES[name]
    base = getattr(importlib.import_module(module), cls_name)
    impl = _make_impl(base.get_impl_cls())
    builder = base.get_builder_cls()
    if name == "FlashAttentionBackend":
        builder = _graph_builder(builder)

    class Backend(base):  # type: ignore[misc,valid-type]
        rl_kernel = True

        @staticmethod
        def get_impl_cls() -> type:
            return impl

        @staticmethod
        def get_builder_cls() -> type:
            return builder

        @classmethod
        def supports_sliding_window(cls) -> bool:
            return False

    Backend.__name__ = Backend.__qualname__ = name
    Backend.__module__ = __name__
    return Backend


def _graph_builder(base_builder: type) -> type:
    """vLLM's FlashAttention metadata builder, reporting full CUDA-graph support for every batch kind
    (``AttentionCGSupport.ALWAYS``, whatever FlashAttention version the base builder would report
    for its own kernels): the paged attention's launch, captured without a host bound, serves any
    mix of prefills, chunks and decodes."""
    from vllm.v1.attention.backend import AttentionCGSupport

    class Builder(base_builder):
        _cudagraph_support = AttentionCGSupport.ALWAYS

    Builder.__name__ = Builder.__qualname__ = "RLKernel" + base_builder.__name__
    return Builder


def __getattr__(name: str) -> Callable[..., Any]:
    if name in BASES:
        return _backend(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
