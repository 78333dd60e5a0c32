"""lab/cpu_plan_rounds.py's pieces: the per-case median engine costs over rounds, a run's load
from its per-request rows, and bench/plan_validate's parser + build in-process."""
from __future__ import annotations

import json

import pytest

from bench import plan_validate
from lab import cpu_plan_rounds


def _costs(path, rows: dict, **config) -> str:
    path.write_text(json.dumps({"benchmark": "engine_costs", "config": {"device": "cpu", **config},
                                "results": {"rows": [{"shape": "s", "case": c, "eager_ms": ms}
                                                     for c, ms in rows.items()]}}))
    return str(path)


def test_median_costs_takes_each_case_over_the_rounds_holding_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_BENCH_DIR", str(tmp_path / "out"))
    paths = [_costs(tmp_path / f"{i}.json", {"prefill 8": p, "decode b=1 ctx=8": d, **extra},
                    cpu_decode_attention="native")
             for i, (p, d, extra) in enumerate([(10.0, 4.0, {"decode b=2 ctx=8": 5.0}), (30.0, 2.0, {}),
                                                (20.0, 9.0, {})])]
    out = cpu_plan_rounds.median_costs(paths)
    assert "engine_costs_median-" in out
    doc = json.loads(open(out).read())
    assert doc["benchmark"] == "engine_costs" and doc["config"]["median_of"] == ["0.json", "1.json", "2.json"]
    assert {r["case"]: r["eager_ms"] for r in doc["results"]["rows"]} == {"prefill 8": 20.0,
                                                                         "decode b=1 ctx=8": 4.0}
    assert not plan_validate.padded_auto(out)  # the rounds' decode attention is kept


def test_load_of_counts_the_decode_rows_in_flight(tmp_path):
    # two requests: decoding 1-3 s and 2-4 s of a 0-4 s run -> 4 s of decode over 4 s: 1 row
    rows = [{"status": "ok", "send_s": 0.0, "ttft_ms": 1000.0, "e2e_ms": 3000.0},
            {"status": "ok", "send_s": 1.0, "ttft_ms": 1000.0, "e2e_ms": 3000.0},
            {"status": "error", "send_s": 2.0}]
    summary = {k: 1.0 for k in ("throughput_rps", "ttft_ms_p50", "tpot_ms_p50", "goodput_rps")}
    p = tmp_path / "serve.json"
    p.write_text(json.dumps({"date": "d", "results": {"runs": [{"rate": 2.8, "summary": summary,
                                                                "requests": rows}]}}))
    got = cpu_plan_rounds.load_of(str(p))
    assert got["kind"] == "2.8 req/s" and got["rows_in_flight"] == pytest.approx(1.0)


def test_parser_and_build_give_the_fits_in_process(tmp_path):
    costs = _costs(tmp_path / "c.json", {"prefill 8": 10.0, "prefill 64": 40.0, "decode b=1 ctx=8": 4.0,
                                         "decode b=8 ctx=8": 6.0})
    ns = plan_validate.parser().parse_args(["x.json", "--calibration", costs, "--shape", "s",
                                            "--overhead-ms", "7", "--row-overhead-ms", "0.5"])
    cal, cluster, (over, step, row) = plan_validate.build(ns)
    assert (over, step, row) == (7.0, 0.0, 0.5) and cal.ttft_overhead_ms == 7.0
    assert cal.padded_attention and cluster.prefill == 0
