"""gRPC KV transfer over a real loopback server: byte-exact round trips (bf16, fp32, fp8 +
scales), out-of-order completion, and failures (dead sender, partial stream, timeout, bad data)
that must end FAILED with the reserved blocks released."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from common.grpc_util import channel_options, create_server
from kvtransfer import KVLayout, KVReceiver, TransferError, TransferState, send_blocks
from kvtransfer.backends.grpc import GrpcKVSender, KVTransferServicer
from engine.kv_blocks import KVBlocks
from tests.kvtransfer._util import random_blocks
from protos import kvtransfer_pb2, kvtransfer_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class FakeSink:
    """Stands in for the engine: a per-layer paged cache, writes land in reserved blocks."""

    def __init__(self, layout: KVLayout, num_blocks: int = 32):
        self.cache = [torch.zeros(layout.layer_shape(num_blocks), dtype=layout.torch_dtype)
                      for _ in range(layout.num_layers)]
        self.block_ids: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.scales: dict[str, tuple[list[float], list[float]]] = {}

    async def write_layer(self, request_id, layer_idx, tensor, num_tokens):
        await asyncio.sleep(0)  # like AsyncEngine.call: a real suspension point
        ids = torch.tensor(self.block_ids[request_id][:tensor.shape[1]])
        # NOTE: index_copy_ has no fp8 kernel on CPU; copy the raw bytes
        self.cache[layer_idx].view(torch.uint8).index_copy_(1, ids, tensor.view(torch.uint8))

    async def write_scales(self, request_id, k_scales, v_scales):
        self.scales[request_id] = (k_scales, v_scales)

    async def release(self, request_id, transfer_id):
        self.released.append(request_id)

    def read(self, request_id, layer_idx, n_blocks):
        ids = torch.tensor(self.block_ids[request_id][:n_blocks])
        return self.cache[layer_idx].view(torch.uint8).index_select(1, ids)


def _layout(dtype="bf16", layers=3):
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=16)


def _random_blocks(layout: KVLayout, n_blocks: int, seed: int) -> KVBlocks:
    return random_blocks(layout, n_blocks, seed, short=3)


async def _serve(receiver):
    server = create_server()
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def rig(request):
    layout = _layout(getattr(request, "param", "bf16"))
    sink = FakeSink(layout)
    rx = KVReceiver(sink, layout, default_timeout_s=10, reap_interval_s=0.05)
    server, addr = await _serve(rx)
    sender = GrpcKVSender(chunk_bytes=1024)  # small chunks: every layer spans several
    yield layout, sink, rx, sender, addr
    await sender.close()
    await rx.close()
    await server.stop(0)


def _reserve(sink, rx, tid, rid, block_ids, n_tokens):
    sink.block_ids[rid] = block_ids
    return rx.expect(tid, rid, len(block_ids), n_tokens)


@pytest.mark.parametrize("rig", ["bf16", "fp32", "fp8_e4m3"], indirect=True)
async def test_round_trip_byte_exact(rig):
    layout, sink, rx, sender, addr = rig
    kv = _random_blocks(layout, 3, seed=1)
    _reserve(sink, rx, "t1", "r1", [7, 2, 11], kv.num_tokens)
    # layer-by-layer, out of order: the receiver must not care
    tx = await sender.open(addr, "t1", "r1", layout, kv.num_tokens)
    for i in (2, 0, 1):
        tx.send_layer(i, kv.layers[i], kv.k_scales and kv.k_scales[i], kv.v_scales and kv.v_scales[i])
    n = await tx.finish()
    assert n == kv.nbytes() and tx.state is TransferState.DONE
    t = await rx.wait("t1", timeout_s=5)
    assert t.state is TransferState.DONE and t.layers_done == {0, 1, 2}
    for i in range(layout.num_layers):
        got = sink.read("r1", i, 3)
        assert torch.equal(got, kv.layers[i].view(torch.uint8)), f"layer {i}"
    if layout.dtype == "fp8_e4m3":
        assert sink.scales["r1"] == (pytest.approx(kv.k_scales), pytest.approx(kv.v_scales))
    rx.claim("t1")
    assert sink.released == []


async def test_concurrent_transfers_complete_out_of_order(rig):
    layout, sink, rx, sender, addr = rig
    a, b = _random_blocks(layout, 2, seed=2), _random_blocks(layout, 4, seed=3)
    _reserve(sink, rx, "ta", "ra", [0, 1], a.num_tokens)
    _reserve(sink, rx, "tb", "rb", [5, 6, 7, 8], b.num_tokens)
    txa = await sender.open(addr, "ta", "ra", layout, a.num_tokens)
    txa.send_layer(0, a.layers[0])  # a stalls after one layer ...
    assert await send_blocks(sender, addr, "tb", "rb", b, layout) == b.nbytes()  # ... b finishes
    assert rx.get("tb").state is TransferState.DONE
    assert rx.get("ta").state is not TransferState.DONE
    for i in (1, 2):
        txa.send_layer(i, a.layers[i])
    await txa.finish()
    await rx.wait("ta", 5)
    for rid, kv, n in (("ra", a, 2), ("rb", b, 4)):
        for i in range(layout.num_layers):
            assert torch.equal(sink.read(rid, i, n), kv.layers[i].view(torch.uint8))


async def test_sender_dies_mid_transfer_fails_and_releases(rig):
    layout, sink, rx, sender, addr = rig
    kv = _random_blocks(layout, 2, seed=4)
    _reserve(sink, rx, "t1", "r1", [3, 4], kv.num_tokens)
    tx = await sender.open(addr, "t1", "r1", layout, kv.num_tokens)
    tx.send_layer(0, kv.layers[0])
    for _ in range(100):  # wait until the receiver has seen data
        if rx.get("t1").state is TransferState.TRANSFERRING:
            break
        await asyncio.sleep(0.02)
    assert rx.get("t1").state is TransferState.TRANSFERRING
    await tx.abort("simulated crash")  # the RPC is cancelled mid-stream
    with pytest.raises(TransferError, match="failed"):
        await rx.wait("t1", timeout_s=5)
    await asyncio.sleep(0.05)
    assert sink.released == ["r1"]
    assert tx.state is TransferState.FAILED


async def test_partial_stream_without_commit_fails(rig):
    layout, sink, rx, sender, addr = rig
    _reserve(sink, rx, "t1", "r1", [1], 16)
    layer = torch.zeros(layout.layer_shape(1), dtype=layout.torch_dtype)
    raw = layer.view(torch.uint8).reshape(-1).numpy().tobytes()

    async def half():  # half of layer 0, then the stream just ends
        yield kvtransfer_pb2.KVChunk(transfer_id="t1", layer_index=0, byte_offset=0,
                                     data=raw[:len(raw) // 2], layer_nbytes=len(raw),
                                     dtype=layout.dtype, shape=list(layer.shape))

    async with grpc.aio.insecure_channel(addr, options=channel_options()) as ch:
        ack = await kvtransfer_pb2_grpc.KVTransferStub(ch).PushKV(half())
    assert not ack.ok and "before commit" in ack.message
    assert rx.get("t1").state is TransferState.FAILED
    await asyncio.sleep(0.05)
    assert sink.released == ["r1"]


async def test_reservation_times_out_and_releases(rig):
    layout, sink, rx, sender, addr = rig
    sink.block_ids["r1"] = [0]
    rx.expect("t1", "r1", 1, 16, timeout_s=0.2)
    with pytest.raises(TransferError, match="timed out"):
        await rx.wait("t1", timeout_s=5)
    await asyncio.sleep(0.05)
    assert sink.released == ["r1"]
    # a late sender is refused, and nothing is released twice
    kv = _random_blocks(layout, 1, seed=5)
    with pytest.raises(TransferError):
        await send_blocks(sender, addr, "t1", "r1", kv, layout)
    assert sink.released == ["r1"]


async def test_bad_layout_and_unknown_transfer_are_refused(rig):
    layout, sink, rx, sender, addr = rig
    _reserve(sink, rx, "t1", "r1", [0, 1], 20)
    wrong = _random_blocks(_layout("fp32"), 2, seed=6)  # receiver holds bf16
    with pytest.raises(TransferError, match="dtype"):
        await send_blocks(sender, addr, "t1", "r1", wrong, layout)
    assert rx.get("t1").state is TransferState.FAILED
    too_many = _random_blocks(layout, 3, seed=7)  # 3 blocks into a 2-block reservation
    _reserve(sink, rx, "t2", "r2", [4, 5], 20)
    with pytest.raises(TransferError, match="reserved"):
        await send_blocks(sender, addr, "t2", "r2", too_many, layout)
    with pytest.raises(TransferError, match="unknown transfer"):
        await send_blocks(sender, addr, "nope", "r3", too_many, layout)
    await asyncio.sleep(0.05)
    assert sorted(sink.released) == ["r1", "r2"]


async def test_dead_receiver_fails_sender_quickly():
    layout = _layout()
    sender = GrpcKVSender(chunk_bytes=1024)
    kv = _random_blocks(layout, 1, seed=8)
    with pytest.raises(TransferError, match="UNAVAILABLE|DEADLINE"):
        await send_blocks(sender, "127.0.0.1:1", "t1", "r1", kv, layout, timeout_s=5)
    assert sender.get("t1").state is TransferState.FAILED
    await sender.close()


def test_send_records_are_bounded_and_carry_the_deadline():
    from kvtransfer.state import SendRecords

    recs = SendRecords(keep=2)
    a = recs.open("a", "ra", timeout_s=5.0)
    assert a.deadline == a.created + 5.0 and recs.get("a") is a
    assert recs.open("b", "rb", None).deadline == float("inf")
    recs.open("c", "rc", None)
    assert recs.get("a") is None and recs.get("b") is not None and recs.get("c") is not None
