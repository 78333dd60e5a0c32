"""Random KV blocks for the transfer tests (every backend moves the same KVBlocks)."""
from __future__ import annotations

import torch

from engine.kv_blocks import KVBlocks
from kvtransfer.state import KVLayout


def random_blocks(layout: KVLayout, n_blocks: int, seed: int, short: int = 3,
                  raw_bytes: bool = False) -> KVBlocks:
    """n_blocks blocks per layer of random values (x3, so fp8 spans its range), with fp8
    scales per layer; the last block is `short` tokens short of full. raw_bytes: random bytes
    instead (every bit pattern, NaN payloads included), for byte-exact checks."""
    g = torch.Generator().manual_seed(seed)
    if raw_bytes:
        layers = [torch.randint(0, 256, (layout.layer_nbytes(n_blocks),), dtype=torch.uint8,
                                generator=g).view(layout.torch_dtype).reshape(layout.layer_shape(n_blocks))
                  for _ in range(layout.num_layers)]
    else:
        layers = [torch.randn(layout.layer_shape(n_blocks), generator=g).mul(3).to(layout.torch_dtype)
                  for _ in range(layout.num_layers)]
    ks = vs = None
    if layout.dtype == "fp8_e4m3":
        ks = [0.01 * (i + 1) for i in range(layout.num_layers)]
        vs = [0.02 * (i + 1) for i in range(layout.num_layers)]
    return KVBlocks(layout.block_size, n_blocks * layout.block_size - short, layout.dtype, layers, ks, vs)
