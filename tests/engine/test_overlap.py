"""Overlapped decode (engine/overlap.py): the next decode step launched before the current
step's tokens are on the host. On CPU nothing overlaps in time, but the same logic runs
(async_scheduling=True), so every case compares it with the synchronous engine: the same
tokens, stops, aborts, arrivals and preemptions, no lost output and no leaked block."""
from __future__ import annotations

import pytest

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


def _run(eng: Engine, reqs, events=None, max_steps: int = 500):
    """Drive eng.step(); reqs: [(rid, prompt, params)] added up front; events: {step index:
    fn(eng)} run after that step. Returns ({rid: tokens}, {rid: finish_reason}, #outputs)."""
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
    ev = {i: (lambda e, i=i: (events[i](e) if i in events else None,
                              gaps.append(e.has_unfinished() and e._inflight is None)))
          for i in range(200)}
    got = _run(eng, reqs, ev)
    assert got == want and not any(gaps)
    _no_leak(eng)
    return eng


def _no_leak(eng: Engine):
    kv = eng.kv
    assert kv.fence == 0 and kv.num_deferred_blocks == 0
    assert kv.num_free_blocks == kv.num_blocks  # prefix-cached blocks count as free
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_same_tokens_as_synchronous():
    reqs = [(f"r{i}", p, _greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, (5, 9, 13, 20)))]
    sync = _engine(False)
    want = _run(sync, reqs)
    eng = _engine(True)
    got = _run(eng, reqs)
    assert got == want
    assert {rid: len(t) for rid, t in got[0].items()} == {"r0": 5, "r1": 9, "r2": 13, "r3": 20}
    assert eng.num_overlapped_steps > 10 and sync.num_overlapped_steps == 0
    assert eng.stats()["num_overlapped_steps"] == eng.num_overlapped_steps
    _no_leak(eng)


def test_stop_token_on_the_unseen_token():
    """A request stops on a token the host had not seen when the next step was launched: its
    blind row is dropped (no output after the stop), the others go on."""
    base = _run(_engine(False), [("a", PROMPTS[0], _greedy(12)), ("b", PROMPTS[1], _greedy(12))])[0]
    stop = base["a"][4]
    first = base["a"].index(stop)
    reqs = [("a", PROMPTS[0], _greedy(12, stop_token_ids=(stop,))), ("b", PROMPTS[1], _greedy(12))]
    want = _run(_engine(False), reqs)
    eng = _engine(True)
    got = _run(eng, reqs)
    assert got == want
    assert got[0]["a"] == base["a"][:first + 1] and got[1]["a"] == "stop"
    assert got[0]["b"] == base["b"]
    assert eng.num_overlapped_steps > 0
    _no_leak(eng)


def test_blocks_of_an_ended_request_wait_for_the_step_in_flight():
    base = _run(_engine(False), [("a", PROMPTS[0], _greedy(6))])[0]["a"]
    eng = _engine(True)
    # a stop token, not a length: the host cannot see it coming
    eng.add_request("a", PROMPTS[0], _greedy(30, stop_token_ids=(base[3],)))
    eng.add_request("b", PROMPTS[1], _greedy(30))
    while "a" in eng.requests:
        eng.step()
    # "a" ended while the next step (with its blind row) was already launched
    assert eng._inflight is not None and eng.kv.num_deferred_blocks > 0
    eng.step()
    assert eng.kv.num_deferred_blocks == 0
    _run(eng, [])
    _no_leak(eng)


def test_abort_while_a_step_is_in_flight():
    eng = _engine(True)
    aborted_at = {}

    def abort(e):
        aborted_at["n"] = len(got_before(e))
        e.abort("b")

    seen: dict[str, list[int]] = {}

    def got_before(e):
        return seen.setdefault("b", [])

    reqs = [("a", PROMPTS[0], _greedy(15)), ("b", PROMPTS[1], _greedy(15)), ("c", PROMPTS[2], _greedy(15))]
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    for i in range(100):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            seen.setdefault(o.request_id, []).extend(o.new_token_ids)
        if i == 4:
            assert eng._inflight is not None  # the abort lands between launch and readback
            abort(eng)
    assert len(seen["b"]) == aborted_at["n"] < 15  # nothing for b after its abort
    assert len(seen["a"]) == len(seen["c"]) == 15
    _no_leak(eng)


