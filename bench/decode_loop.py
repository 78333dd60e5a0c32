"""Where a decode step's wall time goes outside the GPU kernels: the serving loop's host work.

    python -m bench.decode_loop [--cases llama-3.1-8b:1:1024,llama-3.2-1b:1:1024] [--steps 48]

Per case (random bf16 weights of the shape, CUDA graphs on), all times per decode step:
  replay_ms     graph replay alone (inputs staged and uploaded beforehand), CUDA events
  run_rows_ms   staging on the host + one upload + replay, CUDA events around each step: what
                bench.engine_gpu reports as the decode step (the GPU waits while the host stages)
  pipelined_ms  run_rows called `--steps` times back to back, one sync at the end: the host
                stages step i+1 while the GPU runs step i
  stage_us      host time of the staging alone (numpy into the pinned mirror)
  sync_engine_ms  Engine.step() in a real generation (`batch` requests of `ctx` prompt tokens,
                greedy, ignore_eos) with overlapped decode off: the serving loop's time per
                decode step (TPOT), with its phases' host time (sync_*_us): schedule, sampling
                batch, runner.execute (stage + upload + replay + sampler, whose token copy
                waits for the GPU), of which run_rows and sample_launch, scheduler update
  engine_ms     the same with overlapped decode (engine/overlap.py, the default on CUDA):
                the next step launched before this step's tokens are read back
Prints a table and writes bench/results/decode_loop-*.json.
"""
from __future__ import annotations

import argparse
import functools
import gc
import logging
import statistics
import time

import torch

from bench.common import print_table, write_result
from bench.engine_gpu_steps import decode_inputs, make_engine, rows_of
from bench.timing import cuda_time_ms, host_time_s
from engine.sampling_params import SamplingParams


def _host_us(fn, iters: int = 200) -> float:
    return host_time_s(fn, iters, warmup=10) * 1e6


def _graph_rows(eng, batch: int, ctx: int) -> dict:
    r = eng.runner
    g = r.graphs
    ids, _, meta = decode_inputs(eng, batch, ctx)
    rows = rows_of(ids, meta, ctx)
    for _ in range(30):
        g.run_rows(rows)
    out = {"run_rows_ms": cuda_time_ms(lambda: g.run_rows(rows), iters=50)}
    b = g.bucket_for(batch)
    g.staging.stage(rows, g.block_size, b, b)
    g.staging.upload(b)
    out["replay_ms"] = cuda_time_ms(g.graphs[b].replay, iters=50)
    n = 20
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        g.run_rows(rows)
    torch.cuda.synchronize()
    out["pipelined_ms"] = (time.perf_counter() - t) * 1e3 / n
    out["stage_us"] = _host_us(lambda: g.staging.stage(rows, g.block_size, b, b))
    return out


class _Phases:
    """Host time per call of a few engine methods, wrapped in place for one generation."""

    def __init__(self):
        self.t: dict[str, list[float]] = {}
        self._undo = []

    def wrap(self, obj, attr: str, name: str):
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t.setdefault(name, []).append(time.perf_counter() - t)
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, fn))

    def restore(self):
        for obj, attr, fn in reversed(self._undo):
            setattr(obj, attr, fn)


