"""bench.pd_system / bench.pd_clients: the pure parts (percentiles, trace statistics, SSE
parsing, ratios and the table) and one real CPU run of the whole benchmark (engine alone, then
`splitserve up`) as a subprocess."""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench import pd_system as ps
from bench.pd_clients import (Trace, gateway_medians, parse_sse, percentile, sse_tokens,
                               trace_stats)
from bench.system_procs import kv_delta, log_reason

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_percentile_interpolates_like_numpy():
    xs = [5, 1, 4, 2, 3]
    assert percentile(xs, 50) == 3
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 5
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_token_times_spread_a_multi_token_message():
    tr = Trace(0.0, [(1.0, 1), (2.0, 2), (2.5, 1)])
    assert tr.n_tokens == 4
    assert tr.token_times() == [1.0, 1.5, 2.0, 2.5]


def test_trace_stats_whole_run_and_after_first_tokens():
    # request a: first token at 1.0, then every 0.1 s; b: first token late at 2.0
    a = Trace(0.0, [(1.0 + 0.1 * i, 1) for i in range(21)])  # tokens up to 3.0
    b = Trace(0.5, [(2.0, 1), (2.1, 1), (2.2, 1), (2.3, 1)])
    s = trace_stats([a, b, Trace(0.0)])  # a request without tokens counts as not completed
    assert s["requests"] == 3 and s["completed"] == 2 and s["tokens"] == 25
    assert s["tok_s"] == pytest.approx(25 / 3.0)
    assert s["ttft_ms_median"] == pytest.approx(1250.0)  # (1000 + 1500) / 2
    assert s["tpot_ms"] == pytest.approx(100.0)
    # after all first tokens (t >= 2.0): a's 10 gaps from 2.0 on and b's 3
    assert s["itl_after_first_gaps"] == 13
    assert s["itl_after_first_ms_median"] == pytest.approx(100.0)
    with pytest.raises(RuntimeError):
        trace_stats([Trace(0.0)])


def test_gateway_medians_over_the_traces_that_carry_timings():
    t = [Trace(0.0, [(1.0, 1)], {"ttft_ms": v, "queue_ms": v / 10}) for v in (30.0, 10.0, 20.0)]
    got = gateway_medians(t + [Trace(0.0, [(1.0, 1)])])  # one without (the engine side's kind)
    assert got == {"gateway_ttft_ms_median": 20.0, "gateway_queue_ms_median": 2.0}
    assert gateway_medians([Trace(0.0)]) == {}
    assert trace_stats(t)["gateway_ttft_ms_median"] == 20.0