def test_arrival_and_preemption_match_synchronous():
    """A request arriving mid-generation (the overlap stops for its prefill, then resumes) and a
    cache too small for everyone (preemption and recompute)."""
    reqs = [(f"r{i}", p, _greedy(24)) for i, p in enumerate(PROMPTS[:3])]
    late = ("late", list(range(50, 70)), _greedy(10))
    add = {3: lambda e: e.add_request(*late)}
    want = _run(_engine(False, num_blocks=7), reqs, dict(add))
    eng = _engine(True, num_blocks=7)
    got = _run(eng, reqs, dict(add))
    assert got == want and len(got[0]) == 4
    assert eng.scheduler.num_preemptions > 0 and eng.num_overlapped_steps > 0
    _no_leak(eng)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0, repetition_penalty=5.0),
    dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=2.0),
    dict(temperature=0.3, top_k=3, presence_penalty=2.0, frequency_penalty=2.0),
])
def test_requests_with_penalties_run_blind(kw):
    """Penalties count the values of the tokens so far: the blind step's batch adds the one
    still on the device to its counts on the device (SamplingBatch.count_pending), so the
    steps run blind and the tokens equal the synchronous engine's (a greedy row beside, an
    arrival with penalties mid-run)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3, **kw)
    reqs = [("x", [7, 7, 8, 9] * 5, params), ("y", PROMPTS[0], _greedy(12))]
    events = {3: lambda e: e.add_request("z", [5, 6] * 9, params)}
    _same_and_never_waits(reqs, events)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.8, seed=7),
    dict(temperature=0.9, top_p=0.8, seed=11),
    dict(temperature=0.0, min_tokens=6, stop_token_ids=(5,)),
    dict(temperature=0.8, seed=5, min_tokens=4),
])
def test_seeds_and_min_tokens_run_blind(kw):
    """Seeded sampling and min_tokens bans depend on how many tokens a request has, not on
    their values: the blind step's SamplingBatch counts the one still on the device, so the
    steps run blind from the first and the tokens equal the synchronous engine's (a seeded
    request draws the same tokens whatever runs beside it)."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, **{"temperature": 0.0, **kw})
    reqs = [("x", PROMPTS[1], params), ("y", PROMPTS[0], _greedy(10))]
    events = {3: lambda e: e.add_request("z", PROMPTS[2], params)}
    _same_and_never_waits(reqs, events)


def test_unseeded_sampling_overlaps():
    eng = _engine(True)
    toks, reasons, _ = _run(eng, [("s", PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0,
                                                                    ignore_eos=True))])
    assert len(toks["s"]) == 10 and reasons["s"] == "length" and eng.num_overlapped_steps > 0
    _no_leak(eng)


def test_greedy_only_is_the_plain_argmax():
    """SamplingBatch.greedy_only (a decode graph's own argmax replaces the sampler) holds exactly
    when the sampler's tokens are the argmax of the raw logits."""
    import torch

    from engine.layers.sampler import Sampler
    from engine.layers.sampling_batch import SamplingBatch
    from engine.request import Request

    def batch(**kw):
        r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, **kw), eos_token_ids=(5,))
        return SamplingBatch.from_requests([r], 16, "cpu")

    logits = torch.randn(1, 16)
    logits[0, 5] = 10.0  # eos is the argmax: a min_tokens ban changes the token
    assert batch(temperature=0.0).greedy_only
    assert Sampler().tokens(logits, batch(temperature=0.0)).tolist() == [5]
    for kw in (dict(temperature=0.0, min_tokens=2), dict(temperature=0.0, repetition_penalty=1.2),
               dict(temperature=0.7)):
        assert not batch(**kw).greedy_only
    assert Sampler().tokens(logits, batch(temperature=0.0, min_tokens=2)).tolist() != [5]


