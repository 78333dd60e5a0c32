"""Is the decode service's steady inter-token gap set by AsyncEngine's threading (the engine on
its own thread, outputs delivered to an event loop under one GIL) or by what the service adds
on top? One process, one engine, the same load three ways, interleaved by round:

  raw     bench.pd_clients.run_engine (bench.pd_system's "engine alone"), run between the
          engine thread's steps
  async   AsyncEngine: the engine thread steps, each request's outputs reach an asyncio
          (uvloop when installed) sink through stream_into (decode_svc's path), sink a no-op
  async+w the same, the sink doing W microseconds of Python per output (busy loop; the
          decode service's per request-step work is a few microseconds on CPU)

ROWS requests of PROMPT tokens, MAX_TOKENS out each, all at once; the figure is the median gap
between a request's tokens after every request has its first (the steady decode step).

    python -m lab.async_decode_probe [--rows 64] [--prompt-len 512] [--max-tokens 128]
        [--rounds 3] [--work-us 4] [--fake-device-ms MS]
        [engine flags, default --model dummy:tiny-llama --device cpu]

--fake-device-ms (CPU): each decode step's forward is replaced by its first result and a
sleep of MS (the GIL released, as while a GPU runs a step): what the loop's work costs the
engine thread when it is not hidden behind compute of its own.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time


def steady_gap_ms(events: dict[str, list[float]]) -> float:
    """Median gap between consecutive tokens of a request, after the last first token."""
    t_all = max(ev[0] for ev in events.values())
    gaps = [b - a for ev in events.values() for a, b in zip(ev, ev[1:]) if a >= t_all]
    return statistics.median(gaps) * 1e3 if gaps else float("nan")


def run_raw(eng, prompts, max_tokens: int) -> dict[str, list[float]]:
    """bench.pd_clients.run_engine's token arrival times, by request."""
    from bench.pd_clients import run_engine

    return {str(i): [t for t, _ in tr.events]
            for i, tr in enumerate(run_engine(eng, prompts, max_tokens))}


class _Sink:
    def __init__(self, ev: list[float], done: asyncio.Future, work_s: float):
        self.ev, self.done, self.work_s = ev, done, work_s

    def output(self, out) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            self.ev.append(now)
        if self.work_s:
            end = now + self.work_s
            while time.perf_counter() < end:
                pass
        if out.finished and not self.done.done():
            self.done.set_result(None)

    def error(self, exc) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def interrupted(self, value) -> None:
        self.error(RuntimeError("interrupted"))


async def run_async(ae, prompts, params, work_s: float) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    ev: dict[str, list[float]] = {}
    regs, dones = [], []
    for i, p in enumerate(prompts):
        rid = f"as{i}-{time.monotonic_ns()}"
        ev[rid] = []
        done = loop.create_future()
        dones.append(done)
        regs.append(await ae.stream_into(rid, _Sink(ev[rid], done, work_s), p, params))
    try:
        await asyncio.gather(*dones)
    finally:
        for r in regs:
            r.close()
    return ev


def fake_device(runner, sleep_s: float) -> None:
    """Decode-only forwards: the real one's logits once per batch size, then a sleep."""
    real, seen = runner._eager_logits, {}

    def fake(rows, token_src=None, token_pos=None):
        if not all(len(r.token_ids) == 1 for r in rows):
            return real(rows, token_src, token_pos)
        if len(rows) not in seen:
            seen[len(rows)] = real(rows, token_src, token_pos)
        time.sleep(sleep_s)
        return seen[len(rows)]

    runner._eager_logits = fake


def main(argv=None) -> int:
    from common.service_args import add_engine_args, engine_config_from_args
    from engine.async_engine import AsyncEngine
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work-us", type=float, default=4.0)
    ap.add_argument("--fake-device-ms", type=float, default=0.0)
    add_engine_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--model" not in argv:
        argv += ["--model", "dummy:tiny-llama"]
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    a = ap.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    eng = Engine(engine_config_from_args(a))
    if a.fake_device_ms:
        fake_device(eng.runner, a.fake_device_ms / 1e3)
    vocab = eng.arch.vocab_size
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)

    def prompts():
        return [[rng.randrange(1, vocab) for _ in range(a.prompt_len)] for _ in range(a.rows)]

    run_raw(eng, prompts()[:4], a.max_tokens)  # warm-up
    res: dict[str, list[float]] = {"raw": [], "async": [], f"async+{a.work_us:g}us": []}
    ae = AsyncEngine(engine=eng)

    async def async_rounds():
        await ae.start()
        try:
            for r in range(a.rounds):
                # the raw case runs on the engine thread (commands run between steps)
                res["raw"].append(steady_gap_ms(await ae.call(lambda e: run_raw(e, prompts(), a.max_tokens))))
                res["async"].append(steady_gap_ms(await run_async(ae, prompts(), params, 0.0)))
                res[f"async+{a.work_us:g}us"].append(steady_gap_ms(
                    await run_async(ae, prompts(), params, a.work_us * 1e-6)))
                print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in res.items()),
                      flush=True)
        finally:
            await ae.stop()

    asyncio.run(async_rounds())
    print(f"steady inter-token gap, ms (median of {a.rounds} rounds), {a.rows} rows x "
          f"{a.prompt_len} in x {a.max_tokens} out, {a.model} on {a.device}:")
    for k, v in res.items():
        print(f"  {k:<14} {statistics.median(v):8.3f}   rounds {' '.join(f'{x:.3f}' for x in v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
