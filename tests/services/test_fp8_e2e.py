"""fp8 KV cache across real prefill/decode processes: the blocks and their per-layer scales
travel, and greedy output equals one fp8 engine doing everything, also for a repeat whose
leading blocks decode already holds (only the last block is sent)."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests import harness
from tests.services.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


async def test_fp8_kv_disagg_equals_colocated():
    extra = ["--kv-cache-dtype", "fp8_e4m3"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 40))
    with harness.service_pair(extra, extra) as (pre, dec):
        c = Client(pre.address, dec.address)
        try:
            got, _ = await c.generate("fp8", prompt, params)
            ticket, pre_resp, call = await c.start("fp8-again", prompt, params)
            again = [pre_resp.first_token_id]
            async for m in call:
                again += list(m.token_ids)
        finally:
            await c.close()
    eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
                              cache=CacheConfig(num_blocks=64, kv_cache_dtype="fp8_e4m3"),
                              device=DeviceConfig(device=harness.DEVICE)))
    eng.add_request("fp8", prompt, params)
    want = []
    while eng.has_unfinished():
        for o in eng.step():
            want += o.new_token_ids
    assert got == want
    assert ticket.num_cached_blocks == 2 and again == want