def test_generate_leaves_nothing_in_flight():
    eng = _engine(True)
    base = _engine(False).generate([PROMPTS[0]], _greedy(8))[0]
    out = eng.generate([PROMPTS[0]], _greedy(30, stop_token_ids=(base[5],)))
    assert out == [base[:base.index(base[5]) + 1]]
    assert eng._inflight is None and not eng.has_unfinished()
    _no_leak(eng)


def test_a_step_with_prompts_in_their_last_chunk_is_followed_blindly():
    """An arrival with a free slot is admitted into the blind step itself (a mixed step: its
    whole prompt beside the decode rows, whose input tokens stay on the device); that step
    samples every row, so the next decode step (the new request's first decode included) is
    launched blind too; tokens equal the synchronous engine's."""
    reqs = [(f"r{i}", p, _greedy(12)) for i, p in enumerate(PROMPTS[:2])]
    late = ("late", list(range(50, 70)), _greedy(8))
    seen = {}

    def arrive(e):
        e.add_request(*late)

    def after(i):
        def check(e):  # the in-flight step of step i, if any: is the new request in it?
            fl = e._inflight
            seen[i] = (fl is not None and "late" in {r.request_id for r in fl.sample_reqs},
                       fl is not None and fl.sched.scheduled[-1].num_tokens)
        return check

    # step 4 completes the blind step in flight and launches the mixed step (2 decode rows +
    # the 20-token prompt) blind; step 5 follows it with a decode step
    events = {3: arrive, 4: after(4), 5: after(5)}
    want = _run(_engine(False), reqs, {3: arrive})
    eng = _engine(True)
    got = _run(eng, reqs, events)
    assert got == want
    assert seen[4] == (True, 20) and seen[5] == (True, 1)
    _no_leak(eng)


def test_the_first_step_of_whole_prompts_is_followed_blindly():
    eng = _engine(True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _greedy(6))
    eng.step()  # every prompt whole: the first decode step is already in flight
    assert eng._inflight is not None and len(eng._inflight.sample_reqs) == len(PROMPTS)
    while eng.has_unfinished():
        eng.step()
    _no_leak(eng)


def test_chunked_prompts_match_synchronous():
    """A prompt in several chunks: its earlier chunks sample nothing (those steps run
    synchronously), its last chunk's step is followed blindly; the same tokens."""
    reqs = [("a", PROMPTS[0], _greedy(10)), ("long", list(range(200, 290)), _greedy(7))]
    events = {2: lambda e: e.add_request("b", list(range(300, 341)), _greedy(5))}
    want = _run(_engine(False, max_num_batched_tokens=24), reqs, dict(events))
    eng = _engine(True, max_num_batched_tokens=24)
    got = _run(eng, reqs, dict(events))
    assert got == want and eng.num_overlapped_steps > 0
    _no_leak(eng)


def test_one_token_requests_in_a_mixed_step():
    """A prompt whose request wants one token ends in the step that prefills it: no blind step
    follows for it (max_tokens), and nothing is lost."""
    reqs = [("a", PROMPTS[1], _greedy(9))]
    events = {2: lambda e: e.add_request("one", PROMPTS[2], _greedy(1))}
    want = _run(_engine(False), reqs, dict(events))
    eng = _engine(True)
    got = _run(eng, reqs, dict(events))
    assert got == want and got[0]["one"] and len(got[0]["one"]) == 1
    _no_leak(eng)


def test_a_full_batch_with_a_queue_still_overlaps():
    """Every sequence slot taken and requests waiting: the next schedule would admit none of
    them, so decode steps still follow blindly; a waiting request joins once a slot frees
    (a request ending by length hands its slot over in the blind step). The same tokens."""
    reqs = [(f"r{i}", p, _greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, (6, 9, 4, 7)))]
    want = _run(_engine(False, max_num_seqs=2), reqs)
    eng = _engine(True, max_num_seqs=2)
    seen = []
    got = _run(eng, reqs, {i: (lambda e: seen.append((len(e.scheduler.waiting), e._inflight is not None)))
                           for i in range(40)})
    assert got == want
    assert any(w and fl for w, fl in seen)  # blind steps while requests waited
    _no_leak(eng)


