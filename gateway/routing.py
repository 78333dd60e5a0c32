"""Replica pools and routing: several prefill and decode replicas (address lists), their
load polled periodically (Load RPC), requests sent where the predicted delay is least.

Prefix-aware prefill routing: `PrefixIndex` keeps, per prefill replica, an LRU set of the
chain hashes of the full prompt blocks the gateway sent there, hashed as engine/kv_cache.py
does (key_i = (hash_{i-1}, tokens of block i)), so a prompt's longest leading run of blocks
a replica likely still caches is known without asking it. A replica's predicted TTFT counts
only the tokens it would compute (prompt minus that run), which weighs a cache hit against
the replica's queue: a hit on a busy replica wins only while it is still predicted faster.

A replica whose call failed with UNAVAILABLE, or whose Load poll failed or timed out (dead,
frozen), is marked down and sent no new work; the next successful Load poll brings it back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from common.grpc_util import open_channel
from gateway.admission import LoadView, Prediction, Predictor
from gateway.prefill_clock import PrefillClock

log = logging.getLogger("splitserve.gateway.routing")

# a replica frozen (SIGSTOP, a long GC pause) up to ~this long keeps its streams: a dead one is
# found by its closed socket or the Load poll long before, so a longer ping wait costs nothing
KEEPALIVE_TIMEOUT_MS = 30_000


def _channel_options() -> list:
    from common.grpc_util import channel_options

    # NOTE: short reconnect backoff so a restarted replica is found again quickly
    opts = [o for o in channel_options() if o[0] != "grpc.keepalive_timeout_ms"]
    return opts + [("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


POOL_KV_BACKENDS = ("vmm", "shm")  # kvtransfer.endpoint.POOL_BACKENDS (the gateway loads no torch)


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
    tpot_slos: list[float] = field(default_factory=list)  # decode: of our requests it runs
    many: object = None  # decode: its DecodeMany call (gateway.decode_many), opened on first use
    # prefill: decode replicas its last handoff to went through a shared pool (vmm / shm), when
    # it takes tickets that follow the prompt (an older prefill does not: never sent them)
    pool_peers: set[str] = field(default_factory=set)
    clock: PrefillClock = field(default_factory=PrefillClock)  # its in-flight prompts by time

    def add_inflight(self, tokens: int) -> int:
        """-> the prompt's key in `clock` (for done_inflight)."""
        self.load.inflight_tokens += tokens
        self.load.inflight_requests += 1
        return self.clock.admit(tokens, time.monotonic())

    def done_inflight(self, tokens: int, key: int | None = None, finished: bool = False) -> None:
        """finished: its prefill ended with a first token (an engine step ended then)."""
        self.load.inflight_tokens = max(0, self.load.inflight_tokens - tokens)
        self.load.inflight_requests = max(0, self.load.inflight_requests - 1)
        self.clock.done(key, time.monotonic(), finished)

    def tightest_tpot_ms(self) -> float | None:
        """decode: the tightest TPOT SLO among the requests it runs: ours at once, every
        gateway's (other workers' too) as its last Load reported them."""
        slos = [*self.tpot_slos, *((self.load.min_tpot_ms,) if self.load.min_tpot_ms else ())]
        return min(slos) if slos else None

    def mark_down(self, err: str) -> None:
        if self.healthy:
            log.warning("%s replica %s marked down: %s", self.role, self.address, err)
        self.healthy = False
        self.last_error = err


@dataclass
class Route:
    """What admission chose for one request: its prefill replica (holding `inflight` of the
    replica's in-flight tokens from the admit decision until its Prefill call ends), the
    prompt tokens expected from that replica's prefix cache, and the prediction it was
    admitted on; and its decode replica, whose `tpot_slos` hold its TPOT SLO while it runs
    there (admission keeps later requests from slowing it past that)."""
    hashes: list[int] | None = None
    prefill: Replica | None = None
    cached: int = 0
    inflight: int = 0
    inflight_key: int | None = None  # its entry in the replica's PrefillClock
    prediction: Prediction | None = None
    t_decided: float = 0.0
    decode: Replica | None = None
    tpot_slo: float | None = None
    admitted: bool = False
    # its Prefill went to a replica with nothing else of ours in flight (prefilled `here`:
    # nothing else of ours was waiting for its first token there at the admit decision)
    alone: bool = False
    # --prefill-on-decode: the decode replica admission predicted it prefills there; its
    # in-flight tokens are counted there (until the first token) instead of on `prefill`
    here: Replica | None = None

    def settle(self, finished: bool = False) -> None:
        """Its prompt is no longer in flight; finished: prefilled, with a first token."""
        r = self.here if self.here is not None else self.prefill
        if r is not None and self.inflight:
            r.done_inflight(self.inflight, self.inflight_key, finished)
            self.inflight, self.inflight_key = 0, None

    def hold_decode(self, decode: Replica, tpot_slo: float | None) -> None:
        if tpot_slo is not None and self.decode is None:
            self.decode, self.tpot_slo = decode, tpot_slo
            decode.tpot_slos.append(tpot_slo)

    def release_decode(self) -> None:
        if self.decode is not None:
            self.decode.tpot_slos.remove(self.tpot_slo)
            self.decode = None


