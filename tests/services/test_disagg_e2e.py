"""Real prefill + decode processes on loopback ports, driven Reserve -> Prefill -> Decode.

Greedy output equals the engine run colocated; cancel mid-stream frees the blocks on both
sides; an unused reservation expires; bad input -> INVALID_ARGUMENT; a killed decode ends
the stream with an error within seconds; health, reflection and /metrics answer."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.system_procs import strip_model_name
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, generate_pb2, prefill_pb2
from tests import harness
from tests.services.client import Client, take_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 40)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def services():
    with harness.service_pair(decode_extra=["--reservation-timeout-s", "20"]) as pair:
        yield pair


_ENGINE = {}


def _tokenizer():
    return _colocated_engine().tokenizer


def _colocated_engine():
    if "e" not in _ENGINE:
        _ENGINE["e"] = Engine(EngineConfig(
            model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
            cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),
            device=DeviceConfig(device=harness.DEVICE)))
    return _ENGINE["e"]


def _colocated(prompts, params):
    eng = _colocated_engine()
    assert not eng.has_unfinished()
    return eng.generate(prompts, params)


async def _load(client):
    return (await client.prefill.Load(common_pb2.LoadRequest(), timeout=5),
            await client.decode.Load(common_pb2.LoadRequest(), timeout=5))


async def _wait_idle(client, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        pl, dl = await _load(client)
        if pl.kv_usage == 0 and dl.kv_usage == 0 and dl.reserved == 0 and dl.running == 0:
            return pl, dl
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: prefill {pl} decode {dl}")
        await asyncio.sleep(0.1)


async def test_greedy_equals_colocated_engine(client):
    want = _colocated(PROMPTS, GREEDY)
    results = await asyncio.gather(*(client.generate(f"g{i}", p, GREEDY)
                                     for i, p in enumerate(PROMPTS)))
    for i, (toks, msgs) in enumerate(results):
        assert toks == want[i], f"prompt {i}"
        assert msgs[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert msgs[-1].num_generated == GREEDY.max_tokens
    # a repeated prompt hits prefill's prefix cache and still decodes the same
    toks, _ = await client.generate("again", PROMPTS[2], GREEDY)
    assert toks == want[2]
    await _wait_idle(client)


async def test_cancel_mid_stream_frees_blocks_on_both(client):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    _, _, call = await client.start("cancel-me", PROMPTS[1], params)
    assert await take_tokens(call, 3) >= 3
    _, dl = await _load(client)
    assert dl.kv_usage > 0
    call.cancel()
    await _wait_idle(client)


async def test_unused_reservation_expires(client):
    res = await client.decode.Reserve(decode_pb2.ReserveRequest(
        request_id="never", num_prompt_tokens=30, timeout_ms=300), timeout=5)
    assert len(res.ticket.block_ids) == 2 and res.ticket.layout.num_layers == 2
    _, dl = await _load(client)
    assert dl.reserved == 1 and dl.kv_usage > 0
    await _wait_idle(client)
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the expired ticket is gone
        call = client.decode.Decode(decode_pb2.DecodeRequest(
            request_id="never", transfer_id=res.ticket.transfer_id, prompt_token_ids=[1],
            first_token_id=1, params=common_pb2.RequestParams(max_tokens=2)), timeout=5)
        async for _ in call:
            pass
    assert e.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)


async def test_bad_input_is_invalid_argument(client):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.decode.Reserve(decode_pb2.ReserveRequest(request_id="big", num_prompt_tokens=999))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.value.details()
    res = await client.decode.Reserve(decode_pb2.ReserveRequest(request_id="oov", num_prompt_tokens=3))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="oov", prompt_token_ids=[1, 2, 100000],
            params=common_pb2.RequestParams(max_tokens=4), ticket=res.ticket))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in e.value.details()
    bad_params = common_pb2.RequestParams(max_tokens=4, sampling=generate_pb2.SamplingParams(top_p=3))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="oov", prompt_token_ids=[1, 2, 3], params=bad_params, ticket=res.ticket))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:  # prompt length != the reservation's
        await client.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="oov", prompt_token_ids=[1, 2, 3, 4, 5],
            params=common_pb2.RequestParams(max_tokens=4), ticket=res.ticket))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reservation" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _ = [m async for m in client.decode.Decode(decode_pb2.DecodeRequest(
            request_id="oov", transfer_id=res.ticket.transfer_id, prompt_token_ids=[1, 2],
            first_token_id=1, params=common_pb2.RequestParams(max_tokens=4)), timeout=5)]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reserved 3" in e.value.details()
    # the bad Decode failed the transfer and freed its blocks
    r = await client.decode.Release(decode_pb2.ReleaseRequest(request_id="oov",
                                                              transfer_id=res.ticket.transfer_id))
    assert not r.found
    await _wait_idle(client)


async def test_health_reflection_metrics(services):
    for p in services:
        async with grpc.aio.insecure_channel(p.address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name async for r in stream for s in r.list_services_response.service]
            assert any(n.startswith("splitserve.internal.v1.") for n in names), names
        body = urllib.request.urlopen(f"http://127.0.0.1:{p.metrics_port}/metrics", timeout=5).read()
        assert b"splitserve_kv_cache_usage_ratio" in body


async def test_killed_decode_errors_within_seconds(services):
    pre, _ = services
    dec = harness.start_service("decode_svc")
    c = Client(pre.address, dec.address)
    try:
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        _, _, call = await c.start("doomed", PROMPTS[0], params)
        async for _m in call:
            break
        dec.popen.kill()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _m in call:
                pass
        assert time.monotonic() - t0 < 5
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    finally:
        await c.close()
        dec.stop()


async def test_abort_rpc_ends_stream_and_frees(client):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    _, _, call = await client.start("abort-me", PROMPTS[0], params)
    async for _m in call:
        break
    r = await client.decode.Abort(decode_pb2.ReleaseRequest(request_id="abort-me"), timeout=5)
    assert r.found
    msgs = [m async for m in call]
    assert msgs[-1].finish_reason == generate_pb2.FINISH_REASON_ABORT
    await _wait_idle(client)
    r = await client.decode.Abort(decode_pb2.ReleaseRequest(request_id="abort-me"), timeout=5)
    assert not r.found  # idempotent


async def test_params_logprobs_text_pass_through(client):
    want = _colocated([PROMPTS[1]], GREEDY)[0]
    # stop at the 4th greedy token (by id): the engine must see the params prefill/decode got
    stop_at = want[3]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,), logprobs=2)
    _, pre, call = await client.start("lp", PROMPTS[1], params, detokenize=True)
    assert pre.first_logprob.token_id == pre.first_token_id and len(pre.first_logprob.top) == 2
    assert pre.num_prompt_tokens == len(PROMPTS[1])
    toks, text, msgs = [pre.first_token_id], "", []
    async for m in call:
        toks += m.token_ids
        text += m.text
        msgs.append(m)
    assert toks == want[:want.index(stop_at) + 1]
    assert msgs[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    assert sum(len(m.logprobs) for m in msgs) == len(toks) - 1
    assert all(lp.top[0].logprob >= lp.top[1].logprob for m in msgs for lp in m.logprobs)
    # streamed text deltas == a one-shot decode of the same ids
    assert text == _tokenizer().decode(toks)
    await _wait_idle(client)


async def test_prefill_to_dead_decode_is_unavailable_and_frees(client):
    res = await client.decode.Reserve(decode_pb2.ReserveRequest(request_id="lost", num_prompt_tokens=20))
    ticket = common_pb2.TransferTicket()
    ticket.CopyFrom(res.ticket)
    ticket.decode_address = "127.0.0.1:1"  # nobody listens there
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="lost", prompt_token_ids=list(range(20)),
            params=common_pb2.RequestParams(max_tokens=4), ticket=ticket), timeout=20)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "transfer" in e.value.details()
    r = await client.decode.Release(decode_pb2.ReleaseRequest(request_id="lost"), timeout=5)
    assert r.found
    await _wait_idle(client)


async def test_second_decode_for_one_transfer_is_not_found(client):
    ticket, pre, call = await client.start("twice", PROMPTS[0], GREEDY)
    _ = [m async for m in call]
    again = client.decode.Decode(decode_pb2.DecodeRequest(
        request_id="twice", transfer_id=ticket.transfer_id, prompt_token_ids=PROMPTS[0],
        first_token_id=pre.first_token_id, params=common_pb2.RequestParams(max_tokens=3)), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _ = [m async for m in again]
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    await _wait_idle(client)


async def test_reserve_retry_replaces_unclaimed_reservation(client):
    """The gateway retries on another prefill replica: Reserve again for the same id while the
    old reservation's Release is still in flight. The new one wins; nothing leaks."""
    first = await client.decode.Reserve(decode_pb2.ReserveRequest(request_id="retry", num_prompt_tokens=20))
    second = await client.decode.Reserve(decode_pb2.ReserveRequest(request_id="retry", num_prompt_tokens=20))
    late = await client.decode.Release(decode_pb2.ReleaseRequest(
        request_id="retry", transfer_id=first.ticket.transfer_id), timeout=5)
    assert not late.found  # the old ticket was already replaced: must not free the new blocks
    _, dl = await _load(client)
    assert dl.reserved == 1
    pp = common_pb2.RequestParams(max_tokens=5, ignore_eos=True,
                                  sampling=generate_pb2.SamplingParams(temperature=0))
    pre = await client.prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id="retry", prompt_token_ids=PROMPTS[1][:20], params=pp, ticket=second.ticket), timeout=20)
    call = client.decode.Decode(decode_pb2.DecodeRequest(
        request_id="retry", transfer_id=second.ticket.transfer_id, prompt_token_ids=PROMPTS[1][:20],
        first_token_id=pre.first_token_id, params=pp), timeout=20)
    toks = [pre.first_token_id] + [t async for m in call for t in m.token_ids]
    want = _colocated([PROMPTS[1][:20]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert toks == want
    await _wait_idle(client)


@pytest.mark.skipif(harness.DEVICE == "cpu", reason="CUDA graphs exist only on a GPU (SPLITSERVE_TEST_DEVICE=cuda)")
async def test_gpu_decode_serves_through_captured_graphs(client, services):
    """On a GPU the decode service captures its batch buckets at start and serves decode steps
    by replaying them: its /metrics show captured graphs and decode replays growing."""
    _, dec = services

    def scrape() -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{dec.metrics_port}/metrics", timeout=5).read()
        out = {}
        for line in strip_model_name(body.decode()).splitlines():
            if line.startswith("splitserve_cuda_graph"):
                k, _, v = line.rpartition(" ")
                out[k] = float(v)
        return out

    before = scrape()
    assert before.get("splitserve_cuda_graphs_captured", 0) > 0, before
    toks, _ = await client.generate("graphs", PROMPTS[1], GREEDY)
    assert toks == _colocated([PROMPTS[1]], GREEDY)[0]
    key = 'splitserve_cuda_graph_replays_by_kind_total{kind="decode"}'
    want = before.get(key, 0) + GREEDY.max_tokens - 1
    deadline = time.monotonic() + 10  # the service refreshes its metrics from the engine every 1 s
    while (after := scrape()).get(key, 0) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
    assert after.get(key, 0) >= want, (before, after)
    print({k: v for k, v in after.items() if "captured" in k or "replays" in k})