def test_requests_ending_by_length_are_left_out_of_the_blind_step():
    """Requests of different max_tokens, nothing waiting: when the unseen token ends one by
    length, the blind step goes on with the others (a subset of the tokens on the device), so
    no step runs synchronously after the first; the same tokens and reasons."""
    reqs = [(f"r{i}", p, _greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, (5, 9, 13, 20)))]
    want = _run(_engine(False), reqs)
    eng = _engine(True)
    gaps = []
    got = _run(eng, reqs, {i: (lambda e: gaps.append(e.has_unfinished() and e._inflight is None))
                           for i in range(60)})
    assert got == want and not any(gaps)
    assert eng.num_overlapped_steps == 19  # every decode step after the prompts' step
    _no_leak(eng)


def test_a_length_end_with_a_queue_hands_its_slot_over_blind():
    """A request ends by length while another waits for its slot: the blind step leaves the
    ending request out and admits the waiting one in its place, as the next schedule would;
    no step after the first waits, and the tokens equal the synchronous engine's."""
    reqs = [("a", PROMPTS[0], _greedy(4)), ("b", PROMPTS[1], _greedy(12)), ("c", PROMPTS[2], _greedy(6))]
    _same_and_never_waits(reqs, {}, max_num_seqs=2)


def test_arrivals_with_a_free_slot_keep_the_overlap():
    """Requests arriving while slots are free join the blind step itself (mixed steps whose
    decode rows take their input ids from the device): no step after the first runs
    synchronously, and the tokens equal the synchronous engine's."""
    reqs = [("r0", PROMPTS[0], _greedy(20)), ("r1", PROMPTS[1], _greedy(20))]
    arrivals = {2: ("a2", PROMPTS[2], _greedy(6)), 5: ("a5", PROMPTS[3], _greedy(6)),
                13: ("a13", list(range(60, 90)), _greedy(6))}  # none while one ends by length

    def events(gaps=None):
        ev = {i: (lambda e, r=r: e.add_request(*r)) for i, r in arrivals.items()}
        if gaps is None:
            return ev
        out = {}
        for i in range(60):
            def check(e, i=i):
                if i in ev:
                    ev[i](e)
                gaps.append(e.has_unfinished() and e._inflight is None)
            out[i] = check
        return out

    want = _run(_engine(False), reqs, events())
    eng = _engine(True)
    gaps = []
    got = _run(eng, reqs, events(gaps))
    assert got == want and len(got[0]) == 5
    assert not any(gaps)  # every step launched the next one before waiting
    _no_leak(eng)


def _cached_tokens(eng: Engine, reqs, events) -> dict[str, int]:
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    cached = {}
    for i in range(200):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            cached[o.request_id] = o.num_cached_tokens
        if i in events:
            events[i](eng)
    return cached


@pytest.mark.parametrize("together", [False, True])
def test_an_arrival_in_a_blind_step_hits_the_prefix_the_step_before_computes(together):
    """A prompt sharing a 40-token prefix with a request whose prompt the step in flight
    computes: the blind step admitting it registers that step's full blocks first, so it hits
    them (32 tokens, two blocks) as after the synchronous engine's update; arriving together,
    the second waits one step for the first's blocks (in-batch sharing), in both engines."""
    prefix = list(range(400, 440))
    a = ("A", prefix + [1, 2, 3], _greedy(6))
    b = ("B", prefix + [4, 5, 6, 7], _greedy(6))
    reqs = [("r0", PROMPTS[0], _greedy(16))]
    events = ({1: lambda e: (e.add_request(*a), e.add_request(*b))} if together else
              {1: lambda e: e.add_request(*a), 2: lambda e: e.add_request(*b)})
    want = _cached_tokens(_engine(False), reqs, dict(events))
    eng = _engine(True)
    got = _cached_tokens(eng, reqs, dict(events))
    assert got == want and got["B"] == 32 and got["A"] == 0
    assert eng.num_overlapped_steps > 10
    _no_leak(eng)


