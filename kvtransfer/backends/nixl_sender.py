"""nixl backend, prefill side: layers are copied into a registered staging buffer and
announced on the PairSession stream with their address; decode READs them. While the buffer
is more than half full, a layer's READ carries a notification that frees its range early (nixl.py:
the design, the decode side and the hazards).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from typing import Callable

import torch

from kvtransfer.backends.nixl import device_id, make_agent, parse_read_notif
from kvtransfer.backends.pair_client import PairClient, PairSendTransfer
from kvtransfer.backends.pair_sender import PairKVSender
from kvtransfer.endpoint import PairEndpoint
from kvtransfer.state import TransferError
from protos import kvtransfer_pb2


class _Staging:
    """First-fit ranges in one registered buffer."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf  # flat uint8
        self.size = buf.numel()
        self._used: dict[int, int] = {}  # offset -> nbytes
        self._freed = asyncio.Event()

    def try_alloc(self, n: int) -> int | None:
        off = 0
        for o, ln in sorted(self._used.items()):
            if o - off >= n:
                break
            off = o + ln
        if off + n > self.size:
            return None
        self._used[off] = n
        return off

    async def alloc(self, n: int, deadline: float, poll: Callable[[], None] = lambda: None) -> int:
        """poll(): frees ranges whose READs have finished (their notifications arrive only
        when asked for, so a full buffer polls them, backing off to 1 ms)."""
        if n > self.size:
            raise TransferError(f"a layer of {n} B exceeds the nixl staging buffer ({self.size} B)")
        pause = 50e-6
        while True:
            poll()
            off = self.try_alloc(n)
            if off is not None:
                return off
            self._freed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError("nixl staging buffer full (decode is not reading?)")
            try:
                await asyncio.wait_for(self._freed.wait(), min(left, pause))
            except (asyncio.TimeoutError, TimeoutError):
                pass
            pause = min(pause * 2, 1e-3)

    def used_bytes(self) -> int:
        return sum(self._used.values())

    def free(self, off: int) -> None:
        if self._used.pop(off, None) is not None:
            self._freed.set()