def load_view_from_pb(pb, keep: LoadView | None = None) -> LoadView:
    """LoadStats -> LoadView, keeping the gateway's own in-flight bookkeeping."""
    v = LoadView(queued_tokens=int(pb.queued_tokens), running=int(pb.running),
                 waiting=int(pb.waiting), kv_usage=float(pb.kv_usage),
                 num_free_blocks=int(pb.num_free_blocks) if pb.num_total_blocks else None,
                 num_total_blocks=int(pb.num_total_blocks) or None,
                 mean_step_ms=float(pb.mean_step_ms) or None,
                 tokens_per_s=float(pb.tokens_per_s) or None, device_id=pb.device_id,
                 max_num_seqs=int(pb.max_num_seqs) or None,
                 max_batched_tokens=int(pb.max_num_batched_tokens) or None,
                 min_tpot_ms=float(pb.min_tpot_ms) or None)
    if keep is not None:
        v.inflight_tokens, v.inflight_requests = keep.inflight_tokens, keep.inflight_requests
    return v


class PrefixIndex:
    """Block-prefix hash chains the gateway routed to each replica (an LRU per replica).

    A replica's set holds at most its KV block count (from Load; `default_capacity` before
    that): the engine evicts cached blocks in LRU order too, so older entries are the ones
    it no longer holds. The block size is learned from decode's tickets (`set_block_size`);
    a change clears the index."""

    def __init__(self, block_size: int = 16, default_capacity: int = 4096):
        self.block_size = block_size
        self.default_capacity = default_capacity
        self._sets: dict[str, OrderedDict] = {}

    def set_block_size(self, block_size: int) -> None:
        if block_size > 0 and block_size != self.block_size:
            self.block_size = block_size
            self._sets.clear()

    def hashes(self, ids: list[int]) -> list[int]:
        """Chain hashes of the prompt's full blocks."""
        bs, out, parent = self.block_size, [], None
        for i in range(len(ids) // bs):
            parent = hash((parent, tuple(ids[i * bs:(i + 1) * bs])))
            out.append(parent)
        return out

    def match(self, address: str, hashes: list[int], num_tokens: int) -> int:
        """Prompt tokens the replica is expected to hold: its longest leading run of blocks,
        at most (num_tokens - 1) // block_size of them (the last token is always computed)."""
        s = self._sets.get(address)
        if not s:
            return 0
        n = 0
        for h in hashes[:(num_tokens - 1) // self.block_size]:
            if h not in s:
                break
            n += 1
        return n * self.block_size

    def record(self, address: str, hashes: list[int], capacity: int | None = None) -> None:
        s = self._sets.setdefault(address, OrderedDict())
        for h in hashes:
            s[h] = None
            s.move_to_end(h)
        cap = capacity or self.default_capacity
        while len(s) > cap:
            s.popitem(last=False)

    def forget(self, address: str) -> None:
        """A replica that restarted holds nothing."""
        self._sets.pop(address, None)


def order_prefill(replicas: list[Replica], predictor: Predictor, num_tokens: int,
                  cached: dict[str, int] | None = None) -> list[Replica]:
    """Healthy replicas by predicted TTFT (least first), then the down ones as a last resort.
    cached: replica address -> prompt tokens its prefix cache is expected to hold."""
    cached = cached or {}

    def key(r: Replica):
        return (not r.healthy, predictor.prefill_ms(r.load, num_tokens, cached.get(r.address, 0))[0],
                -cached.get(r.address, 0), r.address)
    return sorted(replicas, key=key)


def order_decode(replicas: list[Replica], predictor: Predictor) -> list[Replica]:
    """Healthy replicas with free KV first, by predicted TPOT, then KV usage."""
    def key(r: Replica):
        full = r.load.num_free_blocks == 0
        return (not r.healthy, full, predictor.tpot_ms(r.load)[0], r.load.kv_usage, r.address)
    return sorted(replicas, key=key)


class ReplicaPool:
    def __init__(self, role: str, addresses: list[str], stub_cls, on_update=None, metrics=None,
                 auth=None):
        if not addresses:
            raise ValueError(f"at least one {role} address is needed")
        self.role = role
        self.replicas = []
        for a in addresses:
            ch = open_channel(a, auth, _channel_options())  # auth: common.auth.InternalAuth
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
            if r.many is not None:
                r.many.close()
            await r.channel.close()

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)