def test_parse_sse_split_frames_done_comments_crlf():
    stream = (b'data: {"choices": [{"text": "a", "logprobs": null}]}\r\n\r\n'
              b': keep-alive\n\n'
              b'data: {"choices": [{"text": "b", "logprobs": {"tokens": ["b", "c"]}}]}\n\n'
              b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\ndata: [DONE]\n\n')
    events, buf = [], b""
    for i in range(0, len(stream), 7):  # arrives in arbitrary pieces
        got, buf = parse_sse(buf + stream[i:i + 7])
        events += got
    assert buf == b""
    assert events[-1] == "[DONE]" and len(events) == 4
    assert [sse_tokens(e) for e in events[:3]] == [1, 2, 0]
    got, rest = parse_sse(b'data: {"x": 1}\n\ndata: {"y"')
    assert got == [{"x": 1}] and rest == b'data: {"y"'


def test_ratio_fmt_and_ttft_slack():
    assert ps.ratio(50.0, 100.0, "rate") == 0.5
    assert ps.ratio(105.0, 100.0, "ttft") == pytest.approx(1.0)  # system / (engine + 5 ms)
    assert ps.ratio("error: x", 1.0, "rate") == "" and ps.ratio(1.0, 0.0, "rate") == ""
    assert ps.ratio(float("nan"), 1.0, "rate") == ""
    assert ps.fmt(12345.6) == "12346" and ps.fmt(12.34) == "12.3" and ps.fmt(0.12345) == "0.123"
    assert ps.fmt(None) == "" and ps.fmt("error: " + "x" * 100).endswith("...")


def test_ttft_lens_clip_and_flags():
    assert ps.ttft_lens("128,512,2048,8192", 1000) == [128, 512, 998]
    assert ps.without_device(["--model", "m", "--device", "cuda:1", "--device=cpu", "--dtype",
                              "bf16"]) == ["--model", "m", "--dtype", "bf16"]
    a, e, rest = ps.parse_args(["--clients", "3", "--model", "dummy:tiny-llama", "--device", "cpu",
                                "--block-size", "32"])
    assert a.clients == 3 and e.block_size == 32 and e.device == "cpu" and e.kv_cache_bytes is None
    assert rest == ["--model", "dummy:tiny-llama", "--device", "cpu", "--block-size", "32"]


def test_kv_delta_and_log_reason():
    before = {'splitserve_kv_transfer_bytes_total{direction="send"}': 100.0,
              'splitserve_kv_transfers_total{backend="grpc"}': 1.0}
    after = {'splitserve_kv_transfer_bytes_total{direction="send"}': 900.0,
             'splitserve_kv_transfers_total{backend="grpc"}': 3.0,
             'splitserve_kv_transfers_total{backend="dist"}': 2.0}
    d = kv_delta(before, after, 4)
    assert d["bytes_total"] == 800 and d["bytes_per_request"] == 200
    assert d["backend"] == "dist,grpc" and d["transfers_by_backend"] == {"grpc": 2, "dist": 2}
    log = "Traceback ...\n  File x\nMemoryError: KV cache budget\nsplitserve up: decode exited\n"
    assert log_reason(log) == "MemoryError: KV cache budget"
    assert log_reason("just this\n") == "just this"


def test_build_rows_fills_ratios_and_shows_errors():
    a = SimpleNamespace(clients=4, lp_batch=2)
    load = {"tokens": 10, "messages": 5, "tok_s": 100.0, "ttft_ms_median": 10.0, "tpot_ms": 5.0, "itl_ms_median": 5.0,
            "itl_ms_p99": 10.0, "itl_after_first_ms_median": 5.0, "itl_after_first_ms_p99": 6.0}
    eng = ps.add_derived({"ttft_16": {"ms_median": 5.0}, "ttft_128": {"ms_median": 15.0},
                          "load": dict(load), "lp_off": {"tpot_ms": 4.0}, "lp_on": {"tpot_ms": 5.0}})
    sysr = ps.add_derived({"ttft_16": "error: boom", "ttft_128": {"ms_median": 40.0},
                           "load": {**load, "tok_s": 80.0}, "lp_off": {"tpot_ms": 4.0},
                           "lp_on": {"tpot_ms": 6.0},
                           "kv": {"bytes_per_request": 1024.0, "backend": "grpc"}})
    rows = {r["case"]: r for r in ps.build_rows(eng, sysr, a)}
    assert list(rows)[:2] == ["TTFT 16-token prompt, ms", "TTFT 128-token prompt, ms"]
    assert rows["TTFT 16-token prompt, ms"]["whole system"] == "error: boom"
    assert rows["TTFT 16-token prompt, ms"]["ratio"] == ""
    assert rows["TTFT 128-token prompt, ms"]["ratio"] == "2"  # 40 / (15 + 5)
    assert rows["4 clients: output tok/s"]["ratio"] == "0.8"
    assert rows["ITL p99/median, whole run"]["engine alone"] == "2"
    assert rows["KV transfer backend"]["whole system"] == "grpc"
    msgs = next(r for c, r in rows.items() if c.startswith("client messages per token"))
    assert msgs["engine alone"] == "0.5" and msgs["ratio"] == ""
    assert rows["TPOT logprobs on/off"]["whole system"] == "1.5"
    # a whole side that failed: every one of its cells says so
    rows = ps.build_rows(eng, {"error": "error: up died"}, a)
    assert all(r["whole system"] == "error: up died" for r in rows if r["case"] != "TPOT logprobs on/off")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cpu_run_fills_both_columns(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "SPLITSERVE_BENCH_DIR": str(tmp_path),
           "OTEL_TRACES_EXPORTER": "none"}
    out = subprocess.run(
        [sys.executable, "-m", "bench.pd_system", "--model", "default", "--device", "cpu",
         "--clients", "4", "--prompt-len", "32", "--max-tokens", "16", "--ttft-prompts", "16,64",
         "--reps", "2", "--client-procs", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine alone" in out.stdout and "whole system" in out.stdout
    assert "4 clients: output tok/s" in out.stdout and "error:" not in out.stdout, out.stdout
    [path] = glob.glob(str(tmp_path / "pd_system-*.json"))
    doc = json.load(open(path))
    assert doc["machine"]["host"] and doc["commit"]
    res = doc["results"]
    for side in ("engine", "system"):
        r = res[side]
        for n in (16, 64):
            assert r[f"ttft_{n}"]["ms_median"] > 0 and len(r[f"ttft_{n}"]["samples_ms"]) == 2
        assert r["load"]["tok_s"] > 0 and r["load"]["tokens"] == 4 * 16
        assert r["load"]["messages/token"] > 0.9  # tokens seen one by one (gRPC, skip_text)
        assert r["load"]["itl_ms_p99"] >= r["load"]["itl_ms_median"] > 0
        assert r["lp_off"]["tpot_ms"] > 0 and r["lp_on"]["tpot_ms"] > 0
    assert res["system"]["kv"]["bytes_per_request"] > 0 and res["system"]["kv"]["backend"] == "shm"  # auto on one host
    hops = res["system"]["hops"]  # every hop saw the load's gaps; the clients ran in 2 workers
    assert hops["decode_itl_ms_mean"] > 0 and hops["gateway_itl_ms_mean"] > 0
    assert hops["decode_cpu_share"] > 0 and "client_cpu_share" not in hops
