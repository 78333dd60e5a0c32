"""Pool backends: `vmm` (CUDA virtual memory: one GPU, or GPUs of one host) and `shm` (CPU
memory of one host). Prefill's KV pool is shareable memory (engine.kv_memory); decode maps it
once per prefill process and, per request, copies the prompt's blocks from prefill's pool into
the blocks it reserved: one gather/scatter over all layers, on decode's own copy stream (off
both engine threads), so no step waits and no byte crosses a wire or the host.

    prefill: sender = PoolKVSender(server, kind); nbytes = await sender.handoff(...)
    decode:  importer = PoolImporter(receiver, dst_blocks, block_ids_of, device, guard=guard)
             KVTransfer.PoolHandoff -> importer.handoff(...) -> DONE in the receiver

Hazards:
- NOTE: prefill must keep the request's blocks until the handoff returns (it releases them
  after); decode copies only between reception of the call and its answer.
- NOTE: a reservation freed while its copy runs would hand the copy's target to another
  request: each copy is counted in the InflightGuard that decode's GuardedSink waits on before
  it frees the request's blocks (kvtransfer.guard).
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext

import torch

from kvtransfer.backends.pool_share import PeerPool, PoolUnreachable, attach
from kvtransfer.guard import InflightGuard
from kvtransfer.receiver import KVReceiver
from kvtransfer.state import TransferError

log = logging.getLogger("splitserve.kvtransfer.pool")

MAX_RUNS = 8  # more runs than this: one gather + one scatter beats a copy per run


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """-> (src start, dst start, length) of the stretches where both id lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int],
                stream=None, wait: bool = True) -> None:
    """dst[:, dst_ids] = src[:, src_ids] over uint8 [layers * 2, blocks, block_bytes] views;
    CUDA: on `stream`, synchronized unless wait=False (then only launched). Contiguous
    stretches move as strided copies (each byte read and written once); scattered ids
    through a gather."""
    dev = dst.device
    if src.shape[-1] % 8 == 0:  # 8-byte elements: the copy kernels move 1-byte ones slowly
        src, dst = src.view(torch.int64), dst.view(torch.int64)
    runs = block_runs(src_ids, dst_ids)
    with torch.cuda.device(dev) if dev.type == "cuda" else nullcontext(), \
            torch.cuda.stream(stream) if dev.type == "cuda" else nullcontext():
        if len(runs) <= MAX_RUNS:
            for s, d, n in runs:
                dst[:, d:d + n].copy_(src[:, s:s + n])
        else:
            si = torch.tensor(src_ids, dtype=torch.long, device=dev)
            di = torch.tensor(dst_ids, dtype=torch.long, device=dev)
            dst.index_copy_(1, di, src.index_select(1, si))
    if dev.type == "cuda" and wait:
        (stream or torch.cuda.current_stream(dev)).synchronize()


INLINE_BYTES = 4 << 20  # CPU copies up to this size run on the event loop (a thread hop costs more)
POLL_S = 0.002          # CUDA: poll the copy's event this long, then wait for it on a thread


async def run_copy(src, src_ids, dst, dst_ids, stream) -> None:
    """copy_blocks without a thread hop where it is cheap: a CUDA copy is launched here and its
    event polled (a handoff of a few MiB takes tens of microseconds); a large CPU copy, or a
    CUDA one still running after POLL_S, is waited for on a worker thread."""
    if dst.device.type == "cuda":
        copy_blocks(src, src_ids, dst, dst_ids, stream, wait=False)
        ev = torch.cuda.Event()
        ev.record(stream)
        deadline = time.perf_counter() + POLL_S
        while not ev.query():
            if time.perf_counter() > deadline:
                await asyncio.to_thread(ev.synchronize)
                return
            await asyncio.sleep(0)
    elif len(src_ids) * src.shape[0] * src.shape[2] <= INLINE_BYTES:
        copy_blocks(src, src_ids, dst, dst_ids)
    else:
        await asyncio.to_thread(copy_blocks, src, src_ids, dst, dst_ids)


