"""Real gateway, prefill and decode on one CPU host (shm pool): under a burst, decode holds its
steps back while the prefill that shares its cores still has prompts for it (its yield
counters move), every request still ends with all its tokens; with --prefill-yield-ratio 0
decode never yields."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import harness

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

N = 12
MAX_TOKENS = 16


def _counter(proc, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


async def _burst(stack) -> list[dict]:
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=120) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> dict:
            r = await c.post("/v1/completions", json={
                "model": model, "prompt": f"request {i}: " + "tell me more " * 12,
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                "slo": {"ttft_ms": 60000, "tpot_ms": 5000}})
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(i) for i in range(N)))


def _yielded(ratio: str) -> tuple[float, float, list[dict]]:
    s = harness.start_stack(harness.TINY_CPU, decode_args=["--prefill-yield-ratio", ratio])
    try:
        out = asyncio.run(_burst(s))
        dec = s.decodes[0]
        deadline = time.monotonic() + 5
        steps = 0.0
        while time.monotonic() < deadline:  # the counters refresh with the engine's stats
            steps = _counter(dec, "splitserve_decode_yielded_steps_total")
            if steps > 0:
                break
            time.sleep(0.3)
        return steps, _counter(dec, "splitserve_decode_yield_seconds_total"), out
    finally:
        s.stop()


def test_decode_yields_to_the_prefill_on_its_cores_and_every_request_ends_whole():
    steps, seconds, out = _yielded("6")
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in out)
    assert steps > 0 and seconds > 0, (steps, seconds)


def test_ratio_zero_never_yields():
    steps, seconds, out = _yielded("0")
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in out)
    assert steps == 0 and seconds == 0
