"""GatewayCore against in-process fake prefill/decode services: the flow, retries, cancel,
dead decode, SLO rejection."""
import asyncio
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway.admission import AdmissionConfig
from gateway.types import GatewayError, GenRequest
from tests.gateway.conftest import make_stack


def req(core, text="abc", **kw):
    slo = {k: kw.pop(k) for k in ("ttft_slo_ms", "tpot_slo_ms") if k in kw}
    ids = core.tokenizer.encode(text)
    return GenRequest(core.new_request_id(), ids, SamplingParams(temperature=0.0, **kw), **slo)


async def collect(core, r):
    return [c async for c in core.generate(r)]


async def test_flow_tokens_text_usage(stack):
    core = stack.core
    chunks = await collect(core, req(core, "abc", max_tokens=5))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == [100, 101, 102, 103, 104]  # 'd'..'h' from the fake model
    assert "".join(c.text for c in chunks) == "defgh"
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.usage == {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0}
    assert last.timings["ttft_ms"] > 0 and last.timings["total_ms"] >= last.timings["ttft_ms"]
    assert not stack.decodes[0].reserved  # nothing left reserved


async def test_stop_string_cuts_text_and_stops_decode(stack):
    core = stack.core
    chunks = await collect(core, req(core, "abc", max_tokens=50, stop=("fg",)))
    assert "".join(c.text for c in chunks) == "de"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == "fg"
    await asyncio.sleep(0.1)
    assert not stack.decodes[0].running and not stack.decodes[0].reserved


async def test_finish_at_first_token_releases_reservation(stack):
    core = stack.core
    chunks = await collect(core, req(core, "abc", max_tokens=1))
    assert [c.token_ids for c in chunks] == [[100]] and chunks[0].finish_reason == "length"
    await asyncio.sleep(0.1)
    assert stack.decodes[0].released and not stack.decodes[0].reserved


async def test_prefill_unavailable_retries_next_replica():
    s = await make_stack(n_prefill=2, prefill_fail=(grpc.StatusCode.UNAVAILABLE,))
    try:
        # make the failing replica look best so it is tried first
        s.core.prefill.replicas[1].load.queued_tokens = 10_000
        chunks = await collect(s.core, req(s.core, "abc", max_tokens=3))
        assert [t for c in chunks for t in c.token_ids] == [100, 101, 102]
        assert s.prefills[0].calls == 1 and s.prefills[1].calls == 1
        assert not s.core.prefill.replicas[0].healthy
        await asyncio.sleep(0.1)
        assert not s.decodes[0].reserved  # the first reservation was released
    finally:
        await s.close()


async def test_no_prefill_left_is_unavailable_with_message():
    s = await make_stack(n_prefill=1, prefill_fail=(grpc.StatusCode.UNAVAILABLE,),
                         dead_prefill_first=True)
    try:
        with pytest.raises(GatewayError) as ei:
            await collect(s.core, req(s.core, "abc", max_tokens=3))
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no prefill replica available" in ei.value.message
        await asyncio.sleep(0.1)
        assert not s.decodes[0].reserved
    finally:
        await s.close()


