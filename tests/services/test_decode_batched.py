"""DecodeMany's form of a Decode stream (StreamingMixin._stream_batched): the engine calls the
stream's sink in the step's loop wake-up and every message goes to emit. Driven on a real
AsyncEngine (tiny model, prefill_here requests): the same tokens and finish as the per-request
generator form, Abort (AsyncEngine.interrupt) ends it with an abort message, a cancelled
handler aborts its request; the blocks come back every time. Load reports the tightest TPOT
SLO among the running requests, an aborted one's gone."""
from __future__ import annotations

import asyncio

import pytest

from common.metrics import ServiceMetrics
from decode_svc.servicer import DecodeServicer
from decode_svc.stream_state import response
from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from protos import decode_pb2, generate_pb2
from tests.tiny_engine import tiny_engine


class _NoTransfers:
    """The receiver of a decode that only prefills here: it holds no transfer."""

    def get(self, tid):
        return None

    def find_request(self, rid):
        return None

    def pending(self):
        return []


@pytest.fixture
async def svc():
    eng = tiny_engine(max_model_len=512)
    ae = AsyncEngine(engine=eng)
    await ae.start()
    yield DecodeServicer(ae, _NoTransfers(), ServiceMetrics("decode")), eng
    await ae.stop()


def _req(rid: str, n: int, tpot_ms: int = 0) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8], prefill_here=True,
                                    tpot_ms=tpot_ms)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _free(eng, ae) -> bool:
    for _ in range(200):
        if await ae.call(lambda e: e.kv.num_free_blocks) == eng.kv.num_blocks:
            return True
        await asyncio.sleep(0.01)
    return False


def _into(got: list):
    """An emit that keeps each message as a DecodeResponse (a step's come as its fields)."""
    return lambda m: got.append(response(*m) if type(m) is tuple else m)


def _count(m: ServiceMetrics, outcome: str) -> float:
    return m.registry.get_sample_value("splitserve_requests_total", {"outcome": outcome}) or 0.0


async def test_same_tokens_as_the_generator_form(svc):
    s, eng = svc
    want = [t async for m in s._stream("g", _req("g", 12), _params(12), 0.0, here=True) for t in m.token_ids]
    got: list = []
    await s._stream_batched("b", _req("b", 12), _params(12), 0.0, _into(got), here=True)
    assert [t for m in got for t in m.token_ids] == want and len(want) == 12
    assert got[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert _count(s.metrics, "length") == 2 and _count(s.metrics, "abort") == 0
    assert "b" not in s._running and await _free(eng, s.engine)


async def test_abort_ends_it_with_an_abort_message_and_frees_the_blocks(svc):
    s, eng = svc
    got: list = []
    task = asyncio.create_task(s._stream_batched("a", _req("a", 400), _params(400), 0.0, _into(got), here=True))
    while sum(len(m.token_ids) for m in got) < 3:
        await asyncio.sleep(0.005)
    assert await s._drop(decode_pb2.ReleaseRequest(request_id="a"), "aborted", None)
    await asyncio.wait_for(task, 5)
    assert got[-1].finish_reason == generate_pb2.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in got) < 400
    assert _count(s.metrics, "abort") == 1 and await _free(eng, s.engine)


async def test_a_cancelled_handler_aborts_its_request(svc):
    s, eng = svc
    got: list = []
    task = asyncio.create_task(s._stream_batched("c", _req("c", 400), _params(400), 0.0, _into(got), here=True))
    while not got:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "c" not in s._running and await _free(eng, s.engine)
    assert _count(s.metrics, "abort") == 1


async def test_load_reports_the_tightest_running_tpot_slo(svc):
    s, eng = svc

    async def tightest() -> float:
        return (await s.Load(None, None)).min_tpot_ms

    assert await tightest() == 0.0
    got: list = []
    slow = asyncio.create_task(s._stream_batched("s", _req("s", 400, 40), _params(400), 0.0, _into(got), here=True))
    tight = asyncio.create_task(s._stream_batched("t", _req("t", 400, 25), _params(400), 0.0, _into(got), here=True))
    while not ("s" in s._running and "t" in s._running):
        await asyncio.sleep(0.005)
    assert await tightest() == 25.0
    assert await s._drop(decode_pb2.ReleaseRequest(request_id="t"), "aborted", None)
    await asyncio.wait_for(tight, 5)
    assert await tightest() == 40.0  # the aborted one's SLO left with it
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert await tightest() == 0.0 and await _free(eng, s.engine)
