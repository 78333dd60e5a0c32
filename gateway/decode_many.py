"""The gateway's end of DecodeMany (decode.proto): one call per decode replica carries every
request's decode stream, so a step of 64 requests reaches the gateway as one message.

DecodeMany.open() starts a request and returns a ManyStream, which reads like a per-request
Decode call: async iteration over DecodeResponses, grpc.aio.AioRpcError on an
error, cancel() / done(). A broken call fails every request on it with the call's status
(UNAVAILABLE when the replica went away); the next open() starts a new call. A replica that
answers UNIMPLEMENTED (a version without DecodeMany) gets a Decode call per request from then on,
the requests that met it included.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from common.convert import merge_decode_response
from protos import decode_pb2

log = logging.getLogger("splitserve.gateway")

_CODES = {c.value[0]: c for c in grpc.StatusCode}
DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class ManyStream:
    """One request's decode stream on a DecodeMany call."""

    def __init__(self, session: "_Session", request_id: str, fallback=None):
        self._session, self.request_id = session, request_id
        self._q: asyncio.Queue = asyncio.Queue()
        self._held = None  # an item taken while merging that ends the stream: handled next
        self._done = False
        self._fallback = fallback  # () -> the request's own Decode call, if DecodeMany is unknown
        self._own = self._call = None  # that call and its iterator, once taken
        self._started = False  # a message came: too late to fall back

    def _put(self, item) -> None:
        self._q.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> decode_pb2.DecodeResponse:
        if self._call is not None:
            return await self._call.__anext__()
        if self._done:
            raise StopAsyncIteration
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await self._q.get()
        if isinstance(item, grpc.aio.AioRpcError):  # the call broke
            self._done = True
            if (item.code() == grpc.StatusCode.UNIMPLEMENTED and not self._started
                    and self._fallback is not None):
                # a decode replica without DecodeMany (an older version): its own Decode call
                self._own = self._fallback()
                self._call = self._own.__aiter__()
                return await self._call.__anext__()
            raise item
        self._started = True
        if item.error_code:
            self._end()
            raise rpc_error(_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN), item.error_message)
        resp = item.response
        # NOTE: what queued up while this request's reader was busy leaves as one message, so a
        # loaded gateway spends its per-message work (text, metrics, the client's write) once
        while not resp.finish_reason and not self._q.empty():
            nxt = self._q.get_nowait()
            if isinstance(nxt, grpc.aio.AioRpcError) or nxt.error_code:
                self._held = nxt
                break
            merge_decode_response(resp, nxt.response)
        if resp.finish_reason:
            self._end()
        return resp

    def done(self) -> bool:
        return self._done if self._own is None else self._own.done()

    def cancel(self) -> None:
        """Stop the request on decode (as cancelling its Decode call would). Idempotent."""
        if self._own is not None:
            self._own.cancel()
        elif not self._done:
            self._end()
            self._session.cancel(self.request_id)

    def _end(self) -> None:
        self._done = True
        self._session.forget(self)


class _Session:
    """One DecodeMany call: its request messages (queued, written in order by grpc's own
    consumer of the iterator) and the reader that hands each item to its stream."""

    def __init__(self, stub, address: str):
        self.address = address
        self.streams: dict[str, ManyStream] = {}
        self._out: asyncio.Queue = asyncio.Queue()
        self.broken = False
        self.call = stub.DecodeMany(self._requests())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self):
        """What was queued since the last write, as one message: a burst of arrivals reaches
        decode together (a write each would space them by a write's round trip)."""
        while True:
            ops = [await self._out.get()]
            while not self._out.empty():
                ops.append(self._out.get_nowait())
            m = decode_pb2.DecodeManyRequest()
            for op in ops:
                if op is None:
                    return
                if isinstance(op, str):
                    m.cancel_request_ids.append(op)
                else:
                    m.starts.append(op)
            yield m

    def start(self, st: decode_pb2.DecodeManyStart) -> None:
        if not self.broken:
            self._out.put_nowait(st)

    def cancel(self, request_id: str) -> None:
        if not self.broken:
            self._out.put_nowait(request_id)

    def forget(self, s: ManyStream) -> None:
        if self.streams.get(s.request_id) is s:
            del self.streams[s.request_id]

    async def _read(self) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"decode replica {self.address} ended the DecodeMany call")
        try:
            async for batch in self.call:
                for it in batch.items:
                    s = self.streams.get(it.request_id)
                    if s is not None:  # else: cancelled here meanwhile
                        s._put(it)
        except grpc.aio.AioRpcError as e:
            err = rpc_error(e.code(), e.details() or "")
        except asyncio.CancelledError:
            err = rpc_error(grpc.StatusCode.CANCELLED, "gateway closing")
            raise
        except Exception as e:  # noqa: BLE001 - every stream on the call learns of it
            log.exception("DecodeMany reader for %s failed", self.address)
            err = rpc_error(grpc.StatusCode.INTERNAL, f"DecodeMany reader failed: {e}")
        finally:
            self.broken = True
            for s in list(self.streams.values()):
                s._put(err)
            self.streams.clear()
            self._out.put_nowait(None)

    def close(self) -> None:
        self.reader.cancel()
        self.call.cancel()


class DecodeMany:
    """The DecodeMany call to one decode replica (opened on first use, reopened after a break)."""

    def __init__(self, stub, address: str):
        self._stub, self.address = stub, address
        self._session: _Session | None = None
        self.unsupported = False  # the replica answered UNIMPLEMENTED: a Decode call per request

    def open(self, request: decode_pb2.DecodeRequest, trace_context: dict | None = None):
        """-> a ManyStream (or, on a replica without DecodeMany, the request's own Decode call)."""
        md = tuple((trace_context or {}).items())

        def own_call():
            if not self.unsupported:
                log.warning("decode replica %s has no DecodeMany: a Decode call per request",
                            self.address)
            self.unsupported = True
            return self._stub.Decode(request, metadata=md)

        if self.unsupported:
            return own_call()
        s = self._session
        if s is None or s.broken:
            s = self._session = _Session(self._stub, self.address)
        stream = ManyStream(s, request.request_id, own_call)
        old = s.streams.get(request.request_id)
        if old is not None:  # NOTE: request ids are unique per gateway; a duplicate is a bug
            raise ValueError(f"request {request.request_id!r} already has a decode stream")
        s.streams[request.request_id] = stream
        s.start(decode_pb2.DecodeManyStart(request=request, trace_context=trace_context or {}))
        return stream

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
