"""dist backend between two real processes over gloo (CPU): byte-exact round trips (bf16, fp32,
fp8 as bytes + scales; 1, 3 and 5 layers; scattered multi-block layouts), concurrent transfers
on one pair, refused layers drained without breaking the pair, and failures that must end
FAILED within their timeouts instead of hanging: a killed receiver, a frozen receiver, an
unreachable rendezvous store."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import torch

from engine.kv_blocks import KVBlocks
from kvtransfer import KVLayout, TransferError, TransferState, send_blocks
from kvtransfer.backends.dist import DistKVSender
from kvtransfer.backends.pair_client import PairUnavailable
from kvtransfer.endpoint import PairEndpoint
from kvtransfer.loopback import ReceiverProc
from tests.kvtransfer._util import random_blocks

pytestmark = pytest.mark.timeout(60)

LAYOUTS = {
    "bf16-3": KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bf16", block_size=16),
    "fp32-1": KVLayout(num_layers=1, num_kv_heads=4, head_dim=16, dtype="fp32", block_size=16),
    "fp8-5": KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, dtype="fp8_e4m3", block_size=32),
}


@pytest.fixture(scope="module")
def receivers():
    """One receiver process per layout, booted in parallel."""
    procs = {k: ReceiverProc.spawn(lay, num_blocks=640 if k == "fp32-1" else 32, wait=False)
             for k, lay in LAYOUTS.items()}
    try:
        yield {k: p.wait_ready() for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture
async def sender():
    s = DistKVSender(PairEndpoint("cpu"), host="127.0.0.1", op_timeout_s=10, connect_timeout_s=10)
    yield s
    await s.close()


def _blocks(layout: KVLayout, n_blocks: int, seed: int) -> KVBlocks:
    return random_blocks(layout, n_blocks, seed, short=5)


def _assert_landed(rp: ReceiverProc, rid: str, kv: KVBlocks) -> None:
    for i, t in enumerate(kv.layers):
        assert rp.read(rid, i, kv.num_blocks) == t.view(torch.uint8).numpy().tobytes(), f"layer {i}"


@pytest.mark.parametrize("key", list(LAYOUTS))
async def test_round_trip_byte_exact(receivers, sender, key):
    rp, layout = receivers[key], LAYOUTS[key]
    kv = _blocks(layout, 4, seed=1)
    rp.expect(f"t-{key}", f"r-{key}", [7, 2, 11, 0], kv.num_tokens)  # scattered block ids
    tx = await sender.open(rp.address, f"t-{key}", f"r-{key}", layout, kv.num_tokens, 20, peer=rp.endpoint)
    for i in reversed(range(layout.num_layers)):  # any layer order
        tx.send_layer(i, kv.layers[i], kv.k_scales and kv.k_scales[i], kv.v_scales and kv.v_scales[i])
    assert await tx.finish() == kv.nbytes()
    assert tx.state is TransferState.DONE
    assert rp.wait(f"t-{key}") == ("done", None)
    _assert_landed(rp, f"r-{key}", kv)
    if layout.dtype == "fp8_e4m3":
        ks, vs = rp.scales(f"r-{key}")
        assert ks == pytest.approx(kv.k_scales) and vs == pytest.approx(kv.v_scales)
    rp.claim(f"t-{key}")


async def test_concurrent_transfers_on_one_pair_do_not_mix(receivers, sender):
    rp, layout = receivers["bf16-3"], LAYOUTS["bf16-3"]
    a, b = _blocks(layout, 2, seed=2), _blocks(layout, 5, seed=3)
    rp.expect("ta", "ra", [3, 4], a.num_tokens)
    rp.expect("tb", "rb", [20, 9, 21, 8, 22], b.num_tokens)
    txa = await sender.open(rp.address, "ta", "ra", layout, a.num_tokens, 20, peer=rp.endpoint)
    txb = await sender.open(rp.address, "tb", "rb", layout, b.num_tokens, 20, peer=rp.endpoint)
    # interleaved on the one pair, as two requests prefilled in one batch would be
    for tx, kv, i in ((txa, a, 0), (txb, b, 0), (txb, b, 1), (txa, a, 1), (txb, b, 2), (txa, a, 2)):
        tx.send_layer(i, kv.layers[i])
    na, nb = await asyncio.gather(txb.finish(), txa.finish())
    assert (na, nb) == (b.nbytes(), a.nbytes())
    assert sender.num_pairs_made == 1
    _assert_landed(rp, "ra", a)
    _assert_landed(rp, "rb", b)
    rp.claim("ta")
    rp.claim("tb")


async def test_big_layers_of_mixed_sizes_reuse_receive_buffers(receivers, sender):
    """Layers of 1-4 MiB, interleaved: the receiver's buffer pool must hand each recv its own
    buffer of the right size and never reuse one still being written."""
    rp, layout = receivers["fp32-1"], LAYOUTS["fp32-1"]
    sizes = {"m1": 200, "m2": 300, "m3": 130}  # blocks of 8 KiB (the receiver holds 640)
    kvs, txs, start = {}, {}, 0
    for i, (rid, n) in enumerate(sizes.items()):
        kvs[rid] = _blocks(layout, n, seed=10 + i)
        rp.expect(f"t-{rid}", rid, list(range(start, start + n))[::-1], kvs[rid].num_tokens)
        start += n
        txs[rid] = await sender.open(rp.address, f"t-{rid}", rid, layout, kvs[rid].num_tokens, 30,
                                     peer=rp.endpoint)
    for rid in ("m2", "m1", "m3"):
        txs[rid].send_layer(0, kvs[rid].layers[0])
    await asyncio.gather(*(tx.finish() for tx in txs.values()))
    for rid, kv in kvs.items():
        _assert_landed(rp, rid, kv)
        rp.claim(f"t-{rid}")


async def test_refused_transfers_are_drained_and_the_pair_survives(receivers, sender):
    rp, layout = receivers["bf16-3"], LAYOUTS["bf16-3"]
    kv = _blocks(layout, 3, seed=4)
    with pytest.raises(TransferError, match="unknown transfer"):
        await send_blocks(sender, rp.address, "never-reserved", "rx", kv, layout, 20, peer=rp.endpoint)
    rp.expect("small", "r-small", [1, 2], 20)  # 3 blocks into a 2-block reservation
    with pytest.raises(TransferError, match="reserved"):
        await send_blocks(sender, rp.address, "small", "r-small", kv, layout, 20, peer=rp.endpoint)
    assert rp.wait("small")[0] == "failed"
    deadline = time.monotonic() + 5
    while "r-small" not in rp.released() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert "r-small" in rp.released()
    # every refused layer was drained: the same pair still moves a good transfer byte-exact
    rp.expect("good", "r-good", [5, 6, 7], kv.num_tokens)
    assert await send_blocks(sender, rp.address, "good", "r-good", kv, layout, 20, peer=rp.endpoint) == kv.nbytes()
    _assert_landed(rp, "r-good", kv)
    assert sender.num_pairs_made == 1
    rp.claim("good")


@contextlib.asynccontextmanager
async def _own_receiver(n_blocks: int, seed: int, op_timeout_s: float, timeout_s: float):
    """A receiver process of its own (to kill or freeze) and a sender with transfer t1 of
    n_blocks open to it -> (receiver, sender, blocks, transfer)."""
    layout = LAYOUTS["bf16-3"]
    rp = ReceiverProc.spawn(layout, num_blocks=32)
    s = DistKVSender(PairEndpoint("cpu"), host="127.0.0.1", op_timeout_s=op_timeout_s,
                     connect_timeout_s=5)
    try:
        kv = _blocks(layout, n_blocks, seed=seed)
        rp.expect("t1", "r1", list(range(n_blocks)), kv.num_tokens)
        tx = await s.open(rp.address, "t1", "r1", layout, kv.num_tokens, timeout_s, peer=rp.endpoint)
        yield rp, s, kv, tx
    finally:
        await s.close()
        rp.kill()


async def test_killed_receiver_fails_the_sender_within_its_timeout():
    async with _own_receiver(3, seed=5, op_timeout_s=5, timeout_s=8) as (rp, s, kv, tx):
        tx.send_layer(0, kv.layers[0])
        await asyncio.sleep(0.3)  # layer 0 moved; the receiver dies mid-transfer
        rp.kill()
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            tx.send_layer(1, kv.layers[1])
            tx.send_layer(2, kv.layers[2])
            await tx.finish()
        assert time.monotonic() - t0 < 8
        assert tx.state is TransferState.FAILED
        # the broken pair is gone; a new one cannot be made with a dead decode: unavailable
        t0 = time.monotonic()
        with pytest.raises(PairUnavailable):
            await s.open(rp.address, "t2", "r2", LAYOUTS["bf16-3"], kv.num_tokens, 8, peer=rp.endpoint)
        assert time.monotonic() - t0 < 7
        assert s.unusable(rp.address) is not None  # remembered: prefill falls back to grpc


async def test_frozen_receiver_times_out_instead_of_hanging():
    """SIGSTOP: the peer's sockets stay open but nothing answers -> the op timeout fires."""
    async with _own_receiver(2, seed=6, op_timeout_s=2, timeout_s=20) as (rp, s, kv, tx):
        os.kill(rp.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            for i, layer in enumerate(kv.layers):
                tx.send_layer(i, layer)
            with pytest.raises(TransferError, match="broken|timed out|Timed out"):
                await tx.finish()
            assert time.monotonic() - t0 < 6
        finally:
            os.kill(rp.proc.pid, signal.SIGCONT)


async def test_unreachable_store_is_pair_unavailable(receivers):
    rp = receivers["fp32-1"]
    s = DistKVSender(PairEndpoint("cpu"), host="127.0.0.1", op_timeout_s=2, connect_timeout_s=2)
    try:
        bad = PairEndpoint("cpu", store_address="127.0.0.1:1")  # nobody listens there
        t0 = time.monotonic()
        with pytest.raises(PairUnavailable, match="pair"):
            await s.open(rp.address, "t9", "r9", LAYOUTS["fp32-1"], 16, 5, peer=bad)
        # bounded by connect_timeout_s + 5 (torch's store client retries with its own backoff)
        assert time.monotonic() - t0 < 2 + 5 + 1.5
        assert "failed" in s.unusable(rp.address)
    finally:
        await s.close()


def test_receive_buffer_pool_reuses_the_smallest_fit():
    from kvtransfer.backends.dist import DistPlane

    plane = DistPlane(None, PairEndpoint("cpu"))
    a, b, c = plane._buffer(3 << 20), plane._buffer(1 << 20), plane._buffer(2 << 20)
    for t in (a, b, c):
        plane.recycle(t[:10])  # what recv hands out is a view of the pooled buffer
    assert plane._buffer(1_500_000) is c
    assert plane._buffer(10) is b
    assert plane._buffer(10) is a
    assert plane._buffer(5 << 20).numel() == 5 << 20  # nothing left: a new one
