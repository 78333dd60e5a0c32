"""Launch shapes of the paged decode attention kernels (engine/kernels/decode_attention.py): the
split kernel's tile (tokens per K/V tile, warps, pipeline stages) and its split rule (how many
programs per SM, so how many context splits), chosen per launch from the cache dtype, the head
width, the number of (sequence, KV head) pairs and the engine's KernelOptions.
Measure a tile: python -m lab.decode_ab --attn-tiles / --attn-splits (the kernel alone) and
--kernel-options-b 'tile_16bit={...}' (whole decode steps); lab/notes/kernels.md has past runs.
"""
from __future__ import annotations

import math

import torch

from engine.kernels.common import num_sms
from engine.kernels.options import DEFAULT_KERNELS, TILE_16BIT, DecodeTile, KernelOptions

__all__ = ["DecodeTile", "TILE_16BIT", "TILE_FP8", "TILE_WIDE_HEAD", "TILE_16BIT_BATCH",
           "TILE_16BIT_BATCH_NARROW", "TILE_16BIT_FEW", "FEW_PAIRS", "default_tile", "choose_num_splits"]

# fp8 caches and heads wider than 128 keep the earlier 32/64-token tiles (not re-measured)
TILE_FP8 = DecodeTile(64, 4, 2, False, programs_per_sm=4, min_tiles_per_split=4)
TILE_WIDE_HEAD = DecodeTile(32, 4, 2, True, programs_per_sm=4, min_tiles_per_split=4)
# batches whose pairs fill tile_16bit's wave (no split): smaller programs, more per SM, more
# bytes in flight; 64-token tiles for 128-wide heads, 128-token for 64-wide
# (measure: python -m lab.decode_ab --kernel-options-b batch_tile=False --cases 64:2048,128:1024)
TILE_16BIT_BATCH = DecodeTile(64, 4, 2, False, programs_per_sm=4, min_tiles_per_split=1)
TILE_16BIT_BATCH_NARROW = DecodeTile(128, 4, 2, False, programs_per_sm=4, min_tiles_per_split=1)
# few sequences of 128-wide heads (8B batches 1-8): 64-token tiles, the launch cut so programs
# spread one per SM over the GPU the qkv matmul left
# (measure: python -m lab.decode_ab --kernel-options-b few_tile=False --cases 1:1024,1:4096,8:1024)
TILE_16BIT_FEW = DecodeTile(64, 4, 2, False, programs_per_sm=2, min_tiles_per_split=1, cut=True)
FEW_PAIRS = 64


def default_tile(is_fp8: bool, head_dim_pad: int, pairs: int = 0, device: torch.device | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> DecodeTile:
    """pairs: num_seqs x num_kv_heads of the launch (0: unknown, the small-batch tile)."""
    if head_dim_pad > 128:
        return TILE_WIDE_HEAD
    if is_fp8:
        return TILE_FP8
    tile = kernels.tile_16bit
    if (kernels.batch_tile and pairs and device is not None
            and pairs >= tile.programs_per_sm * num_sms(device)):
        return TILE_16BIT_BATCH if head_dim_pad > 64 else TILE_16BIT_BATCH_NARROW
    if kernels.few_tile and 0 < pairs <= FEW_PAIRS and head_dim_pad > 64:
        return TILE_16BIT_FEW
    return tile


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      block_n: int, device: torch.device, programs_per_sm: int = 2,
                      min_tiles_per_split: int = 1) -> int:
    """Splits so that num_seqs * num_kv_heads * splits stays within one wave of
    programs_per_sm programs per SM, each split keeping >= min_tiles_per_split KV tiles
    (of block_n tokens). Shape-only (max_blocks is the block table's width, not the live
    lengths) => stable under CUDA-graph capture."""
    tiles = max(1, math.ceil(max_blocks * block_size / block_n))
    want = (programs_per_sm * num_sms(device)) // max(1, num_seqs * num_kv_heads)
    return int(max(1, min(want, tiles // max(1, min_tiles_per_split), 64)))
