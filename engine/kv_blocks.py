"""KVBlocks: one sequence's KV cache blocks, the unit the transfer module moves.

layers[l] is [2, n_blocks, block_size, kv_heads, head_dim] on the CPU (contiguous), in the
cache's storage dtype; fp8 caches carry their per-layer scales so the importer reads the
same values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_e4m3",
}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as int32 when its last dim allows, else uint8. For index ops on KV storage:
    fp8 has no CPU index kernels, and a byte-wise index_copy_ on CPU runs ~6x slower than a
    4-byte-wise one. Source and destination must use the same view."""
    return t.view(torch.int32) if (t.shape[-1] * t.element_size()) % 4 == 0 else t.view(torch.uint8)


@dataclass
class KVBlocks:
    block_size: int
    num_tokens: int
    dtype: str  # one of DTYPE_NAMES values
    layers: list[torch.Tensor]
    k_scales: list[float] | None = None
    v_scales: list[float] | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[1]) if self.layers else 0

    def layer_bytes(self, layer: int) -> bytes:
        t = self.layers[layer].contiguous()
        return t.view(torch.uint8).numpy().tobytes()

    @staticmethod
    def layer_from_bytes(data: bytes, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(NAME_DTYPES[dtype]).reshape(shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
