"""dist backend: KV layers move GPU to GPU (NCCL) or host to host (gloo) with torch.distributed
point-to-point ops over one two-rank group per prefill/decode pair; open / layer headers /
commit / abort / acks stay on gRPC (KVTransfer.PairSession, see kvtransfer.proto).

Prefill side:  DistKVSender (a PairKVSender) -> DistPairClient per decode address: sends the
               hello, joins the group as rank 0, sends each layer's bytes on the group thread.
Decode side:   DistRendezvous (the TCPStore pairs meet on, advertised in Reserve tickets) and
               DistPlane (joins as rank 1, one recv per header, in header order), used by
               kvtransfer.backends.pair_service.KVTransferService.

Devices: gloo on CPU caches, NCCL on CUDA caches; KV stays on its device (no host staging for
NCCL). A mixed pair (one side on CPU) is not offered; prefill falls back to grpc.

Hazards:
- NOTE: layers travel as flat uint8 views of their storage: NCCL has no fp8 dtype before
  2.19 and gloo none at all (nor bf16 for every op); the header carries dtype and shape, and
  the receiver views the bytes back, so fp8 / bf16 round-trip bit for bit.
- NOTE: the rendezvous is agreed at handshake: the store address comes from decode's ticket,
  the pair id (the store key prefix) from prefill's hello, the ranks are fixed (prefill 0,
  decode 1). A reconnect uses a new pair id, so keys of a dead group never mix in.
- NOTE: the TCPStore has no authentication of its own: it listens on the service's bind host
  only, and a pair's keys sit under a prefix keyed by the internal secret
  (common.auth.InternalAuth.store_prefix), which a stranger on the store cannot guess.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import threading

import torch

from kvtransfer.backends.dist_group import PairGroup
from kvtransfer.backends.pair_client import PairClient
from kvtransfer.backends.pair_sender import PairKVSender
from kvtransfer.backends.pair_service import RecvPlane
from kvtransfer.endpoint import PairEndpoint, pair_transport, same_gpu
from kvtransfer.state import TransferError
from protos import kvtransfer_pb2

log = logging.getLogger("splitserve.kvtransfer.dist")


class _GroupSide:
    """Either side's hold on its pair group (None until the pair is made)."""

    group: PairGroup | None = None

    def close_group(self, reason: str, orderly: bool) -> None:
        if self.group is not None:
            self.group.close(reason, orderly=orderly)

    async def wait_closed(self) -> None:
        if self.group is not None:
            await asyncio.to_thread(self.group.join)


# ---- prefill side -----------------------------------------------------------------------
class DistPairClient(_GroupSide, PairClient):
    backend = "dist"

    def __init__(self, channel, address, peer, local, op_timeout_s, connect_timeout_s, host: str,
                 auth=None):
        super().__init__(channel, address, peer, local, op_timeout_s, connect_timeout_s)
        self.host = host
        self.auth = auth
        self.transport = pair_transport(local.device)
        self.group: PairGroup | None = None

    def hello(self) -> kvtransfer_pb2.PairHello:
        return kvtransfer_pb2.PairHello(pair_id=self.pair_id, backend=self.transport,
                                        device=self.local.device, device_uuid=self.local.device_uuid,
                                        timeout_ms=int(self.op_timeout_s * 1e3))

    async def join(self, accept) -> None:
        loop = asyncio.get_running_loop()

        def broken(reason: str) -> None:  # group thread -> event loop
            loop.call_soon_threadsafe(self.fail, reason)

        # NOTE: blocks until decode's rank 1 joins (it starts after sending accept) or the
        # timeout; the thread cannot be cancelled, so its own timeout bounds it.
        self.group = await asyncio.wait_for(asyncio.to_thread(
            PairGroup.create, self.peer.store_address, self.pair_id, 0, self.transport,
            self.local.device, self.host, self.connect_timeout_s, broken,
            store_key=_store_key(self.auth, self.pair_id)), self.connect_timeout_s + 5)

    def start_send(self, header, tensor: torch.Tensor) -> asyncio.Future:
        g = self.group
        if tensor.device != g.device:
            raise TransferError(f"layer on {tensor.device}, but this {g.backend} pair moves {g.device} tensors")
        raw = tensor.contiguous().view(torch.uint8).reshape(-1)  # NOTE: bytes, whatever the dtype
        return asyncio.wrap_future(g.submit_send(raw, self.op_timeout_s))

    def close_data_path(self, reason: str, orderly: bool) -> None:
        self.close_group(reason, orderly)