class PoolImporter:
    """Decode side: maps prefill pools on first use and runs each request's copy, counted in
    `guard` (the one decode's GuardedSink waits on; a fresh one when none is given)."""

    def __init__(self, receiver: KVReceiver, dst_blocks: torch.Tensor, block_ids_of, device,
                 attach_timeout_s: float = 5.0, guard: InflightGuard | None = None,
                 device_id: str = ""):
        self.receiver = receiver
        self.dst = dst_blocks                  # decode's pool: uint8 [layers * 2, blocks, block_bytes]
        self.block_ids_of = block_ids_of       # async (request_id) -> reserved block ids
        self.device = torch.device(device)
        self.attach_timeout_s = attach_timeout_s
        self.peers: dict[str, PeerPool] = {}
        self._users: dict[str, int] = {}       # address -> copies in flight from that pool
        self.guard = guard if guard is not None else InflightGuard()
        self._attaching: dict[str, asyncio.Task] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.bytes_moved = 0
        self.device_id = device_id             # LoadStats.device_id of our KV cache's device
        # mapped pools whose owner runs on our device (it time-slices the device with us); an
        # int other threads may read (decode's step pacer)
        self.num_local_peers = 0

    def _local(self, p: PeerPool) -> bool:
        return bool(self.device_id) and p.info.get("device_id") == self.device_id

    async def _peer(self, address: str, pool_id: str) -> PeerPool:
        p = self.peers.get(address)
        if p is not None and (p.dead.is_set() or p.pool_id != pool_id):
            self._drop(address)  # the owner restarted or exited: map its new pool
            p = None
        if p is None:
            task = self._attaching.get(address)
            if task is None:
                task = self._attaching[address] = asyncio.ensure_future(
                    asyncio.to_thread(attach, address, self.device, self.attach_timeout_s))
            try:
                p = await asyncio.shield(task)
            finally:
                self._attaching.pop(address, None)
            self._check_layout(p)
            loop = asyncio.get_running_loop()
            p.on_dead = lambda a=address: loop.call_soon_threadsafe(self._drop, a)
            old = self.peers.get(address)  # replaced while a copy from it runs
            self.num_local_peers += self._local(p) - (old is not None and self._local(old))
            self.peers[address] = p
            log.info("kv pool %s mapped (%s, %.1f MiB)", address, p.pool.kind, p.pool.meta.nbytes / 2**20)
        if p.pool_id != pool_id:
            raise PoolUnreachable(f"KV pool {address!r} is {p.pool_id}, the handoff names {pool_id}")
        return p

    def _check_layout(self, p: PeerPool) -> None:
        if p.blocks.shape[0] != self.dst.shape[0] or p.blocks.shape[2] != self.dst.shape[2]:
            p.close()
            raise PoolUnreachable(
                f"prefill's pool holds {p.blocks.shape[0] // 2} layers of {p.blocks.shape[2]} B "
                f"blocks, decode's {self.dst.shape[0] // 2} of {self.dst.shape[2]} B")

    def _drop(self, address: str) -> None:
        p = self.peers.get(address)
        if p is None:
            return
        if self._users.get(address, 0) == 0:
            self.peers.pop(address, None)
            self.num_local_peers -= self._local(p)
            p.close()
            log.info("kv pool %s unmapped (its owner is gone or replaced)", address)
        # else: the last copy from it unmaps it (_copy_done)

    async def handoff(self, transfer_id: str, address: str, pool_id: str, src_ids: list[int],
                      num_tokens: int, k_scales=(), v_scales=()) -> tuple[int, float]:
        """Copy a request's prompt blocks from prefill's pool; -> (bytes, copy ms). Raises
        PoolUnreachable (nothing touched: the pair falls back) or TransferError (FAILED)."""
        t = self.receiver.check_open(transfer_id)
        peer = await self._peer(address, pool_id)
        lay = self.receiver.layout
        n = -(-num_tokens // lay.block_size) - t.skip_blocks  # src_ids: from the first block sent
        # the ids from the reservation itself: asking the engine thread would wait out its step
        dst_ids = t.block_ids if t.block_ids is not None else list(await self.block_ids_of(t.request_id))
        if n < 1 or len(src_ids) < n or len(dst_ids) < n:
            self.receiver.fail(transfer_id, f"handoff of {num_tokens} tokens names {len(src_ids)} "
                               f"prefill blocks for {len(dst_ids)} reserved")
            raise TransferError(f"bad handoff for transfer {transfer_id}")
        src_ids = [int(b) for b in src_ids[:n]]
        if min(src_ids) < 0 or max(src_ids) >= peer.blocks.shape[1]:
            self.receiver.fail(transfer_id, "handoff names blocks outside prefill's pool")
            raise TransferError(f"bad block ids for transfer {transfer_id}")
        nbytes = n * self.dst.shape[0] * self.dst.shape[2]
        self.receiver.on_data(transfer_id, nbytes)
        t0 = time.perf_counter()
        # NOTE: the copy runs to its end even if this call is cancelled (prefill gone): the
        # blocks are freed only after it (guard), so nothing lands in reused blocks
        task = asyncio.ensure_future(run_copy(peer.blocks, src_ids, self.dst, dst_ids[:n], self._stream))
        self.guard.track(t.request_id, task)
        self._users[address] = self._users.get(address, 0) + 1
        task.add_done_callback(lambda _t, rid=t.request_id: self._copy_done(rid, _t, address, peer))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed copy fails this transfer only
            self.receiver.fail(transfer_id, f"pool copy failed: {e!r}")
            raise TransferError(f"pool copy for transfer {transfer_id} failed: {e!r}") from e
        copy_ms = (time.perf_counter() - t0) * 1e3
        shape = (2, n, lay.block_size, lay.num_kv_heads, lay.head_dim)
        fp8 = len(k_scales) == lay.num_layers
        for i in range(lay.num_layers):
            self.receiver.on_layer_landed(transfer_id, i, shape, lay.dtype,
                                          k_scales[i] if fp8 else None, v_scales[i] if fp8 else None)
        await self.receiver.on_commit(transfer_id)
        self.bytes_moved += nbytes
        return nbytes, copy_ms

    def _copy_done(self, rid: str, task, address: str, peer: PeerPool) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("kv pool copy for %s failed: %r", rid, task.exception())
        self._users[address] -= 1
        if self._users[address] == 0 and (peer.dead.is_set() or self.peers.get(address) is not peer):
            if self.peers.get(address) is peer:
                self._drop(address)
            else:
                peer.close()  # replaced while this copy ran

    def close(self) -> None:
        for a in list(self.peers):
            self.peers.pop(a).close()
        self.num_local_peers = 0
