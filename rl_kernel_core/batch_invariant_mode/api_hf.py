"""Hugging Face ``transformers`` models in batch-invariant mode: an attention implementation that
follows the mode.

:func:`use_mode_attention` registers ``"rl_kernel_varlen"`` with transformers' attention and mask
interfaces and selects it on a model. While batch-invariant mode is on, each attention call packs
the real tokens of every row (from the padding mask), or takes the sequences already packed in one
row (from the position ids), and runs :func:`rl_kernel_core.varlen_attention` (fixed KV split
order, so a decode step over a KV cache, a full forward, left or right padding, packing and any
batch size give the same bits); while the mode is off it runs transformers' own ``sdpa``
implementation on the mask transformers builds for it, so the control group is the library default. The dense ops
(projections, RMSNorm, MLP, LM head, log-softmax) are covered by the mode's ``aten`` routing.
:func:`use_row_parallel_split` makes a one-process trainer compute what an engine at tensor
parallel size N computes. Trainers call these at run time; the consistency report's forwards over
such a model are in :mod:`rl_kernel_core.tools.consistency.hf`.
"""

from __future__ import annotations

import torch

from rl_kernel_core.batch_invariant_mode.api import is_batch_invariant
from rl_kernel_core.batch_invariant_mode.api_attention import checked_varlen_attention, varlen_attention
from rl_kernel_core.batch_invariant_mode.api_moe import use_mode_moe
from rl_kernel_core.batch_invariant_mode.api_rope import use_cpu_rope_frequencies
from rl_kernel_core.batch_invariant_mode.api_row_parallel import check_split, rank_order_sum, text_config

ATTN_IMPLEMENTATION = "rl_kernel_varlen"


