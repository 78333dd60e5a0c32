"""/metrics of the real gateway, prefill and decode processes after real requests: each process
exports its own series only, every sample carries model_name, the request histograms (lengths,
queue / prefill / decode time, TPOT) count every request, decode counts a stream whose caller
closed it after the last token as finished (not aborted), and every query of the Grafana
dashboard in docker/ names a series that one of the processes exports."""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from protos import generate_pb2
from tests import harness
from tests.services.client import Client

pytestmark = pytest.mark.e2e

DASHBOARD = Path(harness.ROOT) / "docker" / "grafana" / "dashboards" / "splitserve.json"
N_REST = 3  # REST completions through the gateway
N_DIRECT = 8  # Decode streams their caller closes on reading the last message (concurrent)
GATEWAY_ONLY = ("splitserve_admission", "splitserve_routing", "splitserve_replica",
                "splitserve_predicted", "splitserve_time_to_first_token", "splitserve_e2e",
                "splitserve_time_per_output_token")
ENGINE_ONLY = ("splitserve_kv_cache", "splitserve_cuda_graph", "splitserve_engine_",
               "splitserve_kv_transfer", "splitserve_num_preemptions", "splitserve_prefix_cache",
               "splitserve_waiting_prefill_tokens")


@pytest.fixture(scope="module")
def stack():
    s = harness.start_stack(harness.TINY_CPU)
    try:
        yield s
    finally:
        s.stop()


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """-> {(sample name, sorted labels): value}"""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def _declared(url: str) -> set[str]:
    """Series names a process declares (HELP / TYPE), also those with no sample yet (a labelled
    counter such as the KV-transfer fallbacks has none until its first event)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {fam.name + sfx for fam in text_string_to_metric_families(text)
            for sfx in _SUFFIXES.get(fam.type, ("",))}


def _value(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


async def _wait_idle(stack, timeout_s: float = 20.0) -> None:
    """Until decode and prefill report nothing running (their gauges refresh every second)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ss = [_scrape(f"http://127.0.0.1:{p.metrics_port}/metrics") for p in (*stack.prefills, *stack.decodes)]
        if all(_value(s, "splitserve_num_requests_running") == 0 for s in ss):
            return
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def scraped(stack):
    """Run N_REST REST completions and one Decode stream closed by its caller right after its last
    message; -> (model name, {process: samples}, the series names the three declare)."""
    return asyncio.run(_load_and_scrape(stack))


async def _load_and_scrape(stack):
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        for i in range(N_REST):
            r = await c.post("/v1/completions", json={"model": model, "prompt": f"hello {i}",
                                                      "max_tokens": 6, "ignore_eos": True})
            assert r.status_code == 200, r.text
    cl = Client(stack.prefills[0].address, stack.decodes[0].address)

    async def closed_after_last(i: int) -> None:
        _, _, call = await cl.start(f"closed-{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=4, ignore_eos=True))
        async for m in call:
            if m.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                call.cancel()  # the caller is done: it closes the stream at once
                break

    try:
        await asyncio.gather(*(closed_after_last(i) for i in range(N_DIRECT)))
    finally:
        await cl.close()
    await _wait_idle(stack)
    await asyncio.sleep(1.2)  # one more refresh of the engine gauges and counters
    urls = {"gateway": f"{stack.http_url}/metrics",
            "prefill": f"http://127.0.0.1:{stack.prefills[0].metrics_port}/metrics",
            "decode": f"http://127.0.0.1:{stack.decodes[0].metrics_port}/metrics"}
    return model, {k: _scrape(u) for k, u in urls.items()}, set().union(*map(_declared, urls.values()))


def test_every_sample_has_the_model_name(scraped):
    model, procs, _ = scraped
    for proc, samples in procs.items():
        assert samples, proc
        bad = [n for (n, ls), _ in samples.items() if dict(ls).get("model_name") != model]
        assert not bad, (proc, bad[:5])


def test_each_process_exports_its_own_series(scraped):
    _, procs, _ = scraped
    names = {p: {n for n, _ in s} for p, s in procs.items()}
    assert not [n for n in names["gateway"] if n.startswith(ENGINE_ONLY)]
    for p in ("prefill", "decode"):
        assert not [n for n in names[p] if n.startswith(GATEWAY_ONLY)], p
        assert "splitserve_kv_cache_usage_ratio" in names[p] and "splitserve_num_preemptions_total" in names[p]
    assert "splitserve_request_decode_seconds_count" not in names["prefill"]


def test_request_histograms_count_every_request(scraped):
    _, procs, _ = scraped
    gw, pre, dec = procs["gateway"], procs["prefill"], procs["decode"]
    n_all = N_REST + N_DIRECT
    for name in ("splitserve_request_prompt_tokens_count", "splitserve_request_generation_tokens_count",
                 "splitserve_time_per_output_token_seconds_count", "splitserve_request_queue_seconds_count"):
        assert _value(gw, name) == N_REST, name
    assert _value(gw, "splitserve_request_prompt_tokens_sum") > 0
    assert _value(gw, "splitserve_request_generation_tokens_sum") == 6 * N_REST
    for name in ("splitserve_request_prefill_seconds_count", "splitserve_request_queue_seconds_count",
                 "splitserve_request_prompt_tokens_count"):
        assert _value(pre, name) == n_all, name
    assert _value(dec, "splitserve_request_decode_seconds_count") == n_all
    assert _value(dec, "splitserve_request_generation_tokens_sum") == 6 * N_REST + 4 * N_DIRECT
    assert _value(dec, "splitserve_num_preemptions_total") == 0


def test_decode_counts_finished_streams_as_finished(scraped):
    _, procs, _ = scraped
    dec = procs["decode"]
    assert _value(dec, "splitserve_requests_total", outcome="abort") == 0
    assert _value(dec, "splitserve_requests_total", outcome="length") == N_REST + N_DIRECT
    assert _value(procs["gateway"], "splitserve_requests_total", outcome="length") == N_REST


def _metric_names(expr: str) -> set[str]:
    """The series a dashboard query reads: label_values(series, label) (a Grafana variable), else
    the vector selectors of the PromQL, parsed (Grafana's $__rate_interval given a value)."""
    m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", expr)
    if m:
        return {m.group(1)}
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr.replace("$__rate_interval", "1m")), visit)
    return names


def _dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return out


def test_every_dashboard_query_names_an_exported_series(scraped):
    _, _, exported = scraped
    queries = _dashboard_queries()
    assert len(queries) >= 20
    for q in queries:
        names = _metric_names(q)
        assert names, q
        missing = names - exported
        assert not missing, f"{q}: {sorted(missing)} not exported by gateway, prefill or decode"


def test_the_dashboard_covers_the_issue_panels():
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]).lower()
    for want in ("time to first token", "time per output token", "inter-token", "throughput",
                 "kv cache usage", "admission", "kv transfer rate", "cuda graph replays"):
        assert want in titles, want
