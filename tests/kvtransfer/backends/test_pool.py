"""Pool backends on CPU: a memfd KV pool shared between two real processes over the abstract
Unix socket, byte-exact block copies, the handoff into a KVReceiver, and the owner's death."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest
import torch

from engine.kv_memory import allocate_pool
from kvtransfer.backends.pool import PoolImporter, block_runs, copy_blocks
from kvtransfer.backends.pool_share import PoolServer, PoolUnreachable, attach
from kvtransfer.guard import GuardedSink
from kvtransfer.receiver import KVReceiver
from kvtransfer.state import KVLayout, TransferError, TransferState

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bf16", block_size=4)
BLOCK_BYTES = LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2


def _info(n_blocks: int) -> dict:
    return {"num_layers": LAYOUT.num_layers, "num_blocks": n_blocks, "block_bytes": BLOCK_BYTES}


def _owner(q, n_blocks: int, seed: int, extra: dict | None = None) -> None:
    """Child process: a shared pool filled with a seeded pattern, served until killed."""
    pool = allocate_pool(LAYOUT.num_layers * 2 * n_blocks * BLOCK_BYTES, "cpu", shareable=True)
    g = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, generator=g, dtype=torch.uint8))
    server = PoolServer(pool, {**_info(n_blocks), **(extra or {})})
    q.put(server.address)
    time.sleep(120)


def _pattern(n_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = LAYOUT.num_layers * 2 * n_blocks * BLOCK_BYTES
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(-1, n_blocks, BLOCK_BYTES)


@pytest.fixture
def owner():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_owner, args=(q, 10, 7), daemon=True)
    p.start()
    address = q.get(timeout=60)
    yield p, address
    p.kill()
    p.join(10)


def test_peer_maps_the_owners_pool_byte_exact_and_sees_its_death(owner):
    proc, address = owner
    peer = attach(address, "cpu")
    assert torch.equal(peer.blocks, _pattern(10, 7))
    assert not peer.dead.is_set()
    proc.kill()
    assert peer.dead.wait(5), "the owner's exit must reach the peer"
    peer.close()


def test_attach_to_nothing_is_unreachable():
    with pytest.raises(PoolUnreachable):
        attach("splitserve-kvpool-no-such-owner", "cpu", timeout_s=1)


@pytest.mark.parametrize("src_ids,dst_ids", [
    ([9, 0, 4], [1, 6, 2]),                                  # scattered, few runs
    ([2, 3, 4, 7, 8], [0, 1, 2, 5, 6]),                      # two contiguous runs
    (list(range(0, 20, 2)), list(range(19, -1, -2))),        # more runs than MAX_RUNS: gather
])
def test_copy_blocks_matches_indexing(src_ids, dst_ids):
    src = torch.randint(0, 256, (6, 20, 32), dtype=torch.uint8)
    dst = torch.zeros(6, 20, 32, dtype=torch.uint8)
    copy_blocks(src, src_ids, dst, dst_ids)
    want = torch.zeros_like(dst)
    want[:, dst_ids] = src[:, src_ids]
    assert torch.equal(dst, want)


def test_block_runs():
    assert block_runs([2, 3, 4, 9], [5, 6, 7, 8]) == [(2, 5, 3), (9, 8, 1)]
    assert block_runs([], []) == []


class _Sink:
    def __init__(self):
        self.released, self.scales = [], None

    async def write_layer(self, *a):
        raise AssertionError("a pool handoff writes no layer through the sink")

    async def write_scales(self, rid, ks, vs):
        self.scales = (ks, vs)

    async def release(self, rid, tid):
        self.released.append(rid)


def _importer(dst_blocks: int, reserved: dict):
    sink = _Sink()
    rx = KVReceiver(sink, LAYOUT)
    dst = torch.zeros(LAYOUT.num_layers * 2, dst_blocks, BLOCK_BYTES, dtype=torch.uint8)

    async def ids_of(rid):
        return reserved[rid]

    imp = PoolImporter(rx, dst, ids_of, "cpu")
    rx.sink = GuardedSink(sink, imp.guard)
    return rx, imp, dst, sink


async def test_handoff_copies_the_prompt_blocks_and_completes_the_transfer(owner):
    _, address = owner
    peer_id = attach(address, "cpu")
    pool_id = peer_id.pool_id
    peer_id.close()
    rx, imp, dst, _ = _importer(8, {"r1": [5, 2, 7]})
    rx.expect("t1", "r1", num_blocks=3, num_tokens=10)
    nbytes, _ = await imp.handoff("t1", address, pool_id, [3, 8, 1, 9], 10)
    assert nbytes == 3 * LAYOUT.num_layers * 2 * BLOCK_BYTES
    src = _pattern(10, 7)
    assert torch.equal(dst[:, [5, 2, 7]], src[:, [3, 8, 1]])
    assert rx.get("t1").state is TransferState.DONE
    assert dst[:, [0, 1, 3, 4, 6]].count_nonzero() == 0  # nothing outside the reservation
    # the pool stays mapped for the next request
    rx.expect("t2", "r2", num_blocks=1, num_tokens=2)
    imp.block_ids_of = _const([0])
    await imp.handoff("t2", address, pool_id, [4], 2)
    assert torch.equal(dst[:, 0], src[:, 4])
    assert len(imp.peers) == 1
    imp.close()
    await rx.close()


def _const(v):
    async def f(_rid):
        return v
    return f


async def test_bad_handoffs_fail_the_transfer_and_free_its_blocks(owner):
    _, address = owner
    pool_id = _pool_id(address)
    rx, imp, _, sink = _importer(8, {"r1": [5, 2]})
    rx.expect("t1", "r1", num_blocks=2, num_tokens=8)
    with pytest.raises(TransferError):
        await imp.handoff("t1", address, pool_id, [3, 99], 8)  # block 99 is not in the pool
    await asyncio.sleep(0.05)
    assert rx.get("t1").state is TransferState.FAILED and sink.released == ["r1"]
    rx.expect("t2", "r2", num_blocks=2, num_tokens=8)
    imp.block_ids_of = _const([1, 2])
    with pytest.raises(PoolUnreachable):  # a stale pool id: prefill restarted
        await imp.handoff("t2", address, "0000", [1, 2], 8)
    assert rx.get("t2").state is TransferState.BOOTSTRAPPING  # untouched: the pair falls back
    imp.close()
    await rx.close()


def _pool_id(address: str) -> str:
    p = attach(address, "cpu")
    try:
        return p.pool_id
    finally:
        p.close()


async def test_release_waits_for_a_running_copy():
    rx, imp, _, sink = _importer(4, {})
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    imp.guard.track("r1", fut)  # as handoff counts its copy
    rel = loop.create_task(rx.sink.release("r1", "t1"))
    await asyncio.sleep(0.05)
    assert sink.released == []
    fut.set_result(None)
    await rel
    assert sink.released == ["r1"]
    await rx.close()


async def test_importer_counts_the_pools_whose_owner_shares_its_device():
    """decode's step pacer yields only to a prefill on its own device (PoolServer info
    device_id); the count drops when that owner dies."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_owner, args=(q, 10, 7, {"device_id": "cpu:host-a"}), daemon=True)
    p.start()
    try:
        address = q.get(timeout=60)
        peer = attach(address, "cpu")
        pool_id = peer.pool_id
        peer.close()
        for mine, want in (("cpu:host-b", 0), ("cpu:host-a", 1)):
            rx, imp, _, _ = _importer(8, {"r1": [1]})
            imp.device_id = mine
            rx.expect("t1", "r1", num_blocks=1, num_tokens=2)
            await imp.handoff("t1", address, pool_id, [3], 2)
            assert imp.num_local_peers == want, mine
            if want:
                p.kill()
                p.join(10)
                for _ in range(100):  # the watch thread sees EOF, the loop drops the mapping
                    if imp.num_local_peers == 0:
                        break
                    await asyncio.sleep(0.05)
                assert imp.num_local_peers == 0 and not imp.peers
                break
            imp.close()
            await rx.close()
    finally:
        p.kill()
        p.join(10)
