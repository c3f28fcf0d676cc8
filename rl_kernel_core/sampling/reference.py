"""Plain-PyTorch reference of ``sample`` (backend ``torch``): the semantics oracle.

For one row with logits ``l [V]``, temperature ``T``, filters and a 64-bit ``seed``:

1. Greedy rows (``T == 0``): ``token = argmax l`` (the first index among equal maxima).
2. Otherwise ``x = fp32(l) * fp32(1 / T)`` (the reciprocal of the fp64 temperature formed in fp64,
   then one fp32 product per element: the scaling of ``logprob_from_logits``' Triton kernel at
   ``temperature=T``).
3. Filters, in vLLM's order (``vllm/v1/worker/gpu/sample/sampler.py`` and
   ``vllm/v1/sample/sampler.py`` both apply temperature, then min-p, then top-k and top-p
   together, top-k first), each acting on what the previous ones kept:

   * min-p: keep ``x_i >= max x + fp32(log(min_p))``, i.e. ``p_i >= min_p * max p`` (the sum in
     fp32 as vLLM; the log formed in fp64 and rounded once).
   * top-k: keep ``x_i >= `` the k-th largest kept value (ties at the threshold are all kept).
   * top-p: over the kept tokens renormalised (fp64), sorted by decreasing probability, keep the
     shortest prefix whose mass reaches ``top_p`` (a token is kept when the mass strictly before
     it is ``< top_p``; the most likely token always is), plus every token tying with its last
     value, so the kept set does not depend on how a sort orders equal values.

4. Draw: Gumbel-max, ``token = argmax over kept i of (x_i + g_i)`` with ``g_i = -log(-log u_i)``,
   all in fp32, which samples from ``softmax(x)`` restricted to the kept set (the 23-bit uniforms
   bound ``g`` to about [-2.8, 16.6], a truncation of probability below 1e-7). The uniforms
   ``u_i`` come from a counter-based hash keyed on ``(seed, position, i)``, not a stateful
   generator: with ``mix64`` SplitMix64's finaliser (uint64 arithmetic mod 2**64), the row state
   is ``state = mix64(mix64(seed + 0xD1B54A32D192ED03) + position * 0xDB4F0B9175AE2165)`` and
   ``u_i = (top 23 bits of mix64(state + (i + 1) * 0x9E3779B97F4A7C15) + 0.5) / 2**23`` in
   ``(0, 1)`` (exact in fp32). The state absorbs the seed, then the position, each through the
   finaliser (a bijection of 64-bit words): the hashed seed starts a SplitMix64 stream and the
   position, times an odd constant, steps it as SplitMix64 steps its counter. So the state is not
   symmetric in seed and position, one seed gives distinct states at distinct positions (and one
   position distinct states for distinct seeds), and seed 0 is mixed like any other (the offset
   keeps it off ``mix64``'s fixed point ``mix64(0) = 0``).
   So a row's draw depends on its own logits, parameters, seed and position only, on every
   device (integer math is exact). Earlier versions keyed the state as
   ``mix64(mix64(seed) + mix64(position))``, symmetric in the two (seed 3 at position 5 drew what
   seed 5 at position 3 did); the same seed and position now draw other tokens than they did.
5. ``logprob`` of the token under the full vocab before any filter, with ``T = 1`` for greedy
   rows: the bits of ``logprob_from_logits(l, token, temperature=T)`` on this backend (fp32
   ``l / T``, its max, sum of exponentials and log), row by row.
6. A row whose tempered logits hold no distribution (every entry -inf, a NaN, or a +inf, from the
   logits or from ``l / T`` overflowing fp32) has no such token: its log-prob is NaN and the public
   op returns token 0 for it on every backend (the draws above pick different tokens there).

Every row-wise step runs in fixed-shape row tiles
(:func:`rl_kernel_core.batch_invariant_mode.reference.row_tiled`), so the tokens and the log-prob bits
of a row do not depend on the batch size or the row's position either.
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode.reference import row_tiled
from rl_kernel_core.logprob.reference import token_logprobs


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _signed(0x9E3779B97F4A7C15)
_SEED_OFFSET = _signed(0xD1B54A32D192ED03)  # added to the seed before it is hashed
_POSITION_GAMMA = _signed(0xDB4F0B9175AE2165)  # odd: the position's step of the seed's stream
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (uint64 arithmetic mod 2**64 on the same bits)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def row_state(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 hash states ``mix64(mix64(seed + 0xD1B54A32D192ED03) + position *
    0xDB4F0B9175AE2165)`` (uint64 arithmetic on the int64 bits): the seed, then the position,
    absorbed through SplitMix64's finaliser, so neither can stand in for the other."""
    return mix64(mix64(seeds + _SEED_OFFSET) + positions * _POSITION_GAMMA)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` fp32 uniforms in ``(0, 1)``: entry ``[b, i]`` is a function of
    ``(seeds[b], positions[b], i)`` only."""
    ids = torch.arange(1, vocab + 1, device=seeds.device, dtype=torch.int64)
    z = mix64(row_state(seeds, positions)[:, None] + ids[None, :] * _GAMMA)
    return (_shift_right(z, 41).to(torch.float32) + 0.5) * 2.0**-23


def _keep_mask(
    x: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """The kept-token mask ``[B, V]`` for tempered fp32 logits ``x`` (None: every token is kept)."""
    keep = None
    if min_p is not None:
        keep = x >= x.amax(dim=-1, keepdim=True) + torch.log(min_p.to(torch.float64)).to(torch.float32)[:, None]
    if top_k is None and top_p is None:
        return keep
    masked = x if keep is None else x.masked_fill(~keep, float("-inf"))
    vals = masked.sort(dim=-1, descending=True).values
    threshold = torch.full_like(x[:, :1], float("-inf"))
    if top_k is not None:
        kth = vals.gather(1, (top_k.clamp(1, x.shape[1]) - 1)[:, None])
        vals = vals.masked_fill(vals < kth, float("-inf"))
        threshold = kth
    if top_p is not None:
        probs = torch.softmax(vals.to(torch.float64), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        count = ((before < top_p[:, None]) & torch.isfinite(vals)).sum(dim=-1).clamp(min=1)
        last = vals.gather(1, (count - 1)[:, None])
        last = last.masked_fill(top_p[:, None] >= 1.0, float("-inf"))
        threshold = torch.maximum(threshold, last)
    above = x >= threshold
    return above if keep is None else keep & above


def _sample_tile(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    min_p: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    greedy = temperature == 0
    inv_temp = torch.where(greedy, 1.0, 1.0 / temperature.to(torch.float64)).to(torch.float32)
    x = logits.to(torch.float32) * inv_temp[:, None]
    score = x - torch.log(-torch.log(uniforms(seeds, positions, x.shape[1])))
    keep = _keep_mask(x, top_k, top_p, min_p)
    if keep is not None:
        score = score.masked_fill(~keep, float("-inf"))
    tokens = torch.where(greedy, logits.argmax(dim=-1), score.argmax(dim=-1))
    return tokens, token_logprobs(logits, tokens, torch.where(greedy, 1.0, temperature).tolist())


def _as_rows(value, b: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    if value is None or isinstance(value, torch.Tensor):
        return value
    return torch.full((b,), value, dtype=dtype, device=device)


@dispatch.register("sample", "torch")
def sample(
    logits: torch.Tensor, temperature, seeds: torch.Tensor, positions, top_k, top_p, min_p
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded sampling of ``logits [B, V]``; see the module docstring for the exact semantics and
    :mod:`rl_kernel_core.sampling.api` for the argument contract (numbers or ``[B]`` tensors)."""
    b, dev = logits.shape[0], logits.device
    temperature = _as_rows(temperature, b, torch.float64, dev)
    positions = _as_rows(0 if positions is None else positions, b, torch.int64, dev)
    filters = {
        "top_k": _as_rows(top_k, b, torch.int64, dev),
        "top_p": _as_rows(top_p, b, torch.float64, dev),
        "min_p": _as_rows(min_p, b, torch.float32, dev),
    }
    present = {name: value for name, value in filters.items() if value is not None}

    def tile(
        lg: torch.Tensor, t: torch.Tensor, s: torch.Tensor, pos: torch.Tensor, *values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _sample_tile(lg, t, s, pos, **dict(zip(present, values)))

    tokens, logprobs = row_tiled(tile, logits, temperature, seeds, positions, *present.values())
    return tokens, logprobs