def _run_lp(eng: Engine, reqs, events):
    """_run, also collecting each request's logprobs; and after each step whether the engine
    waited (nothing in flight while requests remain)."""
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    toks, lps, gaps = {}, {}, []
    for i in range(200):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs)
        if i in events:
            events[i](eng)
        gaps.append(eng.has_unfinished() and eng._inflight is None)
    return toks, lps, gaps


def test_logprobs_are_read_back_with_the_tokens():
    """Requests asking for logprobs (top 0..3, one arriving mid-run) run overlapped: the
    logprobs are computed on the device with the tokens and read back with them; tokens and
    logprobs equal the synchronous engine's, and no step after the first waits."""
    lp = lambda n, k: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=k)  # noqa: E731
    reqs = [("a", PROMPTS[0], lp(10, 3)), ("b", PROMPTS[1], _greedy(12)), ("c", PROMPTS[2], lp(8, 0))]
    events = {2: lambda e: e.add_request("late", PROMPTS[3], lp(6, 1))}
    want = _run_lp(_engine(False), reqs, dict(events))
    eng = _engine(True)
    got = _run_lp(eng, reqs, dict(events))
    assert got[0] == want[0] and not any(got[2])
    # the arrival joins one model step later with the overlap (that step was launched before
    # it came), so the rows beside it may differ by an ulp: ids exact, values close
    for rid, w in want[1].items():
        g = got[1][rid]
        assert len(g) == len(w)
        for (c, top), (wc, wtop) in zip(g, w):
            assert c == pytest.approx(wc, abs=1e-5)
            assert [t for t, _ in top] == [t for t, _ in wtop]
            assert [v for _, v in top] == pytest.approx([v for _, v in wtop], abs=1e-5)
    assert [len(got[1][r]) for r in ("a", "c", "late")] == [10, 8, 6] and not got[1]["b"]
    assert all(len(top) == 3 for _, top in got[1]["a"]) and all(top == [] for _, top in got[1]["c"])
    _no_leak(eng)


def test_a_prefill_only_request_waiting_is_scheduled_synchronously():
    """The head of the queue is prefill-only (its KV is pushed layer by layer on a prefill
    service): it is never admitted into a blind step, the next step is scheduled normally and
    it is not passed over; the same tokens as the synchronous engine."""
    from engine.overlap import blind_admissible
    from engine.request import Request

    reqs = [("r0", PROMPTS[1], _greedy(14))]

    def arrive(e):
        e.add_request("pf", PROMPTS[2], _greedy(1), prefill_only=True)
        e.add_request("after", PROMPTS[3], _greedy(5))
    events = {2: arrive}
    want = _run_lp(_engine(False), reqs, dict(events))
    eng = _engine(True)
    got = _run_lp(eng, reqs, dict(events))
    assert got[:2] == want[:2] and len(got[0]["pf"]) == 1 and len(got[0]["after"]) == 5
    assert got[2][3]  # the step after the arrival waited for its tokens
    assert eng.num_overlapped_steps > 0
    eng.kv.free("pf")  # its KV was kept for the export, as a prefill service does
    _no_leak(eng)
    r = Request("p", [1, 2], _greedy(1))
    r.prefill_only = True
    assert not blind_admissible(r) and blind_admissible(Request("q", [1, 2], _greedy(3)))


def test_a_chunked_arrival_starts_in_a_blind_step():
    """A prompt longer than the token budget arriving beside decode rows: its first chunk is
    admitted into a blind step (a row that samples nothing); the steps of its later chunks
    run synchronously; the same tokens."""
    reqs = [("a", PROMPTS[0], _greedy(12)), ("b", PROMPTS[1], _greedy(12))]
    late = ("long", list(range(200, 260)), _greedy(5))
    events = {2: lambda e: e.add_request(*late)}
    want = _run(_engine(False, max_num_batched_tokens=24), reqs, dict(events))
    eng = _engine(True, max_num_batched_tokens=24)
    partial = []

    def watch(e):
        fl = e._inflight
        if fl is not None:
            partial.extend(s.req.request_id for s in fl.sched.scheduled if not s.sample)
    got = _run(eng, reqs, {**events, 3: watch})
    assert got == want
    assert partial == ["long"]  # its first chunk rode in the blind step launched at step 3
    _no_leak(eng)