class NixlPairClient(PairClient):
    backend = "nixl"

    def __init__(self, channel, address, peer, local, op_timeout_s, connect_timeout_s, owner: "NixlKVSender"):
        super().__init__(channel, address, peer, local, op_timeout_s, connect_timeout_s)
        self.owner = owner
        self._q: asyncio.Queue = asyncio.Queue()
        self._stager: asyncio.Task | None = None

    def hello(self):
        return kvtransfer_pb2.PairHello(pair_id=self.pair_id, backend="nixl", device=self.local.device,
                                        device_uuid=self.local.device_uuid,
                                        timeout_ms=int(self.op_timeout_s * 1e3),
                                        nixl_metadata=self.owner.agent.get_agent_metadata())

    async def join(self, accept) -> None:
        self._stager = asyncio.get_running_loop().create_task(self._stage_loop())

    def send_layer(self, tx: PairSendTransfer, layer_idx, tensor, k_scale, v_scale) -> asyncio.Future:
        if self.broken is not None:
            raise TransferError(f"nixl pair with {self.address} is broken: {self.broken}")
        if tensor.device != self.owner.staging.buf.device:
            raise TransferError(f"layer on {tensor.device}, the nixl staging buffer is on "
                                f"{self.owner.staging.buf.device}")
        fut = asyncio.get_running_loop().create_future()
        self._q.put_nowait((tx, layer_idx, tensor, k_scale, v_scale, fut))
        return fut

    def commit(self, tx: PairSendTransfer) -> None:
        self._q.put_nowait((tx, None))  # NOTE: behind the layers still being staged

    async def _stage_loop(self) -> None:
        """Stage layers one at a time, in call order, so headers keep their seq order and the
        commit follows the last header."""
        while True:
            item = await self._q.get()
            if item[1] is None:
                super().commit(item[0])
                continue
            tx, li, tensor, ks, vs, fut = item
            if fut.done():
                continue
            try:
                nbytes = tensor.numel() * tensor.element_size()
                st = self.owner.staging
                off = await st.alloc(nbytes, tx.record.deadline if tx.record.deadline != float("inf")
                                     else time.monotonic() + self.op_timeout_s, self.owner.poll_reads)
                self.owner.ranges[tx.record.transfer_id].add(off)
                dst = st.buf[off:off + nbytes]
                src = tensor.contiguous().view(torch.uint8).reshape(-1)
                if dst.is_cuda:
                    await asyncio.to_thread(_copy_on_side_stream, dst, src)
                else:
                    dst.copy_(src)
                if self.broken is not None or tx.record.state.terminal:
                    self._unstage(tx.record.transfer_id, off)  # NOTE: its release may have run already
                    raise TransferError(f"transfer {tx.record.transfer_id} ended while staging")
                h = self.header(tx, li, tensor, ks, vs)
                h.remote_addr = st.buf.data_ptr() + off
                h.remote_device = device_id(st.buf.device)
                # NOTE: a READ with a notification completes only once the notification is
                # delivered (tcp: 0.1-30 ms on a loaded host), so only ask while staging fills
                h.notify_read = st.used_bytes() > st.size // 2
                self._seq += 1
                self.send_msg(kvtransfer_pb2.PairMsg(layer=h))
                fut.set_result(nbytes)
            except Exception as e:  # noqa: BLE001 - reported through the transfer
                if not fut.done():
                    fut.set_exception(e if isinstance(e, TransferError) else TransferError(repr(e)))

    def _unstage(self, tid: str, off: int) -> None:
        held = self.owner.ranges.get(tid)
        if held is not None:
            held.discard(off)
            if not held:
                del self.owner.ranges[tid]
        self.owner.staging.free(off)

    def release_transfer(self, tx: PairSendTransfer) -> None:
        for off in self.owner.ranges.pop(tx.record.transfer_id, ()):
            self.owner.staging.free(off)

    def close_data_path(self, reason: str, orderly: bool) -> None:
        if self._stager is not None:
            self._stager.cancel()


class NixlKVSender(PairKVSender):
    """Prefill side. agent: a nixl agent (default: a real one, created here)."""

    backend = "nixl"

    def __init__(self, local: PairEndpoint, staging_bytes: int = 256 << 20, agent=None, **kw):
        super().__init__(local, **kw)
        self.agent = agent if agent is not None else make_agent(f"prefill-{uuid.uuid4().hex[:8]}")
        buf = torch.empty(staging_bytes, dtype=torch.uint8, device=local.device)
        self._reg = self.agent.register_memory([buf])  # NOTE: once; the pool lives as long as we do
        self.staging = _Staging(buf)
        self.ranges: dict[str, set[int]] = defaultdict(set)  # transfer id -> its staged offsets

    def poll_reads(self) -> None:
        """Free the staging ranges whose READs decode reports done (nixl notifications). A
        notification for a transfer already released, or a range not (or no longer) its own,
        is ignored: that range was freed, and may belong to another transfer now."""
        base = self.staging.buf.data_ptr()
        for msgs in self.agent.get_new_notifs().values():
            for m in msgs:
                got = parse_read_notif(m)
                if got is None:
                    continue
                held = self.ranges.get(got[0])
                if held is not None and (got[1] - base) in held:
                    held.discard(got[1] - base)
                    self.staging.free(got[1] - base)

    def make_pair(self, channel, address, peer) -> NixlPairClient:
        return NixlPairClient(channel, address, peer, self.local, self.op_timeout_s,
                              self.connect_timeout_s, self)


def _copy_on_side_stream(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.cuda.stream(torch.cuda.Stream(dst.device)):
        dst.copy_(src)
        torch.cuda.current_stream().synchronize()