def _engine_loop(eng, batch: int, ctx: int, steps: int, tag: str = "loop") -> dict:
    """A real generation through Engine.step(): per decode step wall time and phases."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, eng.arch.vocab_size, (ctx,), generator=gen).tolist()
        eng.add_request(f"{tag}{i}", prompt, params)
    while not all(eng.requests[f"{tag}{i}"].output_token_ids for i in range(batch)):
        eng.step()  # the prompts (prefill); each request holds its first token after it
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ph = _Phases()
    ph.wrap(eng.scheduler, "schedule", "schedule")
    ph.wrap(eng.runner, "sampling_batch", "sampling_batch")
    ph.wrap(eng.runner, "execute", "execute")
    if eng.runner.graphs is not None:
        ph.wrap(eng.runner.graphs, "run_rows", "run_rows")
    ph.wrap(eng.runner.sampler, "tokens", "sample_launch")
    ph.wrap(eng.scheduler, "update", "update")
    walls = []
    try:
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t)
    finally:
        ph.restore()
    skip = min(4, len(walls) // 4)  # the first steps settle (allocator, clocks)
    out = {"engine_ms": statistics.median(walls[skip:]) * 1e3, "engine_steps": len(walls)}
    for name, ts in ph.t.items():
        out[f"{name}_us"] = round(statistics.median(ts[skip:] or ts) * 1e6, 1)
    return out


def arrivals_loop(eng, batch: int, ctx: int, steps: int, every: int = 8, prompt_len: int = 128,
                  tag: str = "arr") -> dict:
    """Continuous batching in a steady state: `batch` requests decode, one of them ends (by
    length) every `every` steps and a new request with a prompt_len-token prompt (at most
    ctx tokens, so it fits wherever the first prompts did) takes its
    place, so about one step in `every` is mixed (a prompt beside the decode rows). Over
    `steps` Engine.step() calls after the first prompts: wall ms per step, generated tokens
    per second, and how many steps were mixed (scheduled, or launched blind with the
    arrival admitted into them) and how many were launched blind."""
    gen = torch.Generator().manual_seed(1)
    vocab = eng.arch.vocab_size
    prompt_len = min(prompt_len, ctx)
    live: set[str] = set()
    count = 0

    def add(n_prompt: int, max_tokens: int) -> None:
        nonlocal count
        rid = f"{tag}{count}"
        count += 1
        eng.add_request(rid, torch.randint(0, vocab, (n_prompt,), generator=gen).tolist(),
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        live.add(rid)

    def replace_finished(outputs) -> int:
        n = 0
        for o in outputs:
            n += len(o.new_token_ids)
            if o.finished:
                live.discard(o.request_id)
                add(prompt_len, every * batch)  # it ends in turn, `batch` arrivals later
        return n

    for i in range(batch):  # staggered lengths: one request ends every `every` steps
        add(ctx, every * (i + 1))
    # Until every live request holds its first token. With many long prompts the first ones
    # can end (by length) while later ones are still in prefill: those are replaced already.
    while not all(eng.requests[r].output_token_ids for r in live):
        replace_finished(eng.step())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    blind0, tokens, mixed = eng.num_overlapped_steps, 0, 0
    runner = eng.runner
    launches = {name: getattr(runner, name) for name in ("execute", "launch_overlapped")}

    def counted(fn):
        def run(rows, *a, **kw):  # every model step, scheduled or launched blind
            nonlocal mixed
            mixed += any(len(r.token_ids) > 1 for r in rows)
            return fn(rows, *a, **kw)
        return run

    for name, fn in launches.items():
        setattr(runner, name, counted(fn))
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            tokens += replace_finished(eng.step())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        for name, fn in launches.items():
            setattr(runner, name, fn)
        for rid in list(live):
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
    return {"arr_ms": wall / steps * 1e3, "arr_tok_s": tokens / wall, "arr_mixed": mixed,
            "arr_blind": eng.num_overlapped_steps - blind0}


def both_loops(eng, batch: int, ctx: int, steps: int, tag: str = "",
               arrivals: bool = False) -> dict[str, dict]:
    """_engine_loop (and with arrivals, arrivals_loop) with overlapped decode off ("sync")
    then on ("overlap"); the engine's switch is restored after."""
    overlap = eng.overlap
    out = {}
    try:
        for name, on in (("sync", False), ("overlap", True)):
            eng.overlap = on
            out[name] = _engine_loop(eng, batch, ctx, steps, tag=f"{tag}{name}")
            if arrivals:
                out[name].update(arrivals_loop(eng, batch, ctx, steps, tag=f"{tag}{name}a"))
    finally:
        eng.overlap = overlap
    return out


@torch.inference_mode()
def run_case(shape: str, batch: int, ctx: int, steps: int, arrivals: bool = False) -> dict:
    eng = make_engine(shape, batch, ctx + steps + 32, eager=False,
                      num_blocks=batch * (-(-(ctx + steps + 32) // 16)) + 8)
    try:
        row = {"case": f"{shape} b={batch} ctx={ctx}"}
        row.update(_graph_rows(eng, batch, ctx))
        loops = both_loops(eng, batch, ctx, steps, arrivals=arrivals)
        row.update({f"sync_{k}": v for k, v in loops["sync"].items()})
        row.update(loops["overlap"])
        row["overlapped_steps"] = eng.num_overlapped_steps
        row["host_share"] = round(1 - row["replay_ms"] / row["sync_engine_ms"], 3)
        row["overlap_gain"] = round(1 - row["engine_ms"] / row["sync_engine_ms"], 3)
        if arrivals:
            row["arr_gain"] = round(row["arr_tok_s"] / row["sync_arr_tok_s"] - 1, 3)
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
    finally:
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama-3.1-8b:1:1024,llama-3.2-1b:1:1024")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--arrivals", action="store_true",
                    help="also a steady state with arrivals (arrivals_loop): one request ends and a "
                         "128-token prompt arrives every 8 steps, sync vs overlapped")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for spec in a.cases.split(","):
        shape, b, c = spec.split(":")
        rows.append(run_case(shape, int(b), int(c), a.steps, a.arrivals))
        print(rows[-1], flush=True)
    cols = ["case", "replay_ms", "run_rows_ms", "pipelined_ms", "stage_us", "sync_engine_ms",
            "engine_ms", "overlap_gain", "host_share", "sync_execute_us", "sync_run_rows_us",
            "sync_sample_launch_us", "schedule_us", "update_us"]
    if a.arrivals:
        cols += ["sync_arr_ms", "arr_ms", "sync_arr_tok_s", "arr_tok_s", "arr_gain", "arr_mixed", "arr_blind"]
    print_table(rows, cols)
    print("wrote", write_result("decode_loop", {"cases": a.cases, "steps": a.steps, "dtype": "bf16",
                                                "arrivals": a.arrivals},
                                {"rows": rows}))


if __name__ == "__main__":
    main()
