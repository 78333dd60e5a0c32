"""DecodeMany: many requests' decode streams on one call (decode_svc/many.py on the decode end,
gateway/decode_many.py on the gateway's), against the fake decode over a real socket."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.decode_many import DecodeMany
from protos import common_pb2, decode_pb2, decode_pb2_grpc
from tests.gateway.fakes import VOCAB, FakeDecode, start_server


def _req(fd: FakeDecode, rid: str, first: int, max_tokens: int, tid: str | None = None):
    if tid is None:
        tid = f"t-{rid}"
        fd.reserved[tid] = rid
    return decode_pb2.DecodeRequest(request_id=rid, transfer_id=tid, first_token_id=first,
                                    params=common_pb2.RequestParams(max_tokens=max_tokens))


async def _collect(stream) -> list[int]:
    out = []
    async for resp in stream:
        out += list(resp.token_ids)
    return out


@pytest.fixture
async def decode():
    fd = FakeDecode(step_s=0.002)
    srv, addr = await start_server(fd)
    ch = grpc.aio.insecure_channel(addr)
    yield fd, decode_pb2_grpc.DecodeStub(ch), addr
    await ch.close()
    await srv.stop(None)


async def test_requests_share_one_call_and_get_their_own_tokens(decode):
    fd, stub, addr = decode
    many = DecodeMany(stub, addr)
    streams = [many.open(_req(fd, f"r{i}", 10 * i, 12)) for i in range(16)]
    got = await asyncio.gather(*(_collect(s) for s in streams))
    for i, toks in enumerate(got):
        assert toks == [(10 * i + k) % VOCAB for k in range(1, 12)]
    assert all(s.done() for s in streams)
    # one call carried them all, and its batches held several requests' tokens
    assert many._session is not None and not many._session.broken
    assert not many._session.streams
    many.close()


async def test_one_request_failing_leaves_the_others_running(decode):
    fd, stub, addr = decode
    many = DecodeMany(stub, addr)
    good = many.open(_req(fd, "ok", 1, 6))
    bad = many.open(_req(fd, "bad", 1, 6, tid="never-reserved"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _collect(bad)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "never-reserved" in e.value.details()
    assert await _collect(good) == list(range(2, 7))
    many.close()


async def test_cancel_stops_that_request_on_decode_only(decode):
    fd, stub, addr = decode
    many = DecodeMany(stub, addr)
    long = many.open(_req(fd, "long", 0, 10_000))
    other = many.open(_req(fd, "other", 100, 40))
    first = await long.__anext__()
    assert list(first.token_ids) == [1]
    long.cancel()
    assert long.done()
    assert await _collect(other) == [(100 + k) % VOCAB for k in range(1, 40)]
    for _ in range(200):
        if "t-long" in fd.cancelled:
            break
        await asyncio.sleep(0.01)
    assert "t-long" in fd.cancelled and "t-long" not in fd.running
    many.close()


async def test_a_broken_call_fails_its_requests_and_the_next_open_reconnects():
    fd = FakeDecode(step_s=0.01)
    srv, addr = await start_server(fd)
    port = int(addr.rsplit(":", 1)[1])
    ch = grpc.aio.insecure_channel(addr)
    try:
        many = DecodeMany(decode_pb2_grpc.DecodeStub(ch), addr)
        streams = [many.open(_req(fd, f"r{i}", 0, 10_000)) for i in range(3)]
        for s in streams:
            await s.__anext__()
        await srv.stop(None)  # the replica goes away mid-stream
        for s in streams:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _collect(s)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        fd2 = FakeDecode()
        srv = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(fd2, srv)
        srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        for _ in range(50):  # the channel reconnects within its backoff
            try:
                assert await asyncio.wait_for(_collect(many.open(_req(fd2, "again", 5, 4))), 5) == [6, 7, 8]
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("DecodeMany did not reopen on the restarted replica")
        many.close()
    finally:
        await ch.close()
        await srv.stop(None)


async def test_a_duplicate_start_on_one_call_is_refused(decode):
    fd, stub, addr = decode
    q: asyncio.Queue = asyncio.Queue()

    async def reqs():
        while (m := await q.get()) is not None:
            yield m

    call = stub.DecodeMany(reqs())
    r = _req(fd, "dup", 0, 10_000)
    q.put_nowait(decode_pb2.DecodeManyRequest(starts=[decode_pb2.DecodeManyStart(request=r)]))
    q.put_nowait(decode_pb2.DecodeManyRequest(starts=[decode_pb2.DecodeManyStart(request=r)]))
    seen_error = None
    async for batch in call:
        for it in batch.items:
            if it.error_code:
                seen_error = it
        if seen_error is not None:
            break
    assert seen_error.request_id == "dup"
    assert seen_error.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    q.put_nowait(decode_pb2.DecodeManyRequest(cancel_request_ids=["dup"]))
    q.put_nowait(None)  # half-close: the call ends once its requests have
    async for _ in call:
        pass
    assert await call.code() == grpc.StatusCode.OK


async def test_gateway_streams_through_decode_many_and_per_request(stack):
    """The core's decode path gives the same tokens either way."""
    from tests.gateway.test_core_fakes import collect, req

    core = stack.core
    many = [t for c in await collect(core, req(core, "abc", max_tokens=6)) for t in c.token_ids]
    assert core.decode.replicas[0].many is not None
    core.decode_streams = "per-request"
    per = [t for c in await collect(core, req(core, "abc", max_tokens=6)) for t in c.token_ids]
    assert many == per == [100, 101, 102, 103, 104, 105]


