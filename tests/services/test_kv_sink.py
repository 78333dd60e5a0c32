"""KV from a real prefill engine, over the gRPC backend, into a real decode engine's reserved
blocks (Engine.import_kv through EngineKVSink): the decode engine's blocks read back byte-equal,
fp8 scales included."""
from __future__ import annotations

import os

import pytest
import torch

from common.grpc_util import create_server
from decode_svc.kv_sink import EngineKVSink
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from kvtransfer import KVLayout, KVReceiver, TransferState, send_blocks
from kvtransfer.backends.grpc import GrpcKVSender, KVTransferServicer
from protos import kvtransfer_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def _engine(kv_dtype):
    return Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                               cache=CacheConfig(num_blocks=24, kv_cache_dtype=kv_dtype),
                               device=DeviceConfig(os.environ.get("SPLITSERVE_TEST_DEVICE", "cpu"))))


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
async def test_engine_to_engine_blocks_byte_exact(kv_dtype):
    pre, dec = AsyncEngine(engine=_engine(kv_dtype)), AsyncEngine(engine=_engine(kv_dtype))
    await pre.start()
    await dec.start()
    info = dec.info()
    layout = KVLayout(info["num_layers"], info["num_kv_heads"], info["head_dim"], info["kv_dtype"],
                      info["block_size"])
    rx = KVReceiver(EngineKVSink(dec, layout.block_size), layout)
    server = create_server()
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(rx), server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    sender = GrpcKVSender(chunk_bytes=4096)
    try:
        prompt = list(range(5, 5 + 37))  # 3 blocks, the last one partial
        async for _ in pre.generate("r", prompt, SamplingParams(max_tokens=1), prefill_only=True):
            pass
        sent = await pre.call(lambda e: e.export_kv("r"))
        # the decode side reserves *other* block ids than prefill used
        await dec.call(lambda e: e.reserve("pad", 40))
        ids = await dec.call(lambda e: e.reserve("r", len(prompt)))
        rx.expect("t", "r", len(ids), len(prompt))
        n = await send_blocks(sender, addr, "t", "r", sent, layout)
        assert n == sent.nbytes()
        assert (await rx.wait("t", 5)).state is TransferState.DONE
        got = await dec.call(lambda e: e.export_kv("r"))
        assert got.dtype == sent.dtype == info["kv_dtype"]
        for a, b in zip(sent.layers, got.layers):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        if kv_dtype == "fp8_e4m3":
            assert sent.k_scales is not None and got.k_scales == pytest.approx(sent.k_scales)
            assert got.v_scales == pytest.approx(sent.v_scales)
        rx.claim("t")
    finally:
        await sender.close()
        await rx.close()
        await server.stop(0)
        await pre.stop()
        await dec.stop()


async def test_release_skips_a_reservation_a_newer_one_took_over():
    """EngineKVSink.release frees only the transfer that still owns the id; a retried Reserve
    (reserve_replacing) first frees what the old reservation held."""
    dec = AsyncEngine(engine=_engine("fp32"))
    await dec.start()
    try:
        owner = {"r": "t1"}
        sink = EngineKVSink(dec, dec.info()["block_size"], owner)
        first = await dec.reserve_replacing("r", 20)
        owner["r"] = "t2"  # what DecodeServicer.Reserve does for a retry
        second = await dec.reserve_replacing("r", 40)
        assert len(first) == 2 and len(second) == 3
        await sink.release("r", "t1")  # the old transfer's late release
        assert await dec.reserved_block_ids("r") == second and owner == {"r": "t2"}
        await sink.release("r", "t2")
        assert await dec.reserved_block_ids("r") == [] and owner == {}
    finally:
        await dec.stop()