def test_the_chunks_of_a_long_prompt_run_blind():
    """A prompt of several chunks arriving beside decode rows: its first chunk rides in a
    blind step and each later chunk (with the decode rows, through the scheduler's running
    phase on the state after the step in flight) is launched blind too, so no step after
    the first runs synchronously; the same tokens as the synchronous engine."""
    reqs = [("a", PROMPTS[0], _greedy(30)), ("b", PROMPTS[1], _greedy(30))]
    late = ("long", list(range(200, 290)), _greedy(5))  # 90 tokens, budget 24: 4+ chunks
    want = _run(_engine(False, max_num_batched_tokens=24), reqs, {2: lambda e: e.add_request(*late)})
    eng = _engine(True, max_num_batched_tokens=24)
    gaps, chunks = [], []

    def watch(i):
        def check(e):
            if i == 2:
                e.add_request(*late)
            fl = e._inflight
            gaps.append(e.has_unfinished() and fl is None)
            if fl is not None:
                chunks.extend(s.num_tokens for s in fl.sched.scheduled if s.req.request_id == "long")
        return check
    got = _run(eng, reqs, {i: watch(i) for i in range(80)})
    assert got == want
    assert not any(gaps) and sum(chunks) == 90 + 4  # every chunk, then 4 decodes, blind
    _no_leak(eng)


def test_decode_rows_behind_a_prompt_chunk_take_their_tokens_at_their_positions():
    """A running prompt in chunks ahead of a decode row (admitted before it): the blind
    step's decode input sits after the chunk's tokens, so the device tokens go to those flat
    positions (token_pos), not the leading ones; the same tokens as the synchronous engine."""
    reqs = [("long", list(range(200, 290)), _greedy(6))]
    events = {0: lambda e: e.add_request("b", PROMPTS[0], _greedy(12))}
    kw = dict(max_num_batched_tokens=24, long_prefill_token_threshold=16)  # room for b beside
    want = _run(_engine(False, **kw), reqs, dict(events))
    eng = _engine(True, **kw)
    seen = []
    launch = eng.runner.launch_overlapped
    eng.runner.launch_overlapped = lambda rows, sampling, src=None, pos=None: (
        seen.append(pos), launch(rows, sampling, src, pos))[1]
    got = _run(eng, reqs, dict(events))
    assert got == want
    assert any(p is not None and p[0] > 0 for p in seen)  # a decode row behind a chunk
    _no_leak(eng)


def test_a_long_prompt_alone_runs_its_chunks_blind():
    """A prompt of several chunks with nothing else running: its chunk steps sample nothing,
    yet each next chunk is launched before the one in flight ends (no token to wait for);
    the same tokens as the synchronous engine, and no step after the first waits."""
    reqs = [("long", list(range(200, 290)), _greedy(6))]
    eng = _same_and_never_waits(reqs, {}, max_num_batched_tokens=24)
    assert eng.num_overlapped_steps == eng.num_steps - 1  # every step but the first launched ahead


@pytest.mark.parametrize("num_blocks", [4, 5, 64])
def test_a_busy_queue_with_length_ends_and_few_blocks(num_blocks):
    """Many requests of varied lengths through 3 slots, arrivals every few steps, and (with 4
    or 5 blocks) too few blocks for everyone: slots handed over blind, waits for blocks, a
    preemption (4 blocks). Every request ends with all its tokens, nothing leaks, and the
    tokens equal the synchronous engine's."""
    reqs = [(f"q{i}", PROMPTS[i % 4][: 3 + 5 * (i % 5)] or [1], _greedy(3 + (7 * i) % 11))
            for i in range(10)]
    late = {2 * i: (lambda e, i=i: e.add_request(f"late{i}", [20 + i] * (4 + 3 * i), _greedy(5 + i)))
            for i in range(6)}
    want = _run(_engine(False, num_blocks=num_blocks, max_num_seqs=3), reqs, dict(late))
    eng = _engine(True, num_blocks=num_blocks, max_num_seqs=3)
    got = _run(eng, reqs, dict(late))
    assert got[1] == want[1] and all(r == "length" for r in got[1].values()) and len(got[1]) == 16
    assert got[0] == want[0]
    assert eng.num_overlapped_steps > 0 and (num_blocks > 4 or eng.scheduler.num_preemptions > 0)
    _no_leak(eng)


