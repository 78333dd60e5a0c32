"""The disaggregation calls of AsyncEngine (engine/disaggregation.py's Engine methods), each run
on the engine thread through AsyncEngine.call, plus the KV views that are fixed after start."""
from __future__ import annotations

import asyncio
from typing import Mapping

from engine.kv_blocks import KVBlocks
from engine.sampling_params import SamplingParams


class AsyncKVMixin:
    """Needs `call(fn)` (run fn(engine) on the engine thread) and `engine`."""

    async def reserve_replacing(self, request_id: str, num_prompt_tokens: int,
                                prompt_token_ids: list[int] | None = None) -> list[int] | None:
        return await self.call(lambda e: e.reserve_replacing(request_id, num_prompt_tokens,
                                                             prompt_token_ids))

    async def reserved_block_ids(self, request_id: str) -> list[int]:
        return await self.call(lambda e: e.reserved_block_ids(request_id))

    async def import_kv(self, request_id: str, blocks: KVBlocks, first_layer: int = 0) -> None:
        await self.call(lambda e: e.import_kv(request_id, blocks, first_layer=first_layer))

    async def release(self, request_id: str) -> None:
        await self.call(lambda e: e.release(request_id))

    async def publish_if_owner(self, request_id: str, transfer_id: str, owner: Mapping[str, str],
                               prompt_token_ids: list[int]) -> int:
        return await self.call(lambda e: e.publish_if_owner(request_id, transfer_id, owner,
                                                            prompt_token_ids))

    async def release_if_owner(self, request_id: str, transfer_id: str,
                               owner: Mapping[str, str]) -> bool:
        return await self.call(lambda e: e.release_if_owner(request_id, transfer_id, owner))

    async def stream_kv_layers(self, request_id: str, layers: asyncio.Queue,
                               skip_blocks: int = 0) -> None:
        """Prefill side: the request's LayerExports land in `layers` (on this event loop) as
        the engine thread hands them out; raises InvalidRequestError for an id in use."""
        loop = asyncio.get_running_loop()

        def on_layer(x):  # NOTE: runs on the engine thread: only hand over
            loop.call_soon_threadsafe(layers.put_nowait, x)

        await self.call(lambda e: e.stream_kv_layers(request_id, on_layer, skip_blocks))

    async def precompile(self, params: SamplingParams) -> None:
        """Compile a response_format's grammar on a worker thread (seconds the first time), so
        the engine thread's add finds it cached instead of stalling every running request."""
        if params.guided is not None:
            await asyncio.to_thread(self.engine.grammars.compile, params.guided)

    def kv_cache_tensors(self) -> list:
        """Engine.kv_cache_tensors (fixed after start, so readable from the event loop)."""
        return self.engine.kv_cache_tensors()

    def kv_pool(self):
        """Engine.kv_pool (fixed after start)."""
        return self.engine.kv_pool()

    def kv_block_view(self):
        """Engine.kv_block_view (fixed after start)."""
        return self.engine.kv_block_view()

    async def export_kv(self, request_id: str, skip_blocks: int = 0) -> KVBlocks:
        return await self.call(lambda e: e.export_kv(request_id, skip_blocks))

    async def kv_scale_lists(self):
        return await self.call(lambda e: e.kv_scale_lists())
