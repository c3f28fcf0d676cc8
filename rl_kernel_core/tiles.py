"""The tile of a Triton logits pass, as the tuning knobs and the Triton tables both name it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of the Triton logits pass; part of the numerical result (fixed per device kind)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    """Load the gemm route's operands through TMA tensor descriptors where supported (others take
    pointer loads with the same tiles)."""
    persistent: bool = False
    """Launch one program per SM that walks the tiles (flattened loop nest: the next tile's loads
    overlap this tile's epilogue) instead of one program per tile. The tile partition and each
    tile's arithmetic are the same either way."""
