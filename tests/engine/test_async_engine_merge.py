"""AsyncEngine streams with merge=True: outputs queued behind one are merged into one, in
order, up to a finished one, anything else handed back (_merge_queued); a reader that falls
behind gets every token once; interrupt() ends a stream after what was queued and frees the
request's blocks."""
from __future__ import annotations

import asyncio

from engine.async_engine import AsyncEngine
from engine.async_streams import merge_queued as _merge_queued
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from tests.tiny_engine import tiny_engine


def _q(*items):
    q = asyncio.Queue()
    for x in items:
        q.put_nowait(x)
    return q


def test_merges_in_order_and_stops_at_the_finished_one():
    q = _q(RequestOutput("r", [2], logprobs=[-0.2]), RequestOutput("r", [3], True, "length", logprobs=[-0.3]),
           RequestOutput("r", [9]))
    out, held = _merge_queued(RequestOutput("r", [1], logprobs=[-0.1]), q)
    assert out.new_token_ids == [1, 2, 3] and out.logprobs == [-0.1, -0.2, -0.3]
    assert out.finished and out.finish_reason == "length" and held is None
    assert q.qsize() == 1


def test_hands_back_what_it_cannot_merge():
    marker = object()
    q = _q(RequestOutput("r", [2]), marker, RequestOutput("r", [3]))
    out, held = _merge_queued(RequestOutput("r", [1]), q)
    assert out.new_token_ids == [1, 2] and held is marker and q.qsize() == 1
    err = RequestOutput("r", [], True, "error", error="boom")
    assert _merge_queued(err, _q(RequestOutput("r", [1]))) == (err, None)


async def test_slow_reader_gets_every_token_once_merged():
    eng = tiny_engine()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ae = AsyncEngine(engine=eng)
    await ae.start()
    try:
        fast = [t async for o in ae.generate("f", [5, 6, 7], params) for t in o.new_token_ids]
        items, slow = 0, []
        async for o in ae.generate("s", [5, 6, 7], params, merge=True):
            items += 1
            slow += o.new_token_ids
            await asyncio.sleep(0.02)  # steps pile up behind this reader
    finally:
        await ae.stop()
    assert slow == fast and len(slow) == 24
    assert items < 24  # some outputs came merged


async def test_interrupt_ends_the_stream_and_frees_the_blocks():
    eng = tiny_engine()
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    ae = AsyncEngine(engine=eng)
    await ae.start()
    marker = object()
    try:
        assert not ae.interrupt("x", marker)  # no such stream
        agen = ae.generate("x", list(range(3, 40)), params, merge=True)
        got, end = 0, None
        async for o in agen:
            if o is marker:
                end = o
                continue
            got += len(o.new_token_ids)
            if got >= 3 and end is None:
                assert ae.interrupt("x", marker)
        assert end is marker and got < 200
        for _ in range(200):
            if await ae.call(lambda e: e.kv.num_free_blocks) == eng.kv.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert await ae.call(lambda e: e.kv.num_free_blocks) == eng.kv.num_blocks
        assert not ae.interrupt("x", marker)  # the stream is gone
    finally:
        await ae.stop()
