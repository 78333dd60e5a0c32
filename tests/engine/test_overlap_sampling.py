"""Overlapped decode with every sampling option: greedy (the decode graph's own argmax),
unseeded and seeded sampling, min_tokens bans, penalties and logprobs, handled on the device
for a step launched before the previous step's tokens are on the host; each compared with the
synchronous engine."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from tests.engine.overlap_util import (PROMPTS, _engine, _greedy, _no_leak, _run, _run_lp,
    _same_and_never_waits)


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
