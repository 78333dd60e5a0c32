"""The Decode stream of one request, in two forms over one StreamState (stream_state.py):
- `_stream`: an async generator reading the engine's stream directly (outputs that queued up
  while the reader was busy come merged into one message); the Decode RPC's form;
- `_stream_batched`: the engine calls the stream's sink on the loop in the step's one wake-up
  and each message goes to `emit` at once, with no task woken per request a step; DecodeMany's
  form (its writer sends a step's messages as one batch).
Abort, another RPC, ends either at once through AsyncEngine.interrupt.
DecodeServicer (decode_svc/servicer.py) inherits it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import grpc

from common.step_tally import StepTally
from decode_svc.stream_state import StreamAbort, StreamState
from engine.sampling_params import InvalidRequestError

log = logging.getLogger("splitserve.decode")

_Abort = StreamAbort
_ABORTED = object()


class StreamingMixin:
    """Needs engine (AsyncEngine), metrics, _running, _tpot_budgets, _callers and _generated
    (DecodeServicer)."""

    @functools.cached_property
    def step_tally(self) -> StepTally:
        """The streams' per-token metrics, written once a loop wake-up (common/step_tally.py)."""
        return StepTally(self.metrics.itl, self.metrics.generation_tokens)

    async def _stream(self, rid, request, params, wait_ms, here: bool = False):
        """Yield DecodeResponses. here: the prompt runs in this engine (prefill_here); else its
        KV is in place and request.first_token_id was sampled by prefill."""
        st = StreamState(self, request, params, wait_ms, here)
        outs, ended = None, False  # ended: the engine stream finished on its own
        try:
            m = st.stop_at_first()
            if m is not None:
                await self.engine.release(rid)
                yield m
                return
            # NOTE: blocks are ours since claim(); a join that fails frees them
            outs = (self.engine.generate(rid, st.prompt, params, merge=True) if here
                    else self.engine.stream_prefilled(rid, st.prompt, st.first, params, merge=True))
            self._hold(rid, outs, request)
            while True:
                try:
                    out = await outs.__anext__()
                    ended = out is not _ABORTED and out.finished
                except StopAsyncIteration:
                    ended = True
                    raise RuntimeError("engine stream ended without a finished output") from None
                except InvalidRequestError as e:
                    ended, st.outcome = True, "error"
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                except Exception as e:  # noqa: BLE001 - the engine's failure, this request's error
                    ended, st.outcome = True, "error"
                    raise RuntimeError(str(e)) from e
                if out is _ABORTED:
                    yield st.aborted()
                    return
                msg, done = st.on_output(out)
                yield msg
                if done:
                    return
        finally:
            if outs is not None:
                self._unhold(rid, outs)
                if not ended:
                    # NOTE: closing an engine stream that has not finished aborts the request
                    # (a stop string, an Abort, a cancel); its abort runs after its start (FIFO)
                    with contextlib.suppress(Exception):
                        await outs.aclose()
                    asyncio.get_running_loop().create_task(_abort_quietly(self.engine, rid))
            st.close()

    async def _stream_batched(self, rid, request, params, wait_ms, emit, here: bool = False) -> None:
        """As _stream, each message handed to emit(msg) as it is made (a DecodeResponse, or
        `stream_state.response`'s arguments for a step's output); returns once the stream
        ended, raises _Abort / RuntimeError as _stream does."""
        st = StreamState(self, request, params, wait_ms, here)
        reg = None
        try:
            m = st.stop_at_first()
            if m is not None:
                await self.engine.release(rid)
                emit(m)
                return
            sink = _Sink(st, emit, asyncio.get_running_loop().create_future())
            # NOTE: blocks are ours since claim(); a join that fails frees them
            reg = await self.engine.stream_into(rid, sink, st.prompt, params,
                                                None if here else st.first)
            self._hold(rid, reg, request)
            await sink.done
        finally:
            if reg is not None:
                self._unhold(rid, reg)
                if not reg.finished:  # close() aborts the request (after its start: FIFO)
                    asyncio.get_running_loop().create_task(_abort_quietly(self.engine, rid))
                reg.close()
            st.close()

    async def _responses(self, rid, request, params, wait_ms, context, here: bool = False):
        """The Decode handler's stream: on a DecodeMany call (its context has emit) the
        batched form, whose messages leave through emit; else _stream's messages, yielded."""
        emit = getattr(context, "emit", None)
        if emit is not None:
            await self._stream_batched(rid, request, params, wait_ms, emit, here)
            return
        # NOTE: aclosing: a cancel that lands while we sit at `yield` still closes _stream
        async with contextlib.aclosing(self._stream(rid, request, params, wait_ms, here)) as st:
            async for resp in st:
                yield resp

    def _hold(self, rid, handle, request) -> None:
        self._running[rid] = (asyncio.current_task(), handle)
        if request.tpot_ms > 0:  # Load reports the tightest (LoadStats.min_tpot_ms)
            self._tpot_budgets[rid] = (handle, float(request.tpot_ms))
            pacer = getattr(self.engine, "pacer", None)  # decode_svc.pacing.StepPacer
            if pacer is not None:
                pacer.add_budget(rid, request.tpot_ms)

    def _unhold(self, rid, handle) -> None:
        if self._running.get(rid, (None, None))[1] is handle:
            self._running.pop(rid, None)
            self._callers.pop(rid, None)
        # NOTE: apart from _running, which an Abort empties before the stream ends
        if self._tpot_budgets.get(rid, (None, 0.0))[0] is handle:
            del self._tpot_budgets[rid]
            if getattr(self.engine, "pacer", None) is not None:
                self.engine.pacer.drop_budget(rid)


class _Sink:
    """A batched stream's consumer (engine.async_streams.StreamSink): runs in the loop's
    step wake-up; `done` resolves when the stream ends (an exception: how it failed)."""

    def __init__(self, st: StreamState, emit, done: asyncio.Future):
        self.st, self.emit, self.done = st, emit, done

    def output(self, out) -> None:
        if self.done.done():
            return
        try:
            msg, end = self.st.fields(out)
        except RuntimeError as e:
            self.done.set_exception(e)
            return
        self.emit(msg)
        if end:
            self.done.set_result(None)

    def error(self, exc: BaseException) -> None:
        if self.done.done():
            return
        self.st.outcome = "error"
        if isinstance(exc, InvalidRequestError):
            self.done.set_exception(_Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        else:
            self.done.set_exception(RuntimeError(str(exc)))

    def interrupted(self, value) -> None:
        if self.done.done():
            return
        self.emit(self.st.aborted())
        self.done.set_result(None)


async def _abort_quietly(engine, rid: str) -> None:
    try:
        await engine.abort(rid)
    except Exception:  # noqa: BLE001 - engine gone: nothing left to free
        log.debug("abort of %s failed", rid, exc_info=True)
