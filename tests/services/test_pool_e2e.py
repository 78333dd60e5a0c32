"""The shm pool backend between real prefill and decode processes on CPU: chosen by default
(auto), byte-exact (greedy output equals the colocated engine, bf16 and fp8 KV), grpc when
forced, and a killed prefill frees decode's mapping of its pool and every block."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine.sampling_params import SamplingParams
from protos import common_pb2
from tests import harness
from tests.services.client import Client
from tests.services.test_disagg_e2e import _colocated

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 40)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _kv_bytes(ticket, n_tokens: int, elem: int) -> int:
    """What moves: the prompt's blocks less those decode already held."""
    lay = ticket.layout
    blocks = -(-n_tokens // ticket.block_size) - ticket.num_cached_blocks
    return blocks * ticket.block_size * lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * elem


async def _run(pair, prompts, prefix="r"):
    c = Client(pair[0].address, pair[1].address)
    try:
        out = []
        for i, p in enumerate(prompts):
            ticket, pre, call = await c.start(f"{prefix}{i}", p, GREEDY)
            toks = [pre.first_token_id]
            async for m in call:
                toks += list(m.token_ids)
            out.append((toks, pre, ticket))
        return out
    finally:
        await c.close()


async def _idle(pair, timeout_s=10.0):
    c = Client(pair[0].address, pair[1].address)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            dl = await c.decode.Load(common_pb2.LoadRequest(), timeout=5)
            if dl.kv_usage == 0 and dl.reserved == 0 and dl.running == 0:
                return
            assert time.monotonic() < deadline, f"decode still holds blocks: {dl}"
            await asyncio.sleep(0.1)
    finally:
        await c.close()


async def test_auto_picks_shm_on_one_host_and_output_is_exact():
    want = _colocated(PROMPTS, GREEDY)
    with harness.service_pair() as pair:
        got = await _run(pair, PROMPTS)
        for i, (toks, pre, ticket) in enumerate(got):
            assert pre.kv_backend == "shm", pre
            assert pre.kv_bytes == _kv_bytes(ticket, len(PROMPTS[i]), 4)  # fp32
            assert toks == want[i], f"prompt {i}"
        await _idle(pair)
        assert "kv pool" in pair[1].log() and "mapped" in pair[1].log()


async def test_forced_grpc_still_works_and_says_so():
    want = _colocated(PROMPTS[:1], GREEDY)
    with harness.service_pair(prefill_extra=["--kv-transfer-backend", "grpc"]) as pair:
        [(toks, pre, _)] = await _run(pair, PROMPTS[:1])
        assert pre.kv_backend == "grpc" and toks == want[0]


async def test_fp8_kv_travels_through_the_pool_with_its_scales():
    fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
    with harness.service_pair(prefill_extra=fp8, decode_extra=fp8) as pair:
        got = await _run(pair, PROMPTS[1:2])
        [(toks, pre, ticket)] = got
        assert pre.kv_backend == "shm"
        assert pre.kv_bytes == _kv_bytes(ticket, len(PROMPTS[1]), 1)  # fp8 moves as fp8
        assert len(toks) == GREEDY.max_tokens
        await _idle(pair)
    with harness.service_pair(prefill_extra=fp8 + ["--kv-transfer-backend", "grpc"], decode_extra=fp8) as pair:
        [(want, pre, _)] = await _run(pair, PROMPTS[1:2])
        assert pre.kv_backend == "grpc" and toks == want


async def test_a_killed_prefill_frees_decodes_mapping_and_blocks():
    with harness.service_pair() as pair:
        await _run(pair, PROMPTS[:1])
        pair[0].stop(kill=True)
        deadline = time.monotonic() + 10
        while "unmapped" not in pair[1].log():
            assert time.monotonic() < deadline, "decode kept the dead prefill's pool mapped"
            await asyncio.sleep(0.1)
        await _idle(pair)
        assert pair[1].alive()
