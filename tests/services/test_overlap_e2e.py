"""Real prefill + decode processes with overlapped decode forced on (the CPU default is off):
staggered concurrent requests stream the colocated synchronous engine's tokens, a cancel
mid-stream frees the blocks on both sides while steps are in flight, and the decode service's
/metrics counts the steps it launched overlapped."""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import pytest

from bench.system_procs import strip_model_name
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests import harness
from tests.services.client import take_tokens
from tests.services.test_disagg_e2e import _wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 40, 9, 31)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def services():
    on = ["--async-scheduling", "on"]
    with harness.service_pair(on, [*on, "--reservation-timeout-s", "20"]) as pair:
        yield pair


def _metric(port: int, name: str) -> float:
    text = strip_model_name(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_staggered_requests_equal_the_synchronous_engine(client, services):
    eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
                              cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),
                              device=DeviceConfig(device=harness.DEVICE)))
    want = eng.generate(PROMPTS, GREEDY)

    async def late(i):
        await asyncio.sleep(0.05 * i)  # arrivals while the others decode
        return await client.generate(f"ov{i}", PROMPTS[i], GREEDY)

    results = await asyncio.gather(*(late(i) for i in range(len(PROMPTS))))
    assert [toks for toks, _ in results] == want
    await _wait_idle(client)
    _pre, dec = services
    deadline = time.monotonic() + 5  # the service refreshes its metrics every second
    while True:
        steps = _metric(dec.metrics_port, "splitserve_engine_steps_total")
        overlapped = _metric(dec.metrics_port, "splitserve_engine_overlapped_steps_total")
        if (overlapped > 0 and steps >= 16) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert overlapped > 0 and steps >= 16, (steps, overlapped)


async def test_cancel_mid_stream_with_steps_in_flight(client):
    """A client goes away while decode steps are launched ahead of its tokens; the request
    beside it still gets all of them and every block comes back on both sides."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    keep = asyncio.ensure_future(client.generate("stay", PROMPTS[1], GREEDY))
    _, _, call = await client.start("gone", PROMPTS[2], params)
    assert await take_tokens(call, 5) >= 5
    call.cancel()
    toks, _ = await keep
    assert len(toks) == GREEDY.max_tokens
    await _wait_idle(client)
