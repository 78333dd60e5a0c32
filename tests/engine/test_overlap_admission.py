"""Overlapped decode with arrivals and queues: requests admitted into the blind step (free
slots, slots a request ending by length hands over, prefix hits on the step in flight, the
decode service's add_prefilled), what keeps a step synchronous, preemption; each compared
with the synchronous engine."""
from __future__ import annotations

import pytest

from engine.engine import Engine
from tests.engine.overlap_util import (PROMPTS, _engine, _greedy, _no_leak, _noting_waits, _run,
    _run_lp, _same_and_never_waits)


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
        return ev if gaps is None else _noting_waits(ev, gaps, 60)

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
