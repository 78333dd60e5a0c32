"""Shared by the overlapped-decode tests (engine/overlap.py): a tiny CPU engine with the
overlap forced on or off, a driver of Engine.step() with arrival events, and the checks that
compare the overlapped engine with the synchronous one."""
from __future__ import annotations

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def _engine(overlap: bool, num_blocks: int = 64, max_num_seqs: int = 8, **sched) -> Engine:
    return Engine(EngineConfig(
        model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, async_scheduling=overlap, **sched),
        device=DeviceConfig(device="cpu")))


PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 17, list(range(100, 103))]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _run(eng: Engine, reqs, events=None, max_steps: int = 500, logprobs: dict | None = None):
    """Drive eng.step(); reqs: [(rid, prompt, params)] added up front; events: {step index:
    fn(eng)} run after that step; logprobs: a dict to collect {rid: logprobs} into. Returns
    ({rid: tokens}, {rid: finish_reason}, #outputs)."""
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    toks, reasons = {}, {}
    n_out = 0
    for i in range(max_steps):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            assert o.request_id not in reasons, f"output after the end of {o.request_id}"
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if logprobs is not None:
                logprobs.setdefault(o.request_id, []).extend(o.logprobs)
            n_out += 1
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        if events and i in events:
            events[i](eng)
    assert not eng.has_unfinished()
    return toks, reasons, n_out


def _same_and_never_waits(reqs, events, **kw):
    """Overlapped vs synchronous engine on the same requests and arrival events: the same
    tokens and reasons, no step after the first waiting for the one before, nothing leaked."""
    want = _run(_engine(False, **kw), reqs, dict(events))
    eng = _engine(True, **kw)
    gaps = []
    got = _run(eng, reqs, _noting_waits(events, gaps))
    assert got == want and not any(gaps)
    _no_leak(eng)
    return eng


def _no_leak(eng: Engine):
    kv = eng.kv
    assert kv.fence == 0 and kv.num_deferred_blocks == 0
    assert kv.num_free_blocks == kv.num_blocks  # prefix-cached blocks count as free
    assert not eng.scheduler.running and not eng.scheduler.waiting


def _noting_waits(events, gaps: list, steps: int = 200) -> dict:
    """events for _run that also append, after every step, whether the engine waited
    (nothing in flight while requests remain) to `gaps`."""
    def after(i):
        def run(e):
            if i in events:
                events[i](e)
            gaps.append(e.has_unfinished() and e._inflight is None)
        return run
    return {i: after(i) for i in range(steps)}


def _run_lp(eng: Engine, reqs, events):
    """_run, also collecting each request's logprobs; and after each step whether the engine
    waited (nothing in flight while requests remain)."""
    lps, gaps = {}, []
    toks, _, _ = _run(eng, reqs, _noting_waits(events, gaps), max_steps=200, logprobs=lps)
    return toks, lps, gaps