async def test_a_step_of_many_requests_comes_as_few_batches(decode):
    fd, stub, _ = decode
    # half in one message, the rest one a message
    reqs = [decode_pb2.DecodeManyRequest(starts=[decode_pb2.DecodeManyStart(request=_req(fd, f"b{i}", i, 20))
                                                 for i in range(8)])]
    reqs += [decode_pb2.DecodeManyRequest(starts=[decode_pb2.DecodeManyStart(request=_req(fd, f"b{i}", i, 20))])
             for i in range(8, 16)]

    async def gen():
        for m in reqs:
            yield m

    batches = [b async for b in stub.DecodeMany(gen())]
    sizes = [len(b.items) for b in batches]
    tokens = sum(len(it.response.token_ids) for b in batches for it in b.items)
    assert tokens == 16 * 19  # each request's 19 tokens after the first
    assert len(batches) < tokens / 2 and max(sizes) > 1, sizes


def test_decode_merges_a_requests_queued_messages_in_one_batch():
    from decode_svc.many import _batch, _error
    from protos import generate_pb2

    def item(rid, toks, fin=0):
        return decode_pb2.DecodeManyItem(request_id=rid, response=decode_pb2.DecodeResponse(
            token_ids=toks, text="".join(chr(97 + t) for t in toks), finish_reason=fin,
            num_generated=toks[-1]))

    def plain(rid, toks):  # emit's form of a plain step: `response`'s arguments
        return (rid, (toks, "", [], None, "", 0.0, toks[-1]))

    got = _batch([item("a", [1]), None, item("b", [5]), item("a", [2]), item("a", [3], fin=2),
                  item("b", [6]), _error("b", grpc.StatusCode.INTERNAL, "boom"), plain("c", [7]),
                  plain("c", [8]), ("c", (item("c", [9]).response.token_ids, "j", [], "stop", "",
                                          0.0, 9)), plain("c", [10])]).items
    assert [(it.request_id, list(it.response.token_ids), it.response.text,
             it.response.finish_reason, it.response.num_generated, it.error_code) for it in got] == [
        ("a", [1, 2, 3], "bcd", 2, 3, 0), ("b", [5, 6], "fg", 0, 6, 0),
        ("b", [], "", 0, 0, grpc.StatusCode.INTERNAL.value[0]),
        ("c", [7, 8, 9], "j", generate_pb2.FINISH_REASON_STOP, 9, 0),
        ("c", [10], "", 0, 10, 0)]
    assert _batch([None, None]) is None


