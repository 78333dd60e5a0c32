"""Replica pools and routing: several prefill and decode replicas (address lists), their
load polled periodically (Load RPC), requests sent where the predicted delay is least.

A replica whose call failed with UNAVAILABLE is marked down and tried only after the healthy
ones; the next successful Load poll brings it back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from gateway.admission import LoadView, Predictor

log = logging.getLogger("splitserve.gateway.routing")

def _channel_options() -> list:
    from common.grpc_util import channel_options

    # NOTE: short reconnect backoff so a restarted replica is found again quickly
    return channel_options() + [("grpc.initial_reconnect_backoff_ms", 200),
                                ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class Replica:
    address: str
    role: str  # "prefill" | "decode"
    stub: object = None
    channel: object = None
    load: LoadView = field(default_factory=LoadView)
    healthy: bool = True
    last_poll: float = 0.0
    last_error: str = ""

    def add_inflight(self, tokens: int) -> None:
        self.load.inflight_tokens += tokens
        self.load.inflight_requests += 1

    def done_inflight(self, tokens: int) -> None:
        self.load.inflight_tokens = max(0, self.load.inflight_tokens - tokens)
        self.load.inflight_requests = max(0, self.load.inflight_requests - 1)

    def mark_down(self, err: str) -> None:
        if self.healthy:
            log.warning("%s replica %s marked down: %s", self.role, self.address, err)
        self.healthy = False
        self.last_error = err


def load_view_from_pb(pb, keep: LoadView | None = None) -> LoadView:
    """LoadStats -> LoadView, keeping the gateway's own in-flight bookkeeping."""
    v = LoadView(queued_tokens=int(pb.queued_tokens), running=int(pb.running),
                 waiting=int(pb.waiting), kv_usage=float(pb.kv_usage),
                 num_free_blocks=int(pb.num_free_blocks) if pb.num_total_blocks else None,
                 mean_step_ms=float(pb.mean_step_ms) or None,
                 tokens_per_s=float(pb.tokens_per_s) or None)
    if keep is not None:
        v.inflight_tokens, v.inflight_requests = keep.inflight_tokens, keep.inflight_requests
    return v


def order_prefill(replicas: list[Replica], predictor: Predictor, num_tokens: int) -> list[Replica]:
    """Healthy replicas by predicted TTFT (least first), then the down ones as a last resort."""
    def key(r: Replica):
        return (not r.healthy, predictor.prefill_ms(r.load, num_tokens)[0], r.address)
    return sorted(replicas, key=key)


def order_decode(replicas: list[Replica], predictor: Predictor) -> list[Replica]:
    """Healthy replicas with free KV first, by predicted TPOT, then KV usage."""
    def key(r: Replica):
        full = r.load.num_free_blocks == 0
        return (not r.healthy, full, predictor.tpot_ms(r.load)[0], r.load.kv_usage, r.address)
    return sorted(replicas, key=key)


class ReplicaPool:
    def __init__(self, role: str, addresses: list[str], stub_cls, on_update=None, metrics=None):
        if not addresses:
            raise ValueError(f"at least one {role} address is needed")
        self.role = role
        self.replicas = []
        for a in addresses:
            ch = grpc.aio.insecure_channel(a, options=_channel_options())
            self.replicas.append(Replica(a, role, stub_cls(ch), ch))
        self._on_update = on_update  # called after every poll round (admission re-decides)
        self._task: asyncio.Task | None = None
        self._metrics = metrics  # common.metrics.ServiceMetrics (per-replica gauges) or None

    async def poll_once(self, timeout_s: float = 1.0) -> None:
        from protos import common_pb2

        async def one(r: Replica):
            try:
                pb = await r.stub.Load(common_pb2.LoadRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                r.mark_down(f"Load: {e.code().name}: {e.details()}")
                return
            if not r.healthy:
                log.info("%s replica %s is back", self.role, r.address)
            r.healthy, r.last_error, r.last_poll = True, "", time.monotonic()
            r.load = load_view_from_pb(pb, r.load)
        await asyncio.gather(*(one(r) for r in self.replicas))
        if self._metrics is not None:
            m = self._metrics
            for r in self.replicas:
                lbl = {"role": self.role, "replica": r.address}
                m.replica_up.labels(**lbl).set(1 if r.healthy else 0)
                m.replica_kv_usage.labels(**lbl).set(r.load.kv_usage)
                m.replica_queued_tokens.labels(**lbl).set(r.load.queued_tokens)
        if self._on_update:
            self._on_update()

    def start(self, interval_s: float) -> None:
        async def loop():
            while True:
                try:
                    await self.poll_once()
                except Exception:  # noqa: BLE001 - the poller must survive anything
                    log.exception("%s load poll failed", self.role)
                await asyncio.sleep(interval_s)
        self._task = asyncio.get_running_loop().create_task(loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for r in self.replicas:
            await r.channel.close()

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)
