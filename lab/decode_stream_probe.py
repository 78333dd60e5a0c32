"""What decode's event loop spends a request a step: a real AsyncEngine around a fake Engine
that steps ROWS requests every STEP ms (no model), and ROWS consumers of the decode service's
own per-request stream (StreamingMixin._stream) shaped like DecodeMany's run_one (each message
wrapped in a DecodeManyItem; batched: DecodeMany's emit and writer, decode_svc/many.py),
all on one uvloop loop.

    python -m lab.decode_stream_probe [--rows 64] [--step-ms 2] [--tokens 256] [--rounds 3]
        [--mode stream|batched]   (stream: _stream, a task per request; batched: _stream_batched)

Reports per round: steps/s reached vs the fake engine's pace, the loop thread's CPU time per
request-step (us), and the share of steps whose outputs a stream merged (it fell behind).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from common.metrics import get_metrics
from common.outbox import Outbox
from decode_svc.many import _batch
from decode_svc.streaming import StreamingMixin
from engine.async_engine import AsyncEngine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from protos import decode_pb2


class FakeEngine:
    """Steps every request it holds once per step_s (a sleep stands for the GPU)."""

    tokenizer = None

    def __init__(self, step_s: float, max_tokens: int):
        self.step_s, self.max_tokens = step_s, max_tokens
        self.reqs: dict[str, int] = {}
        self.steps = 0

    def add_prefilled(self, rid, prompt, first, params):
        self.reqs[rid] = 1

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        self.steps += 1
        outs = []
        for rid in list(self.reqs):
            n = self.reqs[rid] = self.reqs[rid] + 1
            done = n >= self.max_tokens
            outs.append(RequestOutput(rid, [n % 1000], finished=done,
                                      finish_reason="length" if done else None))
            if done:
                del self.reqs[rid]
        return outs

    def abort(self, rid):
        self.reqs.pop(rid, None)

    def release(self, rid):
        self.reqs.pop(rid, None)

    def stats(self) -> dict:
        return {}


class Streams(StreamingMixin):
    def __init__(self, engine):
        self.engine, self.metrics = engine, get_metrics("decode", "probe")
        self._running, self._tpot_budgets, self._callers, self._generated = {}, {}, {}, 0


async def one_round(rows: int, step_ms: float, tokens: int, mode: str = "stream") -> dict:
    fake = FakeEngine(step_ms / 1e3, tokens)
    eng = AsyncEngine(engine=fake)
    await eng.start()
    svc = Streams(eng)
    # batched: DecodeMany's own outbox; stream: a queue, as its run_one tasks had
    out = Outbox(asyncio.get_running_loop()) if mode == "batched" else asyncio.Queue()
    put = out.put if mode == "batched" else out.put_nowait
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    msgs = [0]

    async def run_one(i: int):
        rid = f"r{i}"
        req = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2, 3], first_token_id=7)
        if mode == "batched":
            await svc._stream_batched(rid, req, params, 0.0, lambda msg: put((rid, msg)))
        else:
            async for resp in svc._stream(rid, req, params, 0.0):
                put(decode_pb2.DecodeManyItem(request_id=rid, response=resp))
        put(None)

    async def writer():
        ended = 0
        while ended < rows:
            if mode == "batched":
                items = await out.take()
            else:
                items = [await out.get()]
                while not out.empty():
                    items.append(out.get_nowait())
            ended += sum(1 for x in items if x is None)
            batch = _batch(items)  # DecodeMany's own writer
            if batch is not None:
                batch.SerializeToString()
                msgs[0] += len(batch.items)

    loop_tid = threading.get_native_id()
    t0, c0 = time.perf_counter(), time.thread_time()
    await asyncio.gather(writer(), *(run_one(i) for i in range(rows)))
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    steps = fake.steps
    await eng.stop()
    row_steps = rows * (tokens - 1)
    return {"steps_per_s": steps / wall, "pace_per_s": 1e3 / step_ms,
            "loop_us_per_row_step": cpu / row_steps * 1e6, "loop_busy": cpu / wall,
            "merged_share": 1 - msgs[0] / row_steps, "tid": loop_tid}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.decode_stream_probe")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", choices=("stream", "batched"), default="stream")
    a = p.parse_args(argv)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    res = [run(one_round(a.rows, a.step_ms, a.tokens, a.mode)) for _ in range(a.rounds)]
    for r in res:
        print(f"steps/s {r['steps_per_s']:.0f} (pace {r['pace_per_s']:.0f})  loop us/row-step "
              f"{r['loop_us_per_row_step']:.1f}  loop busy {r['loop_busy']:.0%}  merged {r['merged_share']:.0%}")
    print(f"median loop us/row-step {statistics.median(r['loop_us_per_row_step'] for r in res):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
