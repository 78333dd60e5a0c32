"""bench/soak.py's report: counts, RSS growth after the warm-up, the PNG (no processes)."""
from __future__ import annotations

import os

from bench import soak
from bench.serve_client import Outcome


def _samples(n: int, rss0: float, rss1: float) -> list[dict]:
    return [{"t_s": 5.0 * (i + 1), "ok": 2, "rejected": 0, "error": 0, "in_flight": 1,
             "rss_mb": {"decode": rss0 + (rss1 - rss0) * i / (n - 1), "gateway": 300.0},
             "kv_usage": {"decode": 0.1, "prefill": 0.0}} for i in range(n)]


def test_summary_counts_and_rss_growth_after_warmup(tmp_path):
    ok = Outcome(0, t_send=1.0, events=[(1.5, 1), (2.0, 3)], t_end=2.0)
    err = Outcome(1, t_send=1.0, t_end=1.1, status="error", code="503", error="no decode replica")
    res = soak.summarize(_samples(10, 1000.0, 1090.0), [ok, err], sent=3, lost=1, t_load=50.0,
                         kv_end={"decode": 0.0}, rate=0.06, minutes=1)
    assert (res["sent"], res["completed"], res["errors"], res["lost"]) == (3, 1, 1, 1)
    assert res["error_examples"] == ["503: no decode replica"]
    # warm-up: the first fifth of the samples; growth is the last vs the sample after it
    assert res["rss_growth_pct_after_warmup"] == {"decode": round(70 / 1020 * 100, 2), "gateway": 0.0}
    assert res["ttft_s_p50"] == 0.5 and res["e2e_s_p50"] == 1.0
    png = soak.plot(res, str(tmp_path / "soak.png"), "t")
    assert os.path.getsize(png) > 1000


def test_rss_of_a_live_and_a_gone_process():
    import math

    out = soak.rss_mb({"me": os.getpid(), "gone": 2 ** 22 + 7})
    assert out["me"] > 10 and math.isnan(out["gone"])
