"""The pieces of an AsyncEngine stream (engine/async_engine.py): its registration with the
engine thread, the items its queue carries besides outputs, the merge of outputs a slow reader
let queue up, and the sink form of a stream (a consumer called in the step's one loop wake-up
instead of a task awaiting a queue).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Protocol

from engine.request import RequestOutput

log = logging.getLogger("splitserve.engine.async")


class Ended:
    """A stream's last item from its start command: the exception it raised or the output it
    returned."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Interrupted:
    """An item a stream's own loop put in it (AsyncEngine.interrupt): yield value, then end."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def merge_queued(out: RequestOutput, q: asyncio.Queue):
    """`out` with the outputs already queued behind it merged in (a reader that fell behind
    catches up in one item) -> (output, an item taken that could not be merged, or None)."""
    if out.finished or out.finish_reason == "error":
        return out, None
    while not q.empty():
        nxt = q.get_nowait()
        if not isinstance(nxt, RequestOutput) or nxt.finish_reason == "error":
            return out, nxt
        out = dataclasses.replace(out, new_token_ids=out.new_token_ids + nxt.new_token_ids,
                                  logprobs=out.logprobs + nxt.logprobs, finished=nxt.finished,
                                  finish_reason=nxt.finish_reason)
        if out.finished:
            break
    return out, None


class Registration:
    """One stream's place in an AsyncEngine: its (loop, q) entry waits in _pending until its
    start command runs on the engine thread, then routes outputs from _streams; close() takes
    it out and, for a request left unfinished, queues its abort (after the start: FIFO)."""

    def __init__(self, ae, rid: str, loop: asyncio.AbstractEventLoop, q, start):
        self.ae, self.rid, self.entry, self.start = ae, rid, (loop, q), start
        self.added = False  # engine thread only: start left the request in the engine
        self.finished = False  # the stream's last item came (nothing left to abort)
        self.closed = False

    def open(self) -> None:
        ae = self.ae
        ae._pending.add(self.entry)
        ae._check_alive()  # NOTE: after joining _pending: a death from here on reaches q
        ae._cmds.put((self.run_start, None, None))

    def run_start(self, e) -> None:  # engine thread
        ae, (loop, q) = self.ae, self.entry
        ae._pending.discard(self.entry)
        try:
            first = self.start(e)
        except BaseException as ex:  # noqa: BLE001 - the stream's to raise
            loop.call_soon_threadsafe(q.put_nowait, Ended(ex))
            return
        if first is not None:
            loop.call_soon_threadsafe(q.put_nowait, Ended(first))
            return
        # NOTE: routed only once the engine holds the request, so a refused start never
        # takes over (or drops) the stream of another request of the same id
        ae._streams[self.rid] = self.entry
        self.added = True

    def abort(self, e) -> None:  # engine thread
        if self.added:  # a refused start holds nothing (the id may be another's)
            e.abort(self.rid)
            if self.ae._streams.get(self.rid) is self.entry:
                del self.ae._streams[self.rid]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        ae, q = self.ae, self.entry[1]
        ae._pending.discard(self.entry)
        if ae._streams.get(self.rid) is self.entry:
            del ae._streams[self.rid]
        if ae._inboxes.get(self.rid) is q:
            del ae._inboxes[self.rid]
        if not self.finished and not ae._stopping and ae._dead is None:
            ae._cmds.put((self.abort, None, None))


class StreamSink(Protocol):
    """A stream's consumer, called on its loop (no task per request a step). None may raise."""

    def output(self, out: RequestOutput) -> None: ...

    def error(self, exc: BaseException) -> None: ...

    def interrupted(self, value) -> None: ...


class SinkAdapter:
    """Stands where a stream's queue would: put_nowait hands each item to the sink at once."""

    def __init__(self, sink: StreamSink):
        self.sink = sink
        self.reg: Registration | None = None

    def _end(self) -> None:
        if self.reg is not None:
            self.reg.finished = True

    def put_nowait(self, item) -> None:
        try:
            t = type(item)
            if t is Ended:
                self._end()
                v = item.value
                self.sink.error(v) if isinstance(v, BaseException) else self.sink.output(v)
            elif t is Interrupted:
                self.sink.interrupted(item.value)
            elif isinstance(item, BaseException):
                self._end()
                from engine.async_engine import EngineDeadError

                self.sink.error(EngineDeadError(str(item)))
            else:
                if item.finished:
                    self._end()
                self.sink.output(item)
        except Exception:  # noqa: BLE001 - one stream's sink must not cost the step's others
            log.exception("stream sink failed")
