"""Decode's outcome counter: a stream whose caller closes it right after reading the last message
(the gateway does: it cancels the call once it has the finish reason) finished, it was not
aborted. A handler generator closed at its last `yield` never runs the code after it, so the
outcome must be known before that yield. Driven on DecodeServicer._stream directly: the race
with a real cancel depends on load (seen as 14 of 67 finished streams counted abort). Prefill
counts a cancelled RPC as abort and a failed transfer as error; the engine reports preemptions
and each request's queue / prefill time."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from common.metrics import ServiceMetrics
from decode_svc.servicer import DecodeServicer
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from protos import decode_pb2


class _Engine:
    """Just what _stream uses: generate() yielding one token per output, then finished."""
    tokenizer = None

    def __init__(self, n: int):
        self.n = n
        self.aborted: list[str] = []

    async def generate(self, rid, prompt, params, merge=False):
        for i in range(self.n):
            yield RequestOutput(rid, [100 + i], finished=i == self.n - 1,
                                finish_reason="length" if i == self.n - 1 else None,
                                queue_s=0.01 if i == 0 else None, prefill_s=0.02 if i == 0 else None)
            await asyncio.sleep(0)

    async def abort(self, rid):
        self.aborted.append(rid)


def _count(m: ServiceMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("close_after_last", [True, False])
async def test_a_stream_closed_after_its_last_message_counts_as_finished(close_after_last):
    m = ServiceMetrics("decode")
    svc = DecodeServicer(_Engine(4), None, m)
    req = decode_pb2.DecodeRequest(request_id="r1", prompt_token_ids=[1, 2, 3], prefill_here=True)
    gen = svc._stream("r1", req, SamplingParams(max_tokens=4), 0.0, here=True)
    async with contextlib.aclosing(gen):
        got = 0
        async for msg in gen:
            got += len(msg.token_ids)
            if msg.finish_reason and close_after_last:
                break  # aclosing closes the generator at the yield of its last message
    assert got == 4
    assert _count(m, "splitserve_requests_total", outcome="length") == 1
    assert _count(m, "splitserve_requests_total", outcome="abort") == 0
    assert _count(m, "splitserve_request_decode_seconds_count") == 1
    assert _count(m, "splitserve_request_generation_tokens_sum") == 4
    assert _count(m, "splitserve_request_queue_seconds_sum") == pytest.approx(0.01)
    assert _count(m, "splitserve_request_prefill_seconds_sum") == pytest.approx(0.02)
    assert _count(m, "splitserve_inter_token_latency_seconds_count") == 3  # gaps after the first


async def test_a_stream_closed_before_its_end_counts_as_abort():
    m = ServiceMetrics("decode")
    svc = DecodeServicer(_Engine(6), None, m)
    req = decode_pb2.DecodeRequest(request_id="r2", prompt_token_ids=[1, 2, 3], prefill_here=True)
    gen = svc._stream("r2", req, SamplingParams(max_tokens=6), 0.0, here=True)
    async with contextlib.aclosing(gen):
        async for _msg in gen:
            break  # the client went away after the first token
    await asyncio.sleep(0.01)  # the abort task runs
    assert _count(m, "splitserve_requests_total", outcome="abort") == 1
    assert _count(m, "splitserve_requests_total", outcome="length") == 0
    assert _count(m, "splitserve_request_decode_seconds_count") == 0
    assert svc.engine.aborted == ["r2"]


def test_engine_reports_preemptions_and_first_token_timings():
    """A cache too small for everyone preempts: Engine.stats() counts it and the decode metrics
    export it; each request's first output carries its queue and prefill time, later ones not."""
    from tests.engine.overlap_util import PROMPTS, _engine, _greedy

    eng = _engine(False, num_blocks=7)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, _greedy(24))
    firsts: dict[str, list] = {}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            firsts.setdefault(o.request_id, []).append(o)
    assert eng.stats()["num_preemptions"] == eng.scheduler.num_preemptions > 0
    for outs in firsts.values():
        assert outs[0].queue_s is not None and outs[0].queue_s >= 0 and outs[0].prefill_s > 0
        assert all(o.queue_s is None and o.prefill_s is None for o in outs[1:])
    m = ServiceMetrics("decode")
    m.update_from_engine_stats(eng.stats())
    assert _count(m, "splitserve_num_preemptions_total") == eng.scheduler.num_preemptions


async def test_prefill_counts_a_cancelled_rpc_as_abort_and_a_failed_transfer_as_error():
    from engine.async_engine import AsyncEngine
    from kvtransfer.endpoint import PairEndpoint
    from prefill_svc.kv_push import KVPusher
    from prefill_svc.servicer import PrefillServicer
    from protos import common_pb2, prefill_pb2
    from tests.services.test_prefill_streaming import (Aborted, FakeContext, RecordingSender,
                                                       _engine, _layout, _ticket)

    class _Stuck(RecordingSender):  # decode never acks: the transfer hangs until cancelled
        async def open(self, *a, **k):
            tx = await super().open(*a, **k)
            tx.finish = asyncio.Event().wait
            return tx

    eng = _engine()
    ae = AsyncEngine(engine=eng)
    await ae.start()
    try:
        layout, m = _layout(eng), ServiceMetrics("prefill")
        stuck = _Stuck()
        svc = PrefillServicer(ae, KVPusher({"grpc": stuck}, "grpc", PairEndpoint("cpu"), layout, m), m)

        def req(rid):
            return prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=list(range(3, 30)),
                                              ticket=_ticket(layout, 27),
                                              params=common_pb2.RequestParams(max_tokens=4))

        task = asyncio.get_running_loop().create_task(svc.Prefill(req("r1"), FakeContext()))
        await asyncio.get_running_loop().run_in_executor(None, stuck.first_layer.wait, 10)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _count(m, "splitserve_requests_total", outcome="abort") == 1
        assert _count(m, "splitserve_requests_total", outcome="error") == 0
        failing = RecordingSender()
        failing.fail_finish = True
        svc.pusher = KVPusher({"grpc": failing}, "grpc", PairEndpoint("cpu"), layout, m)
        with pytest.raises(Aborted):
            await svc.Prefill(req("r2"), FakeContext())
        assert _count(m, "splitserve_requests_total", outcome="error") == 1
    finally:
        await ae.stop()
