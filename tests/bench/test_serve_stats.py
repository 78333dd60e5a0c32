"""bench.serve_stats: per-request latencies, percentiles, SLO attainment, goodput, admission
outcomes, the A/B comparison; bench.serve_plots writes PNGs; bench.serve parses its flags."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench import serve
from bench.serve_client import ClientConfig, Outcome
from bench.serve_stats import (bootstrap_pct_delta, compare, outcome_rows, per_request, samples,
                               summarize)


def ok(idx, send, first, gap, n, end=None):
    o = Outcome(idx, send, [(first + gap * i, 1) for i in range(n)])
    o.t_end = end if end is not None else first + gap * (n - 1)
    return o


def test_per_request_latencies():
    r = per_request(ok(0, 10.0, 10.5, 0.1, 5))
    assert r["ttft_ms"] == pytest.approx(500.0) and r["tpot_ms"] == pytest.approx(100.0)
    assert r["itl_ms"] == pytest.approx([100.0] * 4) and r["e2e_ms"] == pytest.approx(900.0)
    # one message carrying 3 tokens spreads its gap
    o = Outcome(1, 0.0, [(1.0, 1), (1.3, 3)])
    o.t_end = 1.3
    assert per_request(o)["itl_ms"] == pytest.approx([100.0] * 3)
    assert per_request(ok(2, 0.0, 0.2, 0.1, 1))["tpot_ms"] is None


def test_summary_goodput_attainment_and_admission_outcomes():
    outs = [ok(0, 0.0, 0.1, 0.05, 11),   # TTFT 100, TPOT 50: meets both
            ok(1, 0.0, 0.9, 0.05, 11),   # TTFT 900: misses TTFT
            ok(2, 1.0, 1.2, 0.5, 3),     # TPOT 500: misses TPOT
            ok(3, 1.0, 1.1, 0.0, 1)]     # one token: no TPOT, TTFT 100 meets
    rej = Outcome(4, 1.5, t_end=1.51, status="rejected", code="429", retry_after_s=2.0,
                  predicted_ms=1800.0)
    err = Outcome(5, 1.5, t_end=1.6, status="error", code="503")
    s = summarize(outs + [rej, err], wall_s=4.0, ttft_ms=500, tpot_ms=100, offered_rate=1.5)
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (6, 4, 1, 1)
    assert s["slo_met"] == 2 and s["goodput_rps"] == pytest.approx(0.5)
    assert s["throughput_rps"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(2 / 6) and s["slo_attainment_admitted"] == 0.5
    assert s["output_tok_s"] == pytest.approx(26 / 4.0)
    assert s["retry_after_s_median"] == 2.0 and s["rejected_predicted_ms_median"] == 1800.0
    assert s["errors_by_code"] == {"503": 1} and s["offered_rate"] == 1.5
    assert s["ttft_ms_p50"] == pytest.approx(150.0) and s["ttft_ms_p99"] > 800  # 100, 900, 200, 100
    # no SLO: every finished request counts
    assert summarize(outs, 4.0)["goodput_rps"] == pytest.approx(1.0)
    rows = outcome_rows(outs + [rej])
    assert rows[0]["ttft_ms"] == pytest.approx(100.0) and rows[4]["retry_after_s"] == 2.0
    assert rows[4]["status"] == "rejected" and "ttft_ms" not in rows[4]
    assert math.isnan(summarize([rej], 1.0)["ttft_ms_p50"])


def test_bootstrap_interval_covers_the_true_delta_and_ks_separates():
    rng = np.random.default_rng(0)
    a = rng.lognormal(4.0, 0.3, 600)
    b = a * 1.5
    d = bootstrap_pct_delta(a, b, 99.0, n_boot=500)
    assert d["lo"] < d["delta"] < d["hi"] and d["lo"] > 0
    same = bootstrap_pct_delta(a, rng.permutation(a), 99.0, n_boot=500)
    assert same["lo"] <= 0 <= same["hi"]
    c = compare({"ttft_ms": list(a), "tpot_ms": list(a[:300])},
                {"ttft_ms": list(b), "tpot_ms": list(rng.lognormal(4.0, 0.3, 300))}, n_boot=300)
    assert c["ttft_ms"]["ks_p"] < 1e-6 and c["ttft_ms"]["p99_delta"] > 0
    assert c["tpot_ms"]["ks_p"] > 0.01  # drawn from one distribution
    assert math.isnan(c["itl_ms"]["ks_p"]) and c["itl_ms"]["n_a"] == 0


def test_plots_write_pngs(tmp_path):
    from bench.serve_plots import plot_ab, plot_cdfs, plot_load

    sm = samples([ok(i, 0.0, 0.1 + 0.01 * i, 0.05, 5) for i in range(20)])
    assert plot_cdfs({"A": sm, "B": sm}, str(tmp_path / "c.png"), slo={"ttft_ms": 150}).endswith(".png")
    rows = [{"offered_rate": r, "goodput_rps": r * 0.9, "throughput_rps": r, "ttft_ms_p99": 100 * r,
             "tpot_ms_p99": 10 * r} for r in (1, 2, 4)]
    plot_load({"with": rows, "without": rows}, str(tmp_path / "l.png"), slo={"ttft_ms": 300})
    cmp = compare(sm, samples([ok(i, 0.0, 0.2 + 0.01 * i, 0.06, 5) for i in range(20)]), n_boot=100)
    plot_ab(cmp, str(tmp_path / "ab.png"))
    for f in ("c.png", "l.png", "ab.png"):
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_flags_presets_and_ab_overrides():
    a = serve.parse_args(["--preset", "rag", "--rate", "2", "--input-len", "fixed:300"])
    assert a.input_len == "fixed:300" and a.prefix_share == 0.9 and a.arrival == "poisson"
    assert serve.parse_args(["--preset", "burst"]).burstiness == 0.25
    with pytest.raises(SystemExit):
        serve.parse_args(["--rate", "1", "--concurrency", "2"])
    b = serve.ab_overrides("send_slo=false,url=http://x:1,ttft_ms=50,priority=3", ClientConfig())
    assert (b.send_slo, b.url, b.ttft_ms, b.priority) == (False, "http://x:1", 50.0, 3)
    with pytest.raises(SystemExit):
        serve.ab_overrides("nope=1", ClientConfig())
    assert serve.ab_overrides(None, ClientConfig()) is None


def test_gateway_delta_from_metrics():
    before = {'splitserve_admission_decisions_total{decision="admit"}': 3.0}
    after = {'splitserve_admission_decisions_total{decision="admit"}': 10.0,
             'splitserve_admission_decisions_total{decision="reject"}': 2.0,
             'splitserve_admission_prediction_ratio_sum{what="ttft"}': 7.0,
             'splitserve_admission_prediction_ratio_count{what="ttft"}': 7.0,
             'splitserve_admission_prediction_abs_error_ratio{what="ttft"}': 0.12,
             'splitserve_routing_prefix_tokens_total{kind="prompt"}': 100.0,
             'splitserve_routing_prefix_tokens_total{kind="cached"}': 64.0}
    g = serve.gateway_delta(before, after)
    assert (g["admit"], g["queue"], g["reject"]) == (7, 0, 2)
    assert g["ttft_observed_over_predicted_mean"] == 1.0
    assert g["ttft_prediction_abs_error_median"] == 0.12 and g["tpot_observed_over_predicted_mean"] is None
    assert g["routed_prefix_hit_rate"] == 0.64
    assert serve.gateway_delta({}, {}) == {}


def test_steady_prediction_error_leaves_out_the_first_quarter_of_arrivals():
    """The cold start (models learning the new load) counts in the overall median only."""
    outs = []
    for i in range(8):  # sent at 0..7 s; predicted 100 ms each; the first two got 400 ms
        o = ok(i, float(i), float(i) + 0.1, 0.05, 3)
        o.pred_ttft_ms, o.gw_ttft_ms = 100.0, 400.0 if i < 2 else 110.0
        outs.append(o)
    s = summarize(outs, 8.0)
    steady = s["ttft_prediction_ape_median_steady"]
    assert steady == pytest.approx(10 / 110) and s["ttft_prediction_ape_median"] >= steady


def test_report_ttft_error_is_the_runs_own_requests_median():
    """The table's "TTFT err": the run's per-request APE (gateway workers each export their own
    error, /metrics the worst); the gateway's gauge only where the rows have none."""
    from bench.serve_report import run_rows

    s = {"completed": 4, "rejected": 0, "errors": 0, "goodput_rps": 1.0, "throughput_rps": 1.0,
         "output_tok_s": 10.0, "slo_attainment": 1.0, "slo_attainment_admitted": 1.0,
         "ttft_ms_p50": 1.0, "ttft_ms_p99": 2.0, "tpot_ms_p50": 1.0, "tpot_ms_p99": 2.0,
         "itl_ms_p99": 2.0, "e2e_ms_p99": 3.0, "prefix_cache_hit_rate": 0.0,
         "ttft_prediction_ape_median": 0.08}
    gw = {"ttft_prediction_abs_error_median": 0.33}
    run = {"label": "A", "rate": 1.0, "summary": s, "gateway": gw}
    assert run_rows([run])[0]["TTFT err"] == "8%"
    run["summary"] = {**s, "ttft_prediction_ape_median": float("nan")}
    assert run_rows([run])[0]["TTFT err"] == "33%"
