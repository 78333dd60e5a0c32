"""CUDA VMM KV pools between two real processes on one GPU: byte-exact mapping, block copies
into a local pool, the owner's death seen by the peer, and no device memory left behind after
repeated owner kills (SPLITSERVE_VMM_KILLS, default 10)."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from engine.kv_memory import allocate_pool  # noqa: E402
from kvtransfer.backends.pool import copy_blocks  # noqa: E402
from kvtransfer.backends.pool_share import PoolServer, attach  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS, BLOCKS, BLOCK_BYTES = 4, 64, 16 * 8 * 128 * 2


def _owner(q, seed: int) -> None:
    pool = allocate_pool(LAYERS * 2 * BLOCKS * BLOCK_BYTES, "cuda:0", shareable=True)
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, generator=g, device="cuda:0",
                                    dtype=torch.uint8))
    torch.cuda.synchronize()
    server = PoolServer(pool, {"num_layers": LAYERS, "num_blocks": BLOCKS, "block_bytes": BLOCK_BYTES})
    q.put(server.address)
    time.sleep(300)


def _expected(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    n = LAYERS * 2 * BLOCKS * BLOCK_BYTES
    return torch.randint(0, 256, (n,), generator=g, device="cuda:0",
                         dtype=torch.uint8).view(LAYERS * 2, BLOCKS, BLOCK_BYTES)


def _spawn(seed: int):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_owner, args=(q, seed), daemon=True)
    p.start()
    return p, q.get(timeout=120)


def test_peer_maps_copies_and_sees_the_owner_die():
    proc, address = _spawn(3)
    try:
        peer = attach(address, "cuda:0")
        want = _expected(3)
        assert torch.equal(peer.blocks, want)
        dst = torch.zeros(LAYERS * 2, 16, BLOCK_BYTES, dtype=torch.uint8, device="cuda:0")
        s = torch.cuda.Stream()
        copy_blocks(peer.blocks, [63, 0, 17], dst, [2, 9, 4], s)
        assert torch.equal(dst[:, [2, 9, 4]], want[:, [63, 0, 17]])
        proc.kill()
        assert peer.dead.wait(10)
        peer.close()
    finally:
        proc.kill()


def test_no_device_memory_left_after_repeated_owner_kills():
    kills = int(os.environ.get("SPLITSERVE_VMM_KILLS", "10"))
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    for i in range(kills):
        proc, address = _spawn(i)
        peer = attach(address, "cuda:0")
        assert peer.blocks[0, 0, :4].numel() == 4
        proc.kill()
        assert peer.dead.wait(10)
        peer.close()
        proc.join(30)
    time.sleep(1.0)
    torch.cuda.synchronize()
    leaked = free0 - torch.cuda.mem_get_info()[0]
    print(f"vmm: {kills} owner kills, device memory not returned: {leaked / 2**20:.1f} MiB")
    assert leaked < 64 << 20, f"{leaked / 2**20:.1f} MiB of device memory not returned after {kills} kills"