class DistKVSender(PairKVSender):
    """KVSender over torch.distributed pairs. host: the address this process's gloo side
    listens on (the service's bind host; empty -> gloo's default interface)."""

    backend = "dist"

    def __init__(self, local: PairEndpoint, host: str = "", **kw):
        super().__init__(local, **kw)
        self.host = host

    def make_pair(self, channel, address, peer) -> DistPairClient:
        return DistPairClient(channel, address, peer, self.local, self.op_timeout_s,
                              self.connect_timeout_s, self.host, self.auth)


# ---- decode side ------------------------------------------------------------------------
class DistRendezvous:
    """The TCPStore prefill/decode pair groups meet on; decode hosts it, tickets name it."""

    def __init__(self, advertise_host: str, port: int = 0, timeout_s: float = 30.0,
                 bind_host: str | None = None):
        import torch.distributed as dist

        # NOTE: TCPStore alone listens on every interface; a socket bound here confines it to
        # the service's bind host (bind_host, default advertise_host)
        fd = _listen_fd(bind_host or advertise_host, port)
        self.store = dist.TCPStore(advertise_host, port, None, True,
                                   datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                   master_listen_fd=fd)
        self.address = f"{advertise_host}:{self.store.port}"
        log.info("kv pair rendezvous store on %s", self.address)

    def close(self) -> None:
        """Call after every pair group that met here is gone (PairGroup.join)."""
        self.store = None


class DistPlane(_GroupSide, RecvPlane):
    """Decode's data side of one dist pair: rank 1 of the group, one recv per header."""

    backend = "dist"

    POOL = 8  # CPU receive buffers kept for reuse

    def __init__(self, rendezvous: DistRendezvous, local: PairEndpoint, host: str = "",
                 default_timeout_s: float = 30.0, auth=None):
        self.rendezvous = rendezvous
        self.auth = auth
        self.local = local
        self.host = host
        self.timeout_s = default_timeout_s
        self.group: PairGroup | None = None
        self._pool: list[torch.Tensor] = []
        self._pool_lock = threading.Lock()  # taken on the group thread, returned on the loop

    async def accept(self, hello) -> kvtransfer_pb2.PairAccept:
        want = pair_transport(self.local.device)
        if hello.backend != want:
            raise TransferError(f"decode's KV cache is on {self.local.device}, which pairs over "
                                f"{want}; prefill offered {hello.backend!r}")
        if same_gpu(PairEndpoint(hello.device, hello.device_uuid), self.local):
            raise TransferError(f"prefill and decode share GPU {self.local.device}: NCCL cannot "
                                "pair two ranks on one GPU")
        if hello.timeout_ms:
            self.timeout_s = hello.timeout_ms / 1e3
        return kvtransfer_pb2.PairAccept()

    async def join(self, hello) -> None:
        self.group = await asyncio.wait_for(asyncio.to_thread(
            PairGroup.create, self.rendezvous.address, hello.pair_id, 1, hello.backend,
            self.local.device, self.host, self.timeout_s,
            store_key=_store_key(self.auth, hello.pair_id)), self.timeout_s + 5)

    def post(self, header, request_id: str | None) -> asyncio.Future:
        n = int(header.nbytes)
        # NOTE: CPU only. A fresh host buffer per layer pays a page fault per 4 KiB on first
        # touch (on a VM that capped gloo at ~0.35 GB/s); CUDA has its caching allocator.
        alloc = self._buffer if self.local.device_type == "cpu" else None
        return asyncio.wrap_future(self.group.submit_recv(n, self.timeout_s, alloc))

    def _buffer(self, n: int) -> torch.Tensor:
        """A pooled buffer of >= n bytes (called on the group thread as the recv is issued)."""
        with self._pool_lock:
            fits = [i for i, b in enumerate(self._pool) if b.numel() >= n]
            if fits:  # NOTE: by index: list.remove would compare tensors elementwise
                return self._pool.pop(min(fits, key=lambda i: self._pool[i].numel()))
        return torch.empty(-(-n // (1 << 20)) << 20, dtype=torch.uint8)  # 1 MiB steps

    def recycle(self, data: torch.Tensor) -> None:
        base = data._base if data._base is not None else data
        if base.device.type == "cpu" and base.dim() == 1 and base.dtype == torch.uint8:
            with self._pool_lock:
                self._pool.append(base)
                if len(self._pool) > self.POOL:
                    self._pool.pop(min(range(len(self._pool)), key=lambda i: self._pool[i].numel()))

    def close(self, reason: str, orderly: bool) -> None:
        self.close_group(reason, orderly)


def _store_key(auth, pair_id: str) -> str:
    return auth.store_prefix(pair_id) if auth is not None else pair_id


def _listen_fd(host: str, port: int) -> int:
    """A listening socket on host:port; -> its fd, handed over to the TCPStore."""
    import socket

    family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)
    return sock.detach()  # NOTE: the store owns the fd from here (no double close)
