"""Launch shapes of the paged decode attention kernels (engine/kernels/decode_attention.py): the
split kernel's tile (tokens per K/V tile, warps, pipeline stages) and its split rule (how many
programs per SM, so how many context splits), chosen per launch from the cache dtype, the head
width and the number of (sequence, KV head) pairs; each choice with the H200 measurements
that made it. The module-level tiles and switches are what `bench.decode_ab --attr-b
engine.kernels.decode_tiles.NAME=...` changes for whole-step A/Bs (before 2026-12-03 20:00
they lived in decode_attention.py: recorded A/Bs name them there).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from engine.kernels.common import num_sms


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """Launch shape of the split kernel and its split rule: at most `programs_per_sm` x SMs
    programs (ONE wave: a second, partial wave of long programs costs more than shorter
    splits), splits of at least `min_tiles_per_split` KV tiles."""
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool  # manual register double buffering of the next K/V tile
    programs_per_sm: int
    min_tiles_per_split: int
    # launched without the PDL attribute, still triggering the reduce early (decode_attention.CUT_SPLIT)
    cut: bool = False


# H200, 2026-12-03 (bench/decode_ab.py --attn-tiles --attn-splits, Llama-3.1-8B heads,
# scattered blocks; bench/results/decode_ab-20261203T023036 / -T023334): 128-token tiles on
# 8 warps with 3 pipeline stages and one wave of <= 2 programs per SM beat the earlier
# 32-token / 4-warp / ~4-programs-per-SM default at every batch: b=64 ctx2048 153 -> 117 us
# (3.50 -> 4.58 TB/s), b=32 ctx4096 142 -> 122 us, b=16 ctx1024 30 -> 18 us, b=1 ctx1024
# 7.4 -> 6.9 us. fp8 and head_dim > 128 keep the earlier (unre-measured) tiles.
# NOTE: those micro figures came from a benchmark whose cache was [blocks, 2, ...] (K and V
# reads overlapped, half the bytes from L2); on the engine's layout batch 64 takes 136.9 us
# with this tile (decode_ab-20261203T151023), and large batches take the batch tiles below.
TILE_16BIT = DecodeTile(128, 8, 3, False, programs_per_sm=2, min_tiles_per_split=1)
TILE_FP8 = DecodeTile(64, 4, 2, False, programs_per_sm=4, min_tiles_per_split=4)
TILE_WIDE_HEAD = DecodeTile(32, 4, 2, True, programs_per_sm=4, min_tiles_per_split=4)
# 16-bit tiles for batches whose (sequence, KV head) pairs already fill TILE_16BIT's wave, so
# that no split is made: there every program streams its whole context and smaller programs,
# more of them per SM, keep more bytes in flight. H200 (2026-12-03, engine cache layout, the
# fused rotary, bench.decode_ab --attn-tiles): 128-wide heads (8B), 64-token tiles on 4 warps,
# batch 64 ctx 2048 136.9 -> 128.3 us, batch 128 ctx 1024 148.5 -> 131.2 us, whole 8B steps
# 3.4-8.7% faster at batches 48-128 (decode_ab-20261203T151113); 64-wide heads (1B), 128-token
# tiles on 4 warps, batch 128 ctx 1024 89.0 -> 77.1 us, whole 1B steps at batches 40 / 48 / 56
# / 64 / 96 / 128: -4.6 / -5.9 / -16.6 / -9.2 / +4.3 / +0.1% (-T151328; the 64-token tile
# there: +7.6 / +6.7 / -8.9 / -11.4 / -5.7 / +0.2%).
TILE_16BIT_BATCH = DecodeTile(64, 4, 2, False, programs_per_sm=4, min_tiles_per_split=1)
TILE_16BIT_BATCH_NARROW = DecodeTile(128, 4, 2, False, programs_per_sm=4, min_tiles_per_split=1)
BATCH_TILE = True  # module switch (bench.decode_ab --attr-b)
# Few sequences of 128-wide heads (up to FEW_PAIRS (sequence, KV head) pairs: 8B batches 1-8):
# 64-token tiles on 4 warps, the launch cut so the programs are placed one per SM on the GPU
# the qkv matmul left (with PDL they crowded two per SM onto the first SMs qkv freed:
# step_profile --stamps). H200, 2026-12-03 (decode_ab-20261203T180915, 8B, medians of 5):
# batch 1 -2.3% at ctx 1024 (4.269 -> 4.172 ms) and -1.7% at ctx 4096, batch 8 -0.7%; the cut
# alone +0.9 / +0.4 / -0.5%; the 64-token tile alone, with the PDL launch (eighth session and
# earlier), no gain. Batches above 8 and 64-wide heads (1B) keep TILE_16BIT, unmeasured so.
# Second A/B, on the graph replay alone (decode_ab-20261203T192156): without this tile +1.2 /
# +0.2 / +2.1%. Variants of it (decode_ab-20261203T191656, step times with host staging, so
# ~1.5% noise; -T192156 on the replay): 2 warps +0.5 / +0.6 / +1.4%; 1 program per SM +0.9 /
# +2.7 / +2.9%; 4 per SM +0.1 / -2.1 / +1.8%; 32-token tiles -0.3 / +1.5 / +2.5%, with 4 per
# SM +2.5 / +2.1 / +2.0%: none kept.
TILE_16BIT_FEW = DecodeTile(64, 4, 2, False, programs_per_sm=2, min_tiles_per_split=1, cut=True)
FEW_PAIRS = 64
FEW_TILE = True  # module switch (bench.decode_ab --attr-b)


def default_tile(is_fp8: bool, head_dim_pad: int, pairs: int = 0,
                 device: torch.device | None = None) -> DecodeTile:
    """pairs: num_seqs x num_kv_heads of the launch (0: unknown, the small-batch tile)."""
    if head_dim_pad > 128:
        return TILE_WIDE_HEAD
    if is_fp8:
        return TILE_FP8
    if BATCH_TILE and pairs and device is not None and pairs >= TILE_16BIT.programs_per_sm * num_sms(device):
        return TILE_16BIT_BATCH if head_dim_pad > 64 else TILE_16BIT_BATCH_NARROW
    if FEW_TILE and 0 < pairs <= FEW_PAIRS and head_dim_pad > 64:
        return TILE_16BIT_FEW
    return TILE_16BIT


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
