"""The SLO peak search of bench/serve_peak.py against a simulated server (no sockets: the probe
is replaced by a capacity model; the real probe path runs in tests/e2e/test_serve_bench.py)."""
import asyncio
import types

import pytest

from bench import serve_peak


def run_search(capacity: float, start: float, monkeypatch):
    seen = []

    async def probe(cfg, spec, vocab, rate, k, a):
        seen.append((rate, k))
        return {"rate": rate, "attainment": 1.0 if rate <= capacity else 0.5}

    monkeypatch.setattr(serve_peak, "probe", probe)
    a = types.SimpleNamespace(ttft_ms=500.0, tpot_ms=None, peak_attainment=0.9)
    peak, probes = asyncio.run(serve_peak.slo_peak(None, None, 0, a, start))
    assert [k for _, k in seen] == list(range(len(seen)))  # every probe its own content seed
    return peak, probes


@pytest.mark.parametrize("capacity,start", [(40.0, 14.0), (5.0, 14.0), (14.5, 14.0)])
def test_peak_is_the_highest_passing_rate_within_the_last_bisection(capacity, start, monkeypatch):
    peak, probes = run_search(capacity, start, monkeypatch)
    assert peak <= capacity
    failing = [p["rate"] for p in probes if p["attainment"] < 0.9]
    assert failing and min(failing) > capacity
    # two bisections of a x1.5 bracket: within 1.5 ** 0.25 of the true capacity
    assert peak > capacity / 1.5 ** 0.25 - 1e-9


def test_a_server_that_never_meets_the_slo_is_an_error(monkeypatch):
    with pytest.raises(SystemExit, match="attainment below"):
        run_search(0.0, 14.0, monkeypatch)


def test_the_search_needs_an_slo(monkeypatch):
    a = types.SimpleNamespace(ttft_ms=None, tpot_ms=None, peak_attainment=0.9)
    with pytest.raises(SystemExit, match="needs"):
        asyncio.run(serve_peak.slo_peak(None, None, 0, a, 1.0))
