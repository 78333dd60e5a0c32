"""Overlapped decode (engine/overlap.py): the next step launched before the current step's
tokens are on the host. On CPU nothing overlaps in time, but the same logic runs
(async_scheduling=True), so every case compares it with the synchronous engine: the same
tokens, stops, aborts and chunked prompts, no lost output and no leaked block. Arrivals and
queues: test_overlap_admission.py; sampling options: test_overlap_sampling.py."""
from __future__ import annotations

from tests.engine.overlap_util import (PROMPTS, _engine, _greedy, _no_leak, _noting_waits, _run,
    _same_and_never_waits)


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


def test_generate_leaves_nothing_in_flight():
    eng = _engine(True)
    base = _engine(False).generate([PROMPTS[0]], _greedy(8))[0]
    out = eng.generate([PROMPTS[0]], _greedy(30, stop_token_ids=(base[5],)))
    assert out == [base[:base.index(base[5]) + 1]]
    assert eng._inflight is None and not eng.has_unfinished()
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


def test_requests_ending_by_length_are_left_out_of_the_blind_step():
    """Requests of different max_tokens, nothing waiting: when the unseen token ends one by
    length, the blind step goes on with the others (a subset of the tokens on the device), so
    no step runs synchronously after the first; the same tokens and reasons."""
    reqs = [(f"r{i}", p, _greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, (5, 9, 13, 20)))]
    want = _run(_engine(False), reqs)
    eng = _engine(True)
    gaps = []
    got = _run(eng, reqs, _noting_waits({}, gaps, 60))
    assert got == want and not any(gaps)
    assert eng.num_overlapped_steps == 19  # every decode step after the prompts' step
    _no_leak(eng)


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
    walls = []
    for _ in range(50):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    wall = statistics.median(walls)  # medians on both sides: a loaded machine's stalls skew means
    rec = statistics.median(eng.runner.step_times)
    assert 0.5 * wall < rec < 1.5 * wall, (rec, wall)  # launch-to-done gave ~2x
    while eng.has_unfinished():
        eng.step()
    _no_leak(eng)


def test_decode_only_fast_path_schedules_as_the_running_phase():
    """follow's decode-only path (FollowPlan.decode_rows) gives the rows the scheduler's running
    phase would, in order, rows ending by length in flight left out."""
    from engine.overlap import _decode_rows, plan_follow
    from engine.scheduler import SchedulerOutput

    class NoAlloc:
        def allocate(self, req, n):
            return True

    eng = _engine(True, max_num_seqs=8)
    for i, n in enumerate([3, 5, 9, 12, 20, 6]):
        eng.add_request(f"r{i}", PROMPTS[i % 4], _greedy(n))
    checked = skipped = 0
    while eng.has_unfinished():
        cur = eng._inflight
        plan = plan_follow(cur, eng.scheduler) if cur is not None else None
        if plan is not None and plan.decode_rows is not None:
            want, got = SchedulerOutput(), SchedulerOutput()
            eng.scheduler.schedule_running(want, eng.scheduler.cfg.max_num_batched_tokens,
                                           plan.remaining_of, lambda r, n: True)
            _decode_rows(got, plan, eng.scheduler, NoAlloc())
            assert [(s.req.request_id, s.num_tokens, s.sample) for s in got.scheduled] == \
                   [(s.req.request_id, s.num_tokens, s.sample) for s in want.scheduled]
            checked += 1
            skipped += any(n == 0 for _, n in plan.decode_rows)
        eng.step()
    assert checked >= 10 and skipped >= 3
    _no_leak(eng)
