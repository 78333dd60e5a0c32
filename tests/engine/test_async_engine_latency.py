"""AsyncEngine's stream start is one-way: add_request is queued without a round trip (the event
loop is woken once per prefill, by its output), while its errors, early leaves and engine death
still reach the stream."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.sampling_params import InvalidRequestError, SamplingParams
from tests.tiny_engine import tiny_engine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(device="cpu")


@pytest.fixture
async def ae(engine):
    a = AsyncEngine(engine=engine)
    await a.start()
    try:
        yield a
    finally:
        await a.stop()
    assert not a._streams and not a._pending
    assert not engine.requests and engine.kv.num_free_blocks == engine.kv.num_blocks


class _Fatal:
    """A command that crashes the engine thread (it fails to unpack) once `gate` is set."""

    def __init__(self, gate: threading.Event):
        self.gate = gate

    def __iter__(self):
        self.gate.wait(10)
        raise RuntimeError("engine thread crashed")


async def _wait_free(ae, engine):
    for _ in range(200):
        if await ae.call(lambda e: e.kv.num_free_blocks == e.kv.num_blocks and not e.requests):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request's blocks were not freed")


async def test_prefill_wakes_the_loop_once(ae):
    loop = asyncio.get_running_loop()
    engine_thread = ae._thread
    wakes = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args, **kw):
        if threading.current_thread() is engine_thread:
            wakes.append(cb)
        return real(cb, *args, **kw)

    try:
        loop.call_soon_threadsafe = counting
    except AttributeError:  # a C loop (uvloop): its methods cannot be wrapped
        pytest.skip("needs a pure-Python event loop")
    try:
        outs = [o async for o in ae.generate("p", [5, 6, 7, 8], SamplingParams(max_tokens=4),
                                             prefill_only=True)]
    finally:
        del loop.call_soon_threadsafe
    assert len(outs) == 1 and outs[0].finished and len(outs[0].new_token_ids) == 1
    assert len(wakes) == 1  # the output; add_request answered nothing
    await ae.release("p")


async def test_refused_add_raises_and_leaves_the_holder_of_its_id_alone(ae, engine):
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    ref = [t async for o in ae.generate("ref", [5, 6, 7], params) for t in o.new_token_ids]
    first = ae.generate("dup", [5, 6, 7], params)
    toks = list((await first.__anext__()).new_token_ids)
    with pytest.raises(InvalidRequestError, match="already in use"):
        async for _ in ae.generate("dup", [9, 9, 9], params):
            pass
    async for o in first:  # still streams to its end: the refusal neither aborted nor took it
        toks += o.new_token_ids
    assert toks == ref and o.finished
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        async for _ in ae.generate("bad", [10 ** 9], params):
            pass


async def test_a_consumer_that_leaves_before_the_add_ran_still_frees_it(ae, engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    gate = threading.Event()
    ae._cmds.put((lambda e: gate.wait(10), None, None))  # the engine thread is busy
    task = asyncio.ensure_future(ae.generate("early", list(range(3, 40)), params).__anext__())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await _wait_free(ae, engine)


async def test_stream_start_output_and_error_end_the_stream(ae):
    def done(e):
        return "finished-at-once"

    assert [o async for o in ae.stream("s1", done)] == ["finished-at-once"]

    def refuse(e):
        raise InvalidRequestError("no such reservation")

    with pytest.raises(InvalidRequestError, match="no such reservation"):
        async for _ in ae.stream("s2", refuse):
            pass
    assert not ae._streams and not ae._pending


async def test_engine_death_before_the_add_runs_reaches_the_stream(engine):
    ae = AsyncEngine(engine=engine)
    await ae.start()
    gate = threading.Event()

    try:
        ae._cmds.put(_Fatal(gate))
        task = asyncio.ensure_future(ae.generate("d", [5, 6, 7], SamplingParams()).__anext__())
        await asyncio.sleep(0.05)  # its add is queued behind the crash
        gate.set()
        with pytest.raises(EngineDeadError, match="crashed"):
            await asyncio.wait_for(task, 10)
        with pytest.raises(EngineDeadError):
            async for _ in ae.generate("d2", [5, 6, 7], SamplingParams()):
                pass
    finally:
        await ae.stop()
    assert not engine.requests


class _Sink:
    """Records what AsyncEngine.stream_into hands it."""

    def __init__(self):
        self.outs, self.errors, self.interrupts = [], [], []
        self.ended = asyncio.Event()

    def output(self, out):
        self.outs.append(out)
        if out.finished:
            self.ended.set()

    def error(self, exc):
        self.errors.append(exc)
        self.ended.set()

    def interrupted(self, value):
        self.interrupts.append(value)
        self.ended.set()


async def test_sink_streams_get_outputs_refusals_and_interrupts(ae, engine):
    ok = _Sink()
    reg = await ae.stream_into("k1", ok, [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    await asyncio.wait_for(ok.ended.wait(), 10)
    reg.close()
    assert sum(len(o.new_token_ids) for o in ok.outs) == 6 and reg.finished and not ok.errors

    bad = _Sink()  # a prefilled join with nothing reserved is refused, and says so
    reg = await ae.stream_into("k2", bad, [5, 6, 7], SamplingParams(max_tokens=6), first_token_id=9)
    await asyncio.wait_for(bad.ended.wait(), 10)
    reg.close()
    assert len(bad.errors) == 1 and not bad.outs

    cut = _Sink()  # an interrupt reaches the sink; closing the unfinished stream aborts it
    reg = await ae.stream_into("k3", cut, [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    while not cut.outs:
        await asyncio.sleep(0.005)
    assert ae.interrupt("k3", "stop")
    await asyncio.wait_for(cut.ended.wait(), 10)
    assert cut.interrupts == ["stop"] and not reg.finished
    reg.close()
    await _wait_free(ae, engine)


async def test_engine_death_reaches_a_sink(engine):
    ae = AsyncEngine(engine=engine)
    await ae.start()
    gate = threading.Event()

    sink = _Sink()
    try:
        ae._cmds.put(_Fatal(gate))
        reg = await ae.stream_into("d", sink, [5, 6, 7], SamplingParams())
        gate.set()
        await asyncio.wait_for(sink.ended.wait(), 10)
        assert len(sink.errors) == 1 and isinstance(sink.errors[0], EngineDeadError)
        reg.close()
    finally:
        await ae.stop()
    assert not engine.requests