async def test_client_cancel_cancels_decode_stream():
    s = await make_stack(decode_step_s=0.02)
    try:
        agen = s.core.generate(req(s.core, "abc", max_tokens=10_00 // 4))
        first = await agen.__anext__()
        await agen.__anext__()
        assert first.token_ids == [100] and s.decodes[0].running
        await agen.aclose()
        for _ in range(50):
            if not s.decodes[0].running:
                break
            await asyncio.sleep(0.02)
        assert not s.decodes[0].running and s.decodes[0].cancelled
        assert not s.decodes[0].reserved and s.core.num_active == 0
    finally:
        await s.close()


async def test_decode_dies_midstream_gives_unavailable_fast():
    s = await make_stack(decode_step_s=0.02)
    try:
        agen = s.core.generate(req(s.core, "abc", max_tokens=200))
        await agen.__anext__()
        await agen.__anext__()
        await s.servers[-1].stop(None)  # the decode server goes away
        t0 = time.monotonic()
        with pytest.raises(GatewayError) as ei:
            async for _ in agen:
                pass
        assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert time.monotonic() - t0 < 5
    finally:
        await s.close()


async def test_tiny_ttft_slo_rejected_early_with_reason():
    s = await make_stack(admission=AdmissionConfig(prefill_tokens_per_s=1000.0))
    try:
        t0 = time.monotonic()
        with pytest.raises(GatewayError) as ei:
            await collect(s.core, req(s.core, "abc" * 20, max_tokens=3, ttft_slo_ms=1))
        assert time.monotonic() - t0 < 0.5
        e = ei.value
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_s >= 1
        assert "predicted TTFT" in e.message and "ttft_ms=1" in e.message
        assert s.prefills[0].calls == 0  # rejected before any downstream work
        # a generous SLO is admitted
        chunks = await collect(s.core, req(s.core, "abc", max_tokens=2, ttft_slo_ms=60000))
        assert chunks[-1].finish_reason == "length"
    finally:
        await s.close()


async def test_prompt_validation(stack):
    core = stack.core
    with pytest.raises(GatewayError, match="prompt is empty"):
        core.check_prompt([])
    with pytest.raises(GatewayError, match="too long"):
        core.check_prompt([1] * 300)
    with pytest.raises(GatewayError, match="out of range"):
        core.check_prompt([1, 99999])


async def test_busy_replica_queues_then_admits_when_load_drops():
    s = await make_stack(admission=AdmissionConfig(prefill_tokens_per_s=1000.0))
    try:
        core = s.core
        core.prefill.replicas[0].load.queued_tokens = 10_000  # ~10 s of prefill work ahead
        task = asyncio.create_task(collect(core, req(core, "abc", max_tokens=2, ttft_slo_ms=3000)))
        await asyncio.sleep(0.3)
        assert not task.done() and len(core.queue) == 1 and s.prefills[0].calls == 0
        core.prefill.replicas[0].load.queued_tokens = 0  # the replica drained
        core.queue.notify()
        chunks = await asyncio.wait_for(task, 2)
        assert chunks[-1].finish_reason == "length"
        body = core.metrics.render()[0].decode()
        assert 'splitserve_admission_decisions_total{decision="queue"} 1.0' in body
        assert 'splitserve_admission_decisions_total{decision="admit"} 1.0' in body
    finally:
        await s.close()


async def test_queued_request_rejected_when_its_deadline_passes():
    s = await make_stack(admission=AdmissionConfig(prefill_tokens_per_s=1000.0))
    try:
        core = s.core
        core.prefill.replicas[0].load.queued_tokens = 10_000
        t0 = time.monotonic()
        with pytest.raises(GatewayError) as ei:
            await collect(core, req(core, "abc", max_tokens=2, ttft_slo_ms=300))
        assert 0.2 < time.monotonic() - t0 < 2  # waited about its budget, then gave up
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in ei.value.message
        assert len(core.queue) == 0
    finally:
        await s.close()


async def test_full_decode_waits_for_room_then_rejects_after_budget():
    s = await make_stack()
    try:
        core, dec = s.core, s.decodes[0]
        dec.full = True
        task = asyncio.create_task(collect(core, req(core, "abc", max_tokens=2, ttft_slo_ms=5000)))
        await asyncio.sleep(0.3)
        assert not task.done()
        dec.full = False  # blocks were freed
        chunks = await asyncio.wait_for(task, 3)
        assert chunks[-1].finish_reason == "length"
        dec.full = True
        t0 = time.monotonic()
        with pytest.raises(GatewayError) as ei:
            await collect(core, req(core, "abc", max_tokens=2, ttft_slo_ms=300))
        assert time.monotonic() - t0 < 1.5
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "reserve KV" in ei.value.message
        assert ei.value.retry_after_s >= 1
    finally:
        await s.close()
