"""decode_svc.streaming._coalesce: outputs queued behind one are merged into one message, in
order, up to a finished one; anything else (an abort marker, an error) is handed back."""
from __future__ import annotations

import asyncio

from decode_svc.streaming import _coalesce
from engine.request import RequestOutput


def _q(*items):
    q = asyncio.Queue()
    for x in items:
        q.put_nowait(x)
    return q


def test_merges_in_order_and_stops_at_the_finished_one():
    q = _q(RequestOutput("r", [2], logprobs=[-0.2]), RequestOutput("r", [3], True, "length", logprobs=[-0.3]),
           RequestOutput("r", [9]))
    out, held = _coalesce(RequestOutput("r", [1], logprobs=[-0.1]), q)
    assert out.new_token_ids == [1, 2, 3] and out.logprobs == [-0.1, -0.2, -0.3]
    assert out.finished and out.finish_reason == "length" and held is None
    assert q.qsize() == 1


def test_hands_back_what_it_cannot_merge():
    marker = object()
    q = _q(RequestOutput("r", [2]), marker, RequestOutput("r", [3]))
    out, held = _coalesce(RequestOutput("r", [1]), q)
    assert out.new_token_ids == [1, 2] and held is marker and q.qsize() == 1
    err = RequestOutput("r", [], True, "error", error="boom")
    assert _coalesce(err, _q(RequestOutput("r", [1]))) == (err, None)