def _mode_mask(*args, **kwargs):
    """transformers' sdpa mask. While the mode is on, always materialised as a 4-D boolean ``[B, 1,
    Lq, Lk]`` (:func:`mode_attention` reads each row's real tokens from it); while it is off, exactly
    as transformers builds it for ``sdpa`` (None where the causal mask may be skipped), so that
    ``sdpa`` picks the kernels it picks for the unpatched model: on CUDA a materialised mask selects
    another kernel, whose last bits differ."""
    from transformers.masking_utils import sdpa_mask

    if is_batch_invariant():
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def mode_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling=None,
    dropout: float = 0.0,
    **kwargs,
):
    """A transformers attention function: query ``[B, Hq, Lq, D]``, key/value ``[B, Hkv, Lk, D]``
    (the cache included), ``attention_mask`` ``[B, 1, Lq, Lk]`` boolean (True: attend) ->
    ``([B, Lq, Hq, D], None)``.

    Mode on, padded rows: a row's real keys are those its last query may attend to (padding masks
    keys only, and every padded position comes before or after all of the row's real tokens); its
    real queries are the real keys among the last Lq positions. They are packed and attended
    causally with bottom-right alignment; padded query rows get zeros.

    Mode on, packed sequences (one row holding several sequences back to back, no cache, as verl's
    ``use_remove_padding`` layout passes them): transformers hands the decoder layer's
    ``position_ids`` ``[1, L]`` to the attention function, and a sequence starts wherever a
    position is not its predecessor's plus one (transformers' own rule for the packed mask,
    ``find_packed_sequence_indices``). Each sequence attends causally to itself.

    Full (non-causal) attention, as a vision tower's blocks ask for it (``is_causal=False``, or a
    module whose ``is_causal`` is False; Qwen2-VL's ``VisionAttention`` calls once per image with no
    mask): every query of a row attends to all of the row's real keys.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not is_batch_invariant():
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout != 0.0 and module.training:
        raise ValueError(f"batch-invariant attention has no dropout; got dropout={dropout}")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"batch-invariant attention has no sliding window; got sliding_window={kwargs['sliding_window']}"
        )
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    b, hq, lq, d = query.shape
    lk = key.shape[2]
    if not causal and lq != lk:
        raise ValueError(f"batch-invariant full attention needs as many queries as keys; got Lq={lq}, Lk={lk}")
    cu = _cached(
        kwargs.get("position_ids"), (b, lq, lk), lambda: _packed_offsets(kwargs.get("position_ids"), b, lq, lk)
    )
    if cu is not None:
        out = varlen_attention(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, causal=causal, scale=scaling
        )
        return out[None], None
    query_rows, key_rows, cu_q, cu_k = _cached(
        attention_mask, (b, lq, lk), lambda: _padded_layout(attention_mask, b, lq, lk)
    )
    hkv = key.shape[1]
    q = query.transpose(1, 2).reshape(b * lq, hq, d)
    k = key.transpose(1, 2).reshape(b * lk, hkv, d)
    v = value.transpose(1, 2).reshape(b * lk, hkv, d)
    scale = d**-0.5 if scaling is None else float(scaling)
    if query_rows is None:  # no padding: the batch's own layout is the packed one
        out, _ = checked_varlen_attention(q, k, v, cu_q, cu_k, causal, scale)
        return out.view(b, lq, hq, d), None
    out, _ = checked_varlen_attention(
        q.index_select(0, query_rows),
        k.index_select(0, key_rows),
        v.index_select(0, key_rows),
        cu_q,
        cu_k,
        causal,
        scale,
    )
    return query.new_zeros((b * lq, hq, d)).index_copy(0, query_rows, out).view(b, lq, hq, d), None


def _cached(source, shape: tuple[int, int, int], compute):
    """``compute()``, kept on the tensor ``source`` (the attention mask or the position ids, which
    transformers builds once per forward and passes to every layer) for later calls with the same
    ``(B, Lq, Lk)`` while ``source`` is not changed in place: one host read per forward instead of
    one per layer. Computed every call when ``source`` is None."""
    if source is None:
        return compute()
    key = (shape, source._version)
    cached = getattr(source, "_rl_kernel_layout", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = compute()
    source._rl_kernel_layout = (key, value)
    return value


def _padded_layout(attention_mask, b: int, lq: int, lk: int):
    """``(query rows, key rows, cu_q, cu_k)`` of a padded batch: the flat indices (``row * L +
    position``, int64 on the mask's device) of each row's real queries and keys in order, and the offsets
    of the packed layout (lists of ints; :func:`~rl_kernel_core.batch_invariant_mode.api_attention.varlen_attention`'s checks
    hold for them). A row's real keys are those its last query may attend to; its real queries are
    the real keys among the last ``Lq`` positions. Both index tensors are None where every position
    is real (no mask, or no padding): the batch is then packed as it is."""
    if attention_mask is None:
        return None, None, [i * lq for i in range(b + 1)], [i * lk for i in range(b + 1)]
    last = attention_mask[:, 0, -1, :]
    key_ok = last if last.dtype == torch.bool else last == 0
    query_ok = key_ok[:, lk - lq :]
    counts = torch.stack([query_ok.sum(1), key_ok.sum(1)]).cpu()
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q, cu_k = (torch.cat([zero, c.cumsum(0)]).tolist() for c in counts)
    if cu_q[-1] == b * lq and cu_k[-1] == b * lk:
        return None, None, cu_q, cu_k
    return query_ok.reshape(-1).nonzero().flatten(), key_ok.reshape(-1).nonzero().flatten(), cu_q, cu_k


def _packed_offsets(position_ids, b: int, lq: int, lk: int):
    """Offsets ``[S+1]`` (int64, CPU) of the sequences packed in a single row of ``lq`` tokens, from
    its ``position_ids`` ``[1, lq]``; None when the input is not packed (several rows, a KV cache,
    no position ids, or one sequence)."""
    if position_ids is None or b != 1 or lq != lk or position_ids.shape[-1] != lq:
        return None
    positions = position_ids.reshape(-1, lq)[0].cpu()
    starts = (positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1
    if starts.numel() == 0:
        return None
    return torch.cat([torch.zeros(1, dtype=torch.int64), starts, torch.tensor([lq])])


def use_mode_attention(model) -> None:
    """Register :func:`mode_attention` (once) and make ``model`` use it: ``varlen_attention`` while
    batch-invariant mode is on, transformers' ``sdpa`` while it is off. Also gives its rotary
    modules the inverse frequencies a CPU build computes
    (:func:`~rl_kernel_core.batch_invariant_mode.api_rope.use_cpu_rope_frequencies`, the values the engine side's
    rotary table is built from); rotary modules of a rope type the identity does not cover are left
    as they are (the engine side refuses those types). A Qwen3-MoE's sparse blocks compute their
    router, experts and combine as the engine side does while the mode is on
    (:func:`~rl_kernel_core.batch_invariant_mode.api_moe.use_mode_moe`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    use_cpu_rope_frequencies(model)
    use_mode_moe(model)
    AttentionInterface.register(ATTN_IMPLEMENTATION, mode_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mode_mask)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""The decoder layers' linears an inference engine's tensor parallelism splits along their input
(row-parallel: each rank multiplies its slice of the input features, then an all-reduce sums)."""


def use_row_parallel_split(model, parts: int) -> list[str]:
    """Make ``model``'s row-parallel linears (:data:`ROW_PARALLEL`) compute what an engine at tensor
    parallel size ``parts`` computes under the batch-invariant mode: rank r's product of the r-th
    contiguous slice of the input features with the weight's matching columns, rounded to the model
    dtype, and the ranks' products summed by
    :func:`~rl_kernel_core.batch_invariant_mode.api_row_parallel.rank_order_sum` (float32 accumulation in rank
    order 0, 1, ..., one rounding to the model dtype; at ``parts`` 2 the single rounding any
    two-rank all-reduce makes). With the mode's matmul each slice's product has the bits of the
    engine rank's, so a one-process trainer gets a TP=``parts`` rollout's values. Returns the
    patched module names.

    Raises ``ValueError`` (``TypeError`` for a non-integer ``parts``) naming what is refused:
    ``parts`` < 1, ``parts`` not dividing the model's ``num_attention_heads`` or
    ``intermediate_size`` (:func:`~rl_kernel_core.batch_invariant_mode.api_row_parallel.check_split`) or a
    linear's input size, a linear with a bias (an engine adds it on one rank only). ``parts`` 1
    changes nothing."""
    check_split(text_config(getattr(model, "config", None)), parts)
    patched: list[str] = []
    if parts == 1:
        return patched
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and name.endswith(ROW_PARALLEL)):
            continue
        if module.bias is not None:
            raise ValueError(
                f"{name}: a row-parallel linear with a bias is not covered (an engine adds it on one rank)"
            )
        if module.in_features % parts:
            raise ValueError(f"{name}: in_features={module.in_features} is not divisible by parts={parts}")
        module.forward = _split_forward(module, parts)
        patched.append(name)
    return patched


def _split_forward(module: torch.nn.Linear, parts: int):
    width = module.in_features // parts

    def rank(x: torch.Tensor, r: int) -> torch.Tensor:
        # the weight's columns copied contiguous: the engine rank's own [M, K/parts] tensor, same strides
        weight = module.weight[:, r * width : (r + 1) * width].contiguous()
        return torch.nn.functional.linear(x[..., r * width : (r + 1) * width], weight)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return rank_order_sum([rank(x, r) for r in range(parts)])

    return forward
