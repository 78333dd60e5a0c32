"""KVPusher: prefill's side of one request's KV transfer.

    route = pusher.route(ticket)          # backend for this decode (+ start pairing early)
    nbytes, backend = await pusher.push(route, ticket, rid, layers)   # layers: asyncio.Queue

`layers` receives engine.layer_stream.LayerExport items, layer 0 first, while the prompt's
last forward still runs; each is sent as soon as it arrives, so the transfer overlaps the
compute of later layers. The transfer opens at the first layer (a request the engine refuses
never touches decode's reservation).

Pool backends (vmm, shm) move no layers from here: once the prompt's forward is done, `handoff`
names the request's blocks in prefill's shared pool and decode copies them (one call).

Every backend sends the prompt's blocks from ticket.num_cached_blocks on: decode already holds
the leading ones (its prefix cache); the layer stream skips them at the gather, the handoff
and its grpc fallback here.

Backend choice: the service's --kv-transfer-backend when decode's ticket accepts it and the
pair can use it (kvtransfer.endpoint.choose_backend; `auto`: the pool backend on one host),
else grpc. A fallback is logged (once per
decode and reason) and counted in splitserve_kv_transfer_fallbacks{reason}; a pair that cannot
be set up falls back at open time, before any byte was sent. A failure after that fails the
request (decode already freed the reservation); it is never retried on another backend.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvtransfer.backends.pair_client import PairUnavailable
from kvtransfer.backends.pool_share import PoolUnreachable
from kvtransfer.base import KVSender, send_blocks
from kvtransfer.endpoint import POOL_BACKENDS, PairEndpoint, choose_backend, ticket_backends
from kvtransfer.state import KVLayout

log = logging.getLogger("splitserve.prefill.kv")


@dataclass
class Route:
    backend: str
    sender: KVSender
    peer: PairEndpoint | None = None


class KVPusher:
    def __init__(self, senders: dict[str, KVSender], want: str, local: PairEndpoint,
                 layout: KVLayout, metrics, timeout_s: float = 30.0):
        if "grpc" not in senders:
            raise ValueError("the grpc sender is required (it is every pair's fallback)")
        if want != "auto" and want not in senders:
            raise ValueError(f"no sender for the selected backend {want!r}")
        self.senders = senders
        self.want = want
        self.local = local
        self.layout = layout
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._warned: set[tuple[str, str]] = set()

    def route(self, ticket) -> Route:
        accepted, peer = ticket_backends(ticket)
        c = choose_backend(self.want, accepted, peer, self.local)
        if c.code is not None:
            self._fallback(ticket.decode_address, c.code, c.why)
            return Route("grpc", self.senders["grpc"])
        if c.backend == "grpc" or c.backend not in self.senders:  # auto without a shared pool
            return Route("grpc", self.senders["grpc"])
        sender = self.senders[c.backend]
        down = sender.unusable(ticket.decode_address)
        if down is not None:
            self._fallback(ticket.decode_address, "pair_unavailable", down)
            return Route("grpc", self.senders["grpc"])
        sender.prepare(ticket.decode_address, peer)  # pair up while the prompt runs
        return Route(c.backend, sender, peer)

    def _fallback(self, address: str, code: str, why: str) -> None:
        self.metrics.kv_transfer_fallbacks.labels(reason=code).inc()
        if (address, code) not in self._warned:  # NOTE: once per decode and reason, not per request
            self._warned.add((address, code))
            log.warning("kv transfer to %s falls back to grpc (selected: %s): %s", address, self.want, why)

    async def push(self, route: Route, ticket, request_id: str, layers: asyncio.Queue,
                   metadata: tuple = ()) -> tuple[int, str]:
        """Send the layers as they come; -> (bytes sent, backend used). Raises TransferError."""
        tx = None
        try:
            for _ in range(self.layout.num_layers):
                x = await layers.get()
                if tx is None:
                    tx, route = await self._open(route, ticket, request_id, x.num_tokens, metadata)
                t = x.tensor
                if x.event is not None:
                    # CUDA: wait for this layer's gather only (later layers keep computing); a
                    # host-bound backend copies it on a side stream, off the event loop
                    t = await asyncio.to_thread(x.host if route.backend == "grpc" else _waited(x))
                tx.send_layer(x.layer_idx, t, x.k_scale, x.v_scale)
            nbytes = await tx.finish()
        except BaseException:
            if tx is not None:
                await tx.abort("prefill failed")
            raise
        self.metrics.kv_transfers.labels(backend=route.backend).inc()
        return nbytes, route.backend

    @staticmethod
    def is_pool(route: Route) -> bool:
        return route.backend in POOL_BACKENDS

    @staticmethod
    def proven(route: Route, ticket) -> bool:
        """A pool route whose decode took our last handoff: the answer need not wait for this one."""
        ok = getattr(route.sender, "proven", None)
        return ok is not None and ok(ticket.decode_address)

    async def handoff(self, route: Route, ticket, request_id: str, engine, num_tokens: int,
                      metadata: tuple = (), block_ids: list[int] | None = None) -> tuple[int, str]:
        """Pool backends, after the prompt's forward: decode copies the request's blocks
        (`block_ids`: from the engine's final output) from our pool. -> (bytes, backend).
        A decode that cannot map the pool gets the KV over grpc."""
        skip = ticket.num_cached_blocks
        ids = block_ids if block_ids is not None else await engine.reserved_block_ids(request_id)
        ids = ids[skip:]
        ks = vs = None
        if self.layout.dtype == "fp8_e4m3":
            ks, vs = await engine.kv_scale_lists()
        try:
            nbytes = await route.sender.handoff(ticket.decode_address, ticket.transfer_id, ids,
                                                num_tokens, ks, vs, self.timeout_s, metadata)
        except PoolUnreachable as e:  # nothing was touched on decode: send it the old way
            self._fallback(ticket.decode_address, "pool_unreachable", str(e))
            return await self.send_exported(ticket, request_id, engine, metadata)
        self.metrics.kv_transfers.labels(backend=route.backend).inc()
        return nbytes, route.backend

    async def send_exported(self, ticket, request_id: str, engine, metadata: tuple = ()
                            ) -> tuple[int, str]:
        """After the prompt's forward, without a layer stream: the request's blocks (from
        ticket.num_cached_blocks on) exported from the engine and sent over grpc."""
        blocks = await engine.export_kv(request_id, ticket.num_cached_blocks)
        nbytes = await send_blocks(self.senders["grpc"], ticket.decode_address, ticket.transfer_id,
                                   request_id, blocks, self.layout, self.timeout_s, metadata)
        self.metrics.kv_transfers.labels(backend="grpc").inc()
        return nbytes, "grpc"

    async def _open(self, route: Route, ticket, rid: str, num_tokens: int, metadata):
        args = (ticket.decode_address, ticket.transfer_id, rid, self.layout, num_tokens,
                self.timeout_s, metadata)
        try:
            return await route.sender.open(*args, peer=route.peer), route
        except PairUnavailable as e:  # nothing sent yet: grpc takes over
            self._fallback(ticket.decode_address, "pair_unavailable", str(e))
            g = Route("grpc", self.senders["grpc"])
            return await g.sender.open(*args), g

    async def close(self) -> None:
        for s in self.senders.values():
            await s.close()


def _waited(x):
    def fn():
        x.wait()
        return x.tensor
    return fn
