"""common/step_tally.py: a wake-up's per-token metrics written at once equal per-token writes."""
from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from common.step_tally import StepTally, observe_many

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1)


def _pair():
    ra, rb = CollectorRegistry(), CollectorRegistry()
    return (Histogram("gap_seconds", "g", buckets=BUCKETS, registry=ra),
            Histogram("gap_seconds", "g", buckets=BUCKETS, registry=rb), ra, rb)


def _samples(reg) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in reg.collect() for s in m.samples if not s.name.endswith("_created")}


def test_observe_many_equals_one_by_one_including_the_bounds_and_past_the_last():
    a, b, ra, rb = _pair()
    rng = random.Random(0)
    values = [rng.uniform(0, 0.2) for _ in range(500)] + list(BUCKETS) + [0.0, 7.0]
    for v in values:
        a.observe(v)
    observe_many(b, values)
    sa, sb = _samples(ra), _samples(rb)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert abs(sa[k] - sb[k]) < 1e-9, k


def test_observe_many_falls_back_where_the_internals_differ():
    seen = []

    class Other:
        def observe(self, v):
            seen.append(v)

    observe_many(Other(), [0.1, 0.2])
    assert seen == [0.1, 0.2]


async def test_a_wake_ups_values_land_once_at_its_end():
    reg = CollectorRegistry()
    itl = Histogram("itl_seconds", "g", buckets=BUCKETS, registry=reg)
    tokens = Counter("gen_tokens", "t", registry=reg)
    writes = []
    inc = tokens.inc
    tokens.inc = lambda n=1: (writes.append(n), inc(n))
    t = StepTally(itl, tokens)
    for i in range(64):
        t.add(None if i == 0 else 0.002, 1)
    assert reg.get_sample_value("gen_tokens_total") == 0  # not yet: the wake-up goes on
    await asyncio.sleep(0)
    assert writes == [64] and reg.get_sample_value("gen_tokens_total") == 64
    assert reg.get_sample_value("itl_seconds_count") == 63
    assert reg.get_sample_value("itl_seconds_bucket", {"le": "0.001"}) == 0
    assert reg.get_sample_value("itl_seconds_bucket", {"le": "0.005"}) == 63
    t.add(0.5, 2)  # the next wake-up: its own write
    await asyncio.sleep(0)
    assert writes == [64, 2] and reg.get_sample_value("itl_seconds_count") == 64
    assert b"itl_seconds_sum" in generate_latest(reg)


def test_without_a_loop_it_writes_at_once():
    reg = CollectorRegistry()
    t = StepTally(Histogram("h_seconds", "g", buckets=BUCKETS, registry=reg),
                  Counter("n", "t", registry=reg))
    t.add(0.003, 3)
    assert reg.get_sample_value("n_total") == 3 and reg.get_sample_value("h_seconds_count") == 1
