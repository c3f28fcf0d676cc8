"""A compact Qwen3-style decoder for the consistency chain: embedding, RMSNorm, RoPE, GQA attention
with per-head q/k RMSNorm through :func:`rl_kernel_core.varlen_attention`, SwiGLU MLP, LM head.

Plain PyTorch modules, so the batch-invariant mode's routing of ``aten`` ops is what makes its
matmuls, RMSNorm means and log-softmax batch-invariant. Attention follows the mode too: on, it is
rl-kernel's :func:`~rl_kernel_core.varlen_attention` (fixed KV split order); off, PyTorch's
``scaled_dot_product_attention`` per sequence (:func:`sdpa_attention`), the library default whose
kernel choice depends on the shapes. The same weights run three layouts:

* packed: ``[T]`` tokens of several sequences with ``cu_seqlens`` (training-style varlen);
* padded: ``[B, L]`` with an attention mask, left or right padding; every dense layer runs over all
  ``B * L`` rows, pad rows included, and attention runs on the real tokens only;
* incremental: a :class:`KVCache` and one new token per sequence per call (rollout-style decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rl_kernel_core.batch_invariant_mode.api import is_batch_invariant
from rl_kernel_core.batch_invariant_mode.api_attention import varlen_attention


@dataclass(frozen=True)
class TinyConfig:
    """Shape of :class:`TinyDecoder`; the defaults are small enough for CPU tests."""

    vocab_size: int = 97
    hidden_size: int = 48
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 12
    intermediate_size: int = 96
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6


HF_NAMES: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rope_theta": "rope_theta",
    "rms_eps": "rms_norm_eps",
}
"""Each :class:`TinyConfig` field's name in a ``transformers`` Qwen3 config, in field order."""


class RMSNorm(nn.Module):
    """Hugging Face's Llama/Qwen3 RMSNorm: fp32 ``x * rsqrt(mean(x^2) + eps)``, rounded to x's dtype, times weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x [N, H, hd]`` at ``positions [N]``."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = hd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Causal attention with :func:`varlen_attention`'s layout and bottom-right alignment through
    ``F.scaled_dot_product_attention``: one call over all sequences when they share their query and
    key lengths, else one call per sequence. q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, offsets
    ``[B+1]`` -> ``[Tq, Hq, D]`` in q's dtype."""
    cq = cu_q.tolist()
    ck = cq if cu_k is None else cu_k.tolist()
    group = q.shape[1] // k.shape[1]
    spans = [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1) if cq[b + 1] > cq[b]]
    if not spans:
        return q.new_empty(q.shape)

    def attend(qs, ks, vs):  # [..., L, H, D] -> [..., Lq, Hq, D]
        lq, lk = qs.shape[-3], ks.shape[-3]
        allowed = torch.arange(lk, device=q.device)[None, :] <= (lk - lq + torch.arange(lq, device=q.device))[:, None]
        ks = ks.repeat_interleave(group, dim=-2)
        vs = vs.repeat_interleave(group, dim=-2)
        out = F.scaled_dot_product_attention(
            qs.transpose(-3, -2), ks.transpose(-3, -2), vs.transpose(-3, -2), attn_mask=allowed
        )
        return out.transpose(-3, -2)

    lengths = {(qe - qs, ke - ks) for qs, qe, ks, ke in spans}
    if len(lengths) == 1 and len(spans) == len(cq) - 1:
        ((lq, lk),) = lengths
        n = len(spans)
        out = attend(q.view(n, lq, *q.shape[1:]), k.view(n, lk, *k.shape[1:]), v.view(n, lk, *v.shape[1:]))
        return out.reshape(q.shape)
    return torch.cat([attend(q[qs:qe], k[ks:ke], v[ks:ke]) for qs, qe, ks, ke in spans])


class KVCache:
    """Per-layer, per-sequence cached keys and values ``[L_b, Hkv, hd]`` for incremental decoding
    (``{sequence: rows}`` per layer, sequences in order from the first :meth:`append`)."""

    def __init__(self, num_layers: int):
        self.keys: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.values: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cu: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append sequence b's new rows ``k/v[cu[b]:cu[b+1]]``; return the packed cache and its offsets."""
        lengths = []
        for b in range(len(cu) - 1):
            for store, new in ((self.keys[layer], k), (self.values[layer], v)):
                chunk = new[cu[b] : cu[b + 1]]
                store[b] = torch.cat([store[b], chunk]) if b in store else chunk
            lengths.append(self.keys[layer][b].shape[0])
        offsets = torch.tensor([0] + lengths).cumsum(0)
        return torch.cat(list(self.keys[layer].values())), torch.cat(list(self.values[layer].values())), offsets


class Attention(nn.Module):
    """Causal GQA attention over each sequence's real tokens: :func:`varlen_attention` while the
    batch-invariant mode is on, :func:`sdpa_attention` while it is off. A module of its own, so
    the drift probe can name it."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: Optional[torch.Tensor],
        cu: list[int],
        layer: int,
        cache: Optional[KVCache],
    ) -> torch.Tensor:
        """q ``[N, Hq, hd]``, k/v ``[N, Hkv, hd]`` over all N rows (``rows``: the real ones, None:
        all) -> ``[N, Hq * hd]``, zero on padding rows."""
        n = q.shape[0]
        if rows is not None:
            q, k, v = q[rows], k[rows], v[rows]
        cu_q = torch.tensor(cu)
        attend = varlen_attention if is_batch_invariant() else sdpa_attention
        if cache is None:
            out = attend(q, k, v, cu_q)
        else:
            k_all, v_all, cu_k = cache.append(layer, k, v, cu)
            out = attend(q, k_all, v_all, cu_q, cu_k)
        out = out.reshape(out.shape[0], -1)
        if rows is not None:
            out = out.new_zeros((n, out.shape[1])).index_copy(0, rows, out)
        return out


class _Layer(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.attn = Attention()
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x, positions, rows, cu, layer, cache):
        c = self.c
        n = x.shape[0]
        h = self.input_layernorm(x)
        q = _rope(self.q_norm(self.q_proj(h).view(n, c.num_heads, c.head_dim)), positions, c.rope_theta)
        k = _rope(self.k_norm(self.k_proj(h).view(n, c.num_kv_heads, c.head_dim)), positions, c.rope_theta)
        v = self.v_proj(h).view(n, c.num_kv_heads, c.head_dim)
        x = x + self.o_proj(self.attn(q, k, v, rows, cu, layer, cache))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyDecoder(nn.Module):
    """The chain model; :meth:`forward` is the one pass all layouts share."""

    def __init__(self, config: TinyConfig = TinyConfig()):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu: list[int],
        rows: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """Final hidden states ``[N, hidden_size]`` of ``input_ids [N]`` at ``positions [N]``.

        ``cu``: offsets of the sequences among the real tokens; ``rows``: indices of the real tokens
        among the N rows (None: all rows are real, packed in order); ``cache``: append this call's
        keys/values and attend over the whole cache (the new tokens are each sequence's last ones).
        """
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rows, cu, i, cache)
        return self.norm(x)