async def test_gateway_merges_what_queued_behind_a_busy_reader_and_keeps_the_error_last():
    from gateway.decode_many import ManyStream

    class Session:
        def forget(self, s):
            pass

    s = ManyStream(Session(), "r")
    for toks in ([1], [2], [3]):
        s._put(decode_pb2.DecodeManyItem(request_id="r", response=decode_pb2.DecodeResponse(
            token_ids=toks, num_generated=toks[0])))
    s._put(decode_pb2.DecodeManyItem(request_id="r", error_code=grpc.StatusCode.UNAVAILABLE.value[0],
                                     error_message="gone"))
    first = await s.__anext__()
    assert list(first.token_ids) == [1, 2, 3] and first.num_generated == 3
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await s.__anext__()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and s.done()


def test_request_context_carries_the_requests_trace_not_the_calls():
    from decode_svc.many import RequestAborted, _RequestContext

    class CallCtx:
        def invocation_metadata(self):
            return (("x-splitserve-client", "c1"), ("traceparent", "00-call-span-01"))

        def peer(self):
            return "ipv4:127.0.0.1:1"

    ctx = _RequestContext(CallCtx(), {"traceparent": "00-request-span-01"})
    assert dict(ctx.invocation_metadata()) == {"x-splitserve-client": "c1",
                                               "traceparent": "00-request-span-01"}
    with pytest.raises(RequestAborted):
        asyncio.run(ctx.abort(grpc.StatusCode.NOT_FOUND, "gone"))


async def test_a_burst_of_starts_and_cancels_leaves_in_one_message():
    from gateway.decode_many import _Session

    sent: list = []

    class Stub:
        def DecodeMany(self, requests):  # noqa: N802 - the stub's method name
            async def pump():
                async for m in requests:
                    sent.append(m)
            t = asyncio.get_running_loop().create_task(pump())

            class Call:
                def __aiter__(self):
                    return self

                async def __anext__(self):
                    await t
                    raise StopAsyncIteration

                def cancel(self):
                    t.cancel()
            return Call()

    s = _Session(Stub(), "x:1")
    for i in range(5):
        s.start(decode_pb2.DecodeManyStart(request=decode_pb2.DecodeRequest(request_id=f"r{i}")))
    s.cancel("r1")
    await asyncio.sleep(0.01)
    assert len(sent) == 1
    assert [st.request.request_id for st in sent[0].starts] == [f"r{i}" for i in range(5)]
    assert list(sent[0].cancel_request_ids) == ["r1"]
    s.close()


async def test_a_replica_without_decode_many_gets_a_call_per_request():
    class OldDecode(FakeDecode):
        DecodeMany = decode_pb2_grpc.DecodeServicer.DecodeMany  # an older version's: UNIMPLEMENTED

    fd = OldDecode(step_s=0.001)
    srv, addr = await start_server(fd)
    ch = grpc.aio.insecure_channel(addr)
    try:
        many = DecodeMany(decode_pb2_grpc.DecodeStub(ch), addr)
        first = [many.open(_req(fd, f"o{i}", i, 5)) for i in range(3)]  # met the UNIMPLEMENTED
        assert await asyncio.gather(*(_collect(s) for s in first)) == [
            [i + k for k in range(1, 5)] for i in range(3)]
        assert many.unsupported
        later = many.open(_req(fd, "later", 10, 4))
        assert not isinstance(later, type(first[0]))  # its own Decode call from the start
        assert await _collect(later) == [11, 12, 13]
        s = many.open(_req(fd, "cut", 0, 10_000))
        await s.__aiter__().__anext__()
        s.cancel()
        for _ in range(200):
            if "t-cut" in fd.cancelled:
                break
            await asyncio.sleep(0.01)
        assert "t-cut" in fd.cancelled
    finally:
        await ch.close()
        await srv.stop(None)