def test_a_min_tokens_ban_ends_on_the_right_token_blind():
    """min_tokens=6 with a stop token the model picks at its 7th token: the ban is off for
    that token, so the request stops there; a blind step must count the token still on the
    device (a ban one token too long would change it). The same as the synchronous engine."""
    base = _run(_engine(False), [("x", PROMPTS[1], _greedy(12))])[0]["x"]
    stop = base[6]
    assert stop not in base[:6]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, min_tokens=6,
                            stop_token_ids=(stop,))
    reqs = [("x", PROMPTS[1], params), ("y", PROMPTS[0], _greedy(12))]
    want = _run(_engine(False), reqs)
    eng = _engine(True)
    got = _run(eng, reqs)
    assert got == want and got[0]["x"] == base[:7] and got[1]["x"] == "stop"
    assert eng.num_overlapped_steps > 5
    _no_leak(eng)


def test_requests_joining_with_their_kv_keep_the_overlap():
    """The decode side of disaggregated serving: a request joins the running ones with its
    prompt's KV imported into reserved blocks (Engine.add_prefilled) while steps are in
    flight: the next blind step takes it as a decode row with its first token from the host,
    no step waits, and the tokens equal the synchronous decode engine's."""
    params = _greedy(10)

    def prefilled(pre, dec, rid, prompt):
        dec.reserve(rid, len(prompt))
        pre.add_request(rid, prompt, params, prefill_only=True)
        first = None
        while pre.has_unfinished():
            for o in pre.step():
                first = o.new_token_ids[0]
        kv = pre.export_kv(rid)
        pre.release(rid)
        dec.import_kv(rid, kv)
        assert dec.add_prefilled(rid, prompt, first, params) is None
        return first

    def run(overlap):
        pre, dec = _engine(False), _engine(overlap)
        toks, gaps = {}, []
        toks["d0"] = [prefilled(pre, dec, "d0", PROMPTS[1])]
        for i in range(40):
            if not dec.has_unfinished():
                break
            for o in dec.step():
                toks[o.request_id] += o.new_token_ids
            if i in (1, 4, 5):
                rid = f"d{i}"
                toks[rid] = [prefilled(pre, dec, rid, PROMPTS[i % 4])]
            gaps.append(dec.has_unfinished() and dec._inflight is None)
        return toks, gaps, dec

    want, _, _ = run(False)
    got, gaps, dec = run(True)
    assert got == want and all(len(t) == 10 for t in got.values()) and len(got) == 4
    assert not any(gaps) and dec.num_overlapped_steps > 10
    _no_leak(dec)


def test_recorded_step_times_are_the_step_cadence():
    """An overlapped step is launched while the one before it still runs; its recorded time
    (Engine.stats' recent_step_ms, the decode service's Load mean_step_ms that the gateway's
    admission reads as the time per token) starts when that one ended, so it matches the
    wall time per step instead of counting two steps."""
    import statistics
    import time

    eng = _engine(True)
    for i in range(4):
        eng.add_request(f"r{i}", [1 + i] * 20, _greedy(80))
    eng.step()
    eng.step()
    eng.runner.step_times.clear()
    t = time.perf_counter()
    for _ in range(50):
        eng.step()
    wall = (time.perf_counter() - t) / 50
    rec = statistics.median(eng.runner.step_times)
    assert 0.5 * wall < rec < 1.5 * wall, (rec, wall)  # launch-to-done gave ~2x
    while eng.has_unfinished():
        eng.step()
    _no_leak(eng)
