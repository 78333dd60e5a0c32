"""AsyncEngine: the model runs on its own thread; streams, cancel-frees-blocks, call()."""
from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling_params import InvalidRequestError, SamplingParams


def _cfg():
    return EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
                        cache=CacheConfig(num_blocks=64, enable_prefix_caching=False))


@pytest.fixture(scope="module")
def engine():
    return Engine(_cfg())


async def _collect(ae, rid, prompt, params):
    toks = []
    async for o in ae.generate(rid, prompt, params):
        toks += o.new_token_ids
        last = o
    return toks, last


async def test_concurrent_streams_match_sync_engine(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3] * 20]
    ae = AsyncEngine(engine=engine)
    await ae.start()
    try:
        res = await asyncio.gather(*[_collect(ae, f"a{i}", p, params) for i, p in enumerate(prompts)])
        solo = [await _collect(ae, f"s{i}", p, params) for i, p in enumerate(prompts)]
    finally:
        await ae.stop()
    for (t, last), (t2, _) in zip(res, solo):
        assert len(t) == 8 and t == t2
        assert last.finished and last.finish_reason == "length"


async def test_cancel_frees_blocks_and_bad_request_raises(engine):
    ae = AsyncEngine(engine=engine)
    await ae.start()
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        agen = ae.generate("c1", list(range(3, 40)), params)
        got = 0
        async for o in agen:
            got += len(o.new_token_ids)
            if got >= 3:
                break
        await agen.aclose()
        for _ in range(100):
            if await ae.call(lambda e: e.kv.num_free_blocks) == engine.kv.num_blocks:
                break
            await asyncio.sleep(0.02)
        assert await ae.call(lambda e: e.kv.num_free_blocks) == engine.kv.num_blocks
        assert not await ae.call(lambda e: e.has_unfinished())
        with pytest.raises(InvalidRequestError, match="empty"):
            async for _ in ae.generate("bad", [], params):
                pass
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            async for _ in ae.generate("long", [4] * 300, params):
                pass
    finally:
        await ae.stop()
