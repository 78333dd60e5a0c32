"""EngineKVSink: where the KV receiver writes — the engine's reserved blocks, on the engine
thread (AsyncEngine.call), so writes never race a running step.

NOTE: calls are queued FIFO on the engine thread; a release queued after a write runs after it,
so a failing transfer never writes into blocks that were already handed to someone else.
"""
from __future__ import annotations

import torch

from engine.kv_blocks import DTYPE_NAMES, KVBlocks


class EngineKVSink:
    def __init__(self, engine, block_size: int, owner: dict[str, str] | None = None):
        self.engine = engine  # AsyncEngine
        self.block_size = block_size
        # owner[request_id] -> transfer id holding that request's reservation now (shared with
        # DecodeServicer, written on the event loop only). Read on the engine thread when a
        # release runs, so a release queued before a newer Reserve of the id is skipped.
        self.owner = owner if owner is not None else {}

    async def write_layer(self, request_id: str, layer_idx: int, tensor: torch.Tensor,
                          num_tokens: int) -> None:
        blocks = KVBlocks(self.block_size, num_tokens, DTYPE_NAMES[tensor.dtype], [tensor])
        await self.engine.import_kv(request_id, blocks, first_layer=layer_idx)

    async def write_scales(self, request_id: str, k_scales: list[float], v_scales: list[float]) -> None:
        # NOTE: the engine keeps one fp8 scale per layer for the whole cache; prefill and decode
        # must run with the same calibrated scales (same model) for this to be exact.
        blocks = KVBlocks(self.block_size, 0, "fp8_e4m3", [], list(k_scales), list(v_scales))
        await self.engine.import_kv(request_id, blocks)

    async def release(self, request_id: str, transfer_id: str) -> None:
        # never frees a newer reservation of the id (the engine thread reads `owner`)
        await self.engine.release_if_owner(request_id, transfer_id, self.owner)
        if self.owner.get(request_id) == transfer_id:
            self.owner.pop(request_id, None)  # back on the event loop: the reservation is gone
