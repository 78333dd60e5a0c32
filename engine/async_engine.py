"""AsyncEngine: runs an Engine on its own thread; asyncio code talks to it through a command
queue and per-request output queues. The event loop never runs the model.

NOTE: every Engine method is called on the engine thread only (commands run between steps),
so Engine itself needs no locks.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
import weakref
from typing import AsyncIterator, Callable, TypeVar

from engine.async_kv import AsyncKVMixin
from engine.async_streams import Ended, Interrupted, Registration, SinkAdapter, StreamSink, merge_queued
from engine.config import EngineConfig
from engine.engine import Engine, RequestOutput
from engine.profiling import StepProfiler
from engine.sampling_params import SamplingParams

log = logging.getLogger("splitserve.engine.async")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crash or shutdown)."""


class AsyncEngine(AsyncKVMixin):
    def __init__(self, cfg: EngineConfig | None = None, engine: Engine | None = None,
                 profiler: StepProfiler | None = None):
        self.cfg = cfg
        self.engine = engine
        self.profiler = profiler if profiler is not None else StepProfiler()  # profile()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()  # C: cheaper put / wake-up
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending: set = set()  # (loop, q) of streams whose start has not run yet
        # request id -> its stream's queue, for interrupt() on the stream's own loop (weak: a
        # stream opened and never iterated leaves nothing behind)
        self._inboxes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats: dict = {}
        # paces the steps (decode_svc.pacing.StepPacer: yield the device to a prefill that
        # shares it): delay(now, step_times) -> s, stepped(now, waited_s), stats(); engine thread
        self.pacer = None

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine on its thread (model load can take a while) and start the loop."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()

        def boot():
            try:
                if self.engine is None:
                    self.engine = Engine(self.cfg)
                self._stats = self._snapshot()
                loop.call_soon_threadsafe(_set_result, ready, None)
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                loop.call_soon_threadsafe(_set_exception, ready, e)
                return
            self._run()

        self._thread = threading.Thread(target=boot, name="engine", daemon=True)
        self._thread.start()
        await ready

    async def stop(self) -> None:
        self._stopping = True
        self._cmds.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def info(self) -> dict:
        return self.engine.info()

    def stats(self) -> dict:
        """Last stats snapshot (refreshed by the engine thread after every step)."""
        return dict(self._stats)

    @property
    def dead(self) -> BaseException | None:
        """What crashed the engine thread (None while it runs)."""
        return self._dead

    # ---- requests -------------------------------------------------------------------
    async def profile(self, steps: int, path: str, timeout_s: float = 60.0) -> dict:
        """torch.profiler over the next `steps` engine steps, as a Chrome trace at `path`
        (fewer steps if timeout_s passes first) -> {"path", "steps", "wall_s"}."""
        self._check_alive()
        fut = self.profiler.request(steps, path, timeout_s)
        # NOTE: the engine thread answers within timeout_s plus one step and the export
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s + 120)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._cmds.put((fn, loop, fut))
        return await fut

    def generate(self, request_id: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, prefill_only: bool = False, merge: bool = False
                 ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; leaving the iterator early aborts it. An error of
        add_request (e.g. InvalidRequestError) is raised by the first iteration. merge: the
        outputs that queued while the reader was busy come as one (tokens concatenated)."""
        rid = request_id or uuid.uuid4().hex
        return self._open(rid, self._start_request(rid, prompt_token_ids, params, prefill_only),
                          params, merge)

    @staticmethod
    def _start_request(rid: str, prompt_token_ids: list[int], params: SamplingParams,
                       prefill_only: bool = False):
        def start(e):
            e.add_request(rid, prompt_token_ids, params, prefill_only)
        return start

    @staticmethod
    def _start_prefilled(rid: str, prompt_token_ids: list[int], first_token_id: int,
                         params: SamplingParams):
        def start(e):
            try:
                return e.add_prefilled(rid, prompt_token_ids, first_token_id, params)
            except BaseException:
                e.release(rid)
                raise
        return start

    def stream(self, request_id: str, start: Callable[[Engine], RequestOutput | None],
               merge: bool = False) -> AsyncIterator[RequestOutput]:
        """Run `start` on the engine thread (e.g. add_prefilled) and stream the request's
        outputs; start's error is raised, and an output it returns ends the stream at once."""
        return self._open(request_id, start, None, merge)

    def interrupt(self, request_id: str, value) -> bool:
        """End the open stream of `request_id` from its own event loop: after the outputs
        already queued it yields `value` and stops, aborting the request as a reader that
        leaves early does. -> False if no stream of that id is open."""
        q = self._inboxes.get(request_id)
        if q is None:
            return False
        q.put_nowait(Interrupted(value))
        return True

    def _open(self, rid: str, start: Callable[[Engine], RequestOutput | None],
              params: SamplingParams | None = None, merge: bool = False,
              release_on_error: bool = False) -> AsyncIterator[RequestOutput]:
        # NOTE: the queue is registered now, not at the first iteration, so interrupt() reaches
        # a stream that is still compiling its grammar
        q: asyncio.Queue = asyncio.Queue()
        self._inboxes[rid] = q
        return self._iterate(rid, q, start, params, merge, release_on_error)

    async def _iterate(self, rid: str, q: asyncio.Queue,
                       start: Callable[[Engine], RequestOutput | None],
                       params: SamplingParams | None, merge: bool,
                       release_on_error: bool) -> AsyncIterator[RequestOutput]:
        """The stream of `rid`: queue `start` without awaiting it (the engine thread runs it
        and steps on with no event-loop wake-up in between) and yield what reaches its queue.
        start's outcome lands there before any step output (one thread, FIFO).
        release_on_error: a grammar that fails to compile frees the request's reserved blocks."""
        try:
            if params is not None and params.guided is not None:
                await self.precompile(params)
        except BaseException:
            if self._inboxes.get(rid) is q:
                del self._inboxes[rid]
            if release_on_error:
                await self.release(rid)
            raise
        reg = Registration(self, rid, asyncio.get_running_loop(), q, start)
        try:
            reg.open()
            held = None  # an item the merge took but could not merge: the next one
            while True:
                item, held = (held, None) if held is not None else (await q.get(), None)
                if type(item) is Ended:  # start's outcome: nothing of this stream to abort
                    reg.finished = True
                    if isinstance(item.value, BaseException):
                        raise item.value
                    yield item.value
                    return
                if type(item) is Interrupted:
                    yield item.value
                    return
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                if merge:
                    item, held = merge_queued(item, q)
                yield item
                if item.finished:
                    reg.finished = True
                    return
        finally:
            # a reader that left early (cancel / disconnect) frees the request's blocks
            reg.close()

    async def stream_into(self, request_id: str, sink: StreamSink, prompt_token_ids: list[int],
                          params: SamplingParams, first_token_id: int | None = None) -> Registration:
        """The stream of a request as calls of `sink` on this loop, in the step's one wake-up
        (no task per request a step): generate the prompt, or with first_token_id join it on
        its reserved blocks (add_prefilled; they are freed if that fails). -> the stream's
        Registration: close() it when done (an unfinished request is then aborted)."""
        start = (self._start_prefilled(request_id, prompt_token_ids, first_token_id, params)
                 if first_token_id is not None else
                 self._start_request(request_id, prompt_token_ids, params))
        adapter = SinkAdapter(sink)
        self._inboxes[request_id] = adapter
        try:
            if params.guided is not None:
                await self.precompile(params)
        except BaseException:
            if self._inboxes.get(request_id) is adapter:
                del self._inboxes[request_id]
            if first_token_id is not None:
                await self.release(request_id)
            raise
        reg = adapter.reg = Registration(self, request_id, asyncio.get_running_loop(), adapter, start)
        try:
            reg.open()
        except BaseException:
            reg.close()
            raise
        return reg

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort(request_id))

    # ---- disaggregation: the KV pass-throughs are in engine/async_kv.py ---------
    def stream_prefilled(self, request_id: str, prompt_token_ids: list[int],
                         first_token_id: int, params: SamplingParams, merge: bool = False
                         ) -> AsyncIterator[RequestOutput]:
        """Decode side: join a request on its reserved blocks (add_prefilled) and stream its
        outputs, as `stream`. If joining fails the blocks are freed (the caller owns them)."""
        start = self._start_prefilled(request_id, prompt_token_ids, first_token_id, params)
        return self._open(request_id, start, params, merge, release_on_error=True)

    # ---- engine thread --------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine thread died: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("engine is shutting down")

    def _run_cmd(self, cmd) -> bool:
        if cmd is None:
            return False
        fn, loop, fut = cmd
        try:
            res = fn(self.engine)
            if fut is not None:
                loop.call_soon_threadsafe(_set_result, fut, res)
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting coroutine
            if fut is not None:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                log.warning("engine command failed: %r", e)
        return True

    def _run(self) -> None:
        eng = self.engine
        held = None  # when the pacer first held the coming step back
        try:
            while not self._stopping:
                pacer = self.pacer  # set by the service once it is built
                # block for work when idle, or for the rest of the pacer's hold
                now = time.perf_counter()
                wait = self._hold(pacer, now) if eng.has_unfinished() else 0.5
                if wait > 0 and held is None and pacer is not None and eng.has_unfinished():
                    held = now
                try:
                    cmd = self._cmds.get(block=wait > 0, timeout=wait if wait > 0 else None)
                    if not self._run_cmd(cmd):
                        break
                    while True:
                        if not self._run_cmd(self._cmds.get_nowait()):
                            return
                except queue.Empty:
                    pass
                self.profiler.tick()
                if eng.has_unfinished():
                    if pacer is not None:
                        now = time.perf_counter()
                        if self._hold(pacer, now) > 0:
                            continue
                        pacer.stepped(now, now - held if held is not None else 0.0)
                        held = None
                    with self.profiler.step():
                        outs = eng.step()
                    self._deliver_all(outs)
                self._stats = self._snapshot()
        except BaseException as e:  # noqa: BLE001 - every waiting stream gets the error
            log.exception("engine thread crashed")
            self._dead = e
            for loop, q in [*self._streams.values(), *self._pending]:
                loop.call_soon_threadsafe(q.put_nowait, e)

    def _hold(self, pacer, now: float | None = None) -> float:
        """Seconds the pacer holds the next step back (0 without one)."""
        if pacer is None:
            return 0.0
        runner = getattr(self.engine, "runner", None)
        return pacer.delay(time.perf_counter() if now is None else now,
                           getattr(runner, "step_times", None) or [])

    def _snapshot(self) -> dict:
        st = self.engine.stats()
        return st if self.pacer is None else {**st, **self.pacer.stats()}

    def _deliver_all(self, outs: list[RequestOutput]) -> None:
        """One wake-up of each event loop per step, not one per output (a 64-row step would
        otherwise cost the loop 64 wake-ups and the engine thread as many GIL hand-offs)."""
        by_loop: dict = {}
        for out in outs:
            s = self._streams.get(out.request_id)
            if s is not None:
                by_loop.setdefault(s[0], []).append((s[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items) -> None:
    for q, out in items:
        q.put_nowait(out)


def _set_result(fut: asyncio.Future, res) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
