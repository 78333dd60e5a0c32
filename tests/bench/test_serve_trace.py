"""bench.serve_trace: seeded, reproducible traces (lengths, prefix groups, JSONL prompts) and
open-loop arrivals (Poisson, gamma burstiness)."""
from __future__ import annotations

import json
import statistics

import pytest

from bench.serve_trace import (PRESETS, LenDist, TraceSpec, arrival_times, build_trace, describe,
                               trace_digest)


def test_len_dists_parse_sample_and_reject_nonsense():
    import random

    rng = random.Random(0)
    assert LenDist.parse("fixed:7").sample(rng) == 7 and LenDist.parse(12).sample(rng) == 12
    u = [LenDist.parse("uniform:3,5").sample(rng) for _ in range(200)]
    assert set(u) == {3, 4, 5}
    ln = [LenDist.parse("lognormal:100,0.8").sample(rng) for _ in range(4000)]
    assert 85 < statistics.median(ln) < 115 and max(ln) <= 1600 and min(ln) >= 1
    assert statistics.mean(ln) > statistics.median(ln)  # long right tail
    for bad in ("fixed", "uniform:5,3", "lognormal:100", "gauss:1,2", "fixed:-1", "uniform:a,b"):
        with pytest.raises(ValueError):
            LenDist.parse(bad)


def test_trace_is_reproducible_and_seed_dependent():
    spec = TraceSpec(num_requests=50, input_len="lognormal:64,0.7", output_len="uniform:4,32",
                     prefix_share=0.5, prefix_len=32, prefix_groups=3, seed=3)
    a, b = build_trace(spec, vocab=1000), build_trace(spec, vocab=1000)
    assert trace_digest(a) == trace_digest(b)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    other = build_trace(TraceSpec(**{**spec.__dict__, "seed": 4}), vocab=1000)
    assert trace_digest(other) != trace_digest(a)
    # a longer trace starts with the shorter one (a sweep slices one sequence)
    longer = build_trace(TraceSpec(**{**spec.__dict__, "num_requests": 80}), vocab=1000)
    assert trace_digest(longer[:50]) == trace_digest(a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt_ids)
    assert all(len(r.text.split()) == len(r.prompt_ids) for r in a)


def test_shared_prefix_groups_at_the_chosen_share():
    spec = TraceSpec(num_requests=400, input_len="fixed:96", output_len="fixed:8",
                     prefix_share=0.75, prefix_len=64, prefix_groups=4, seed=1)
    reqs = build_trace(spec, vocab=5000)
    grouped = [r for r in reqs if r.group >= 0]
    assert 0.68 < len(grouped) / len(reqs) < 0.82
    assert {r.group for r in grouped} == {0, 1, 2, 3}
    heads = {}
    for r in grouped:
        assert len(r.prompt_ids) == 96
        heads.setdefault(r.group, r.prompt_ids[:64])
        assert r.prompt_ids[:64] == heads[r.group]  # the group's prefix
    assert len({tuple(h) for h in heads.values()}) == 4
    d = describe(reqs)
    assert d["requests"] == 400 and d["in_prefix_groups"] == len(grouped)
    assert d["input_len_median"] == 96


def test_jsonl_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in (
        {"prompt": "hello there", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "hi"}]}, {})))
    with pytest.raises(ValueError, match="p.jsonl:3"):
        build_trace(TraceSpec(num_requests=3, jsonl=str(f)))
    f.write_text("\n".join(json.dumps(x) for x in (
        {"prompt": "hello there", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "hi"}]})))
    reqs = build_trace(TraceSpec(num_requests=20, jsonl=str(f), output_len="fixed:9"))
    assert {r.max_tokens for r in reqs} == {5, 9}
    assert all(r.prompt_ids is None and r.text for r in reqs)
    assert any(r.messages for r in reqs)


def test_arrivals_mean_rate_burstiness_and_scaling():
    n = 4000
    p = arrival_times(n, 4.0, "poisson", seed=0)
    assert p[0] == 0.0 and p == sorted(p)
    assert (n - 1) / p[-1] == pytest.approx(4.0, rel=0.06)
    bursty = arrival_times(n, 4.0, "gamma", burstiness=0.25, seed=0)
    assert (n - 1) / bursty[-1] == pytest.approx(4.0, rel=0.15)

    def cv(ts):
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        return statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv(p) == pytest.approx(1.0, abs=0.1)  # exponential gaps
    assert cv(bursty) == pytest.approx(2.0, abs=0.3)  # gamma k=0.25: cv = 1/sqrt(k)
    # one sequence at every rate: doubling the rate halves every offset
    assert arrival_times(50, 2.0, seed=5) == pytest.approx([t / 2 for t in arrival_times(50, 1.0, seed=5)])
    assert arrival_times(5, 1.0, seed=1) == arrival_times(5, 1.0, seed=1)
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)


def test_presets_are_valid_specs():
    for name, p in PRESETS.items():
        spec = TraceSpec(num_requests=20, **{k: v for k, v in p.items()
                                             if k in TraceSpec.__dataclass_fields__})
        assert len(build_trace(spec, vocab=32000)) == 20, name
    assert PRESETS["rag"]["prefix_share"] > 0 and PRESETS["burst"]["arrival"] == "gamma"


def test_fresh_content_keeps_the_shape():
    spec = TraceSpec(num_requests=30, input_len="uniform:8,64", output_len="uniform:1,9",
                     prefix_share=0.5, prefix_len=16, prefix_groups=2, seed=2)
    a, b = build_trace(spec, vocab=1000), build_trace(spec, vocab=1000, content_seed=1)
    assert trace_digest(a, shape_only=True) == trace_digest(b, shape_only=True)
    assert trace_digest(a) != trace_digest(b)
    assert [r.group for r in a] == [r.group for r in b]
    assert all(x.prompt_ids != y.prompt_ids for x, y in zip(a, b))
