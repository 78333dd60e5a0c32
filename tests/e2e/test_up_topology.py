"""`splitserve up` on CPU: colocated by default (the prefill service runs no prompt, decode runs
on every core), `--topology split` prefills on the prefill service; both answer a completion."""
from __future__ import annotations

import json
import urllib.request

import pytest

from bench.system_procs import free_port, scrape_metrics
from tests.harness import TINY_CPU, UP_PORTS, splitserve_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _complete(rest: str) -> dict:
    body = json.dumps({"model": "dummy-tiny-llama", "prompt": "hello there", "max_tokens": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(rest + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _prompt_tokens(port: int) -> float:
    return sum(scrape_metrics(f"http://127.0.0.1:{port}", "splitserve_prompt_tokens_total").values())


@pytest.mark.parametrize("flags, banner, prefill_runs", [
    ([], "colocated: prompts prefilled on decode", False),
    (["--topology", "split"], "split, KV transfer", True),
])
def test_up_topology(flags, banner, prefill_runs):
    pm, dm = free_port(), free_port()
    with splitserve_up([*UP_PORTS, *TINY_CPU, "--metrics-ports", f"{pm},{dm}", *flags]) as up:
        assert banner in up.log(), up.log()
        assert _complete(up.rest)["usage"]["completion_tokens"] == 4
        assert (_prompt_tokens(pm) > 0) == prefill_runs, up.log()
