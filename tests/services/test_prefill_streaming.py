"""Prefill streams KV layer by layer: with a real engine behind the PrefillServicer, the sender
gets layer 0 while the forward of the last layer has not finished (that forward waits for it);
a failed transfer is UNAVAILABLE and frees prefill's blocks. KVPusher picks the backend per
ticket, falls back to grpc (counted by reason) and switches to grpc when a pair cannot be made."""
from __future__ import annotations

import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.metrics import ServiceMetrics
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from kvtransfer import KVLayout, KVSender, SendTransfer, Transfer, TransferError
from kvtransfer.backends.pair_client import PairUnavailable
from kvtransfer.endpoint import PairEndpoint
from prefill_svc.kv_push import KVPusher
from prefill_svc.servicer import PrefillServicer
from protos import common_pb2, prefill_pb2

pytestmark = pytest.mark.timeout(60)


class _Tx(SendTransfer):
    def __init__(self, sender, tid, rid):
        self.sender, self.record = sender, Transfer(tid, rid)
        self.nbytes = 0

    def send_layer(self, layer_idx, tensor, k_scale=None, v_scale=None):
        self.sender.events.append(f"{self.sender.backend} send {layer_idx}")
        self.nbytes += tensor.numel() * tensor.element_size()
        if layer_idx == 0:
            self.sender.first_layer.set()

    async def finish(self):
        if self.sender.fail_finish:
            raise TransferError("receiver refused: simulated")
        self.sender.events.append(f"{self.sender.backend} finish")
        return self.nbytes

    async def abort(self, reason):
        self.sender.events.append(f"{self.sender.backend} abort")


class RecordingSender(KVSender):
    def __init__(self, backend="grpc", events=None, unusable=None, open_error=None):
        self.backend = backend
        self.events = events if events is not None else []
        self.first_layer = threading.Event()
        self.fail_finish = False
        self._unusable = unusable
        self.open_error = open_error
        self.prepared = []

    async def open(self, address, transfer_id, request_id, layout, num_tokens, timeout_s=None,
                   metadata=None, *, peer=None):
        if self.open_error is not None:
            raise self.open_error
        self.events.append(f"{self.backend} open")
        return _Tx(self, transfer_id, request_id)

    def get(self, transfer_id):
        return None

    def unusable(self, address):
        return self._unusable

    def prepare(self, address, peer):
        self.prepared.append(address)


class Aborted(Exception):
    pass


class FakeContext:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(f"{code.name}: {details}")


def _engine():
    # on the CPU wherever the tests run: on a GPU a prompt this short replays a prefill CUDA
    # graph, which bypasses the per-layer hook (its layers are exported after the forward,
    # engine/layer_stream.py), so the overlap this file checks needs the eager forward
    return Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
                               cache=CacheConfig(num_blocks=32), device=DeviceConfig(device="cpu")))


def _layout(eng):
    i = eng.info()
    return KVLayout(i["num_layers"], i["num_kv_heads"], i["head_dim"], i["kv_dtype"], i["block_size"])


def _ticket(layout, n, backends=(), pair=None):
    t = common_pb2.TransferTicket(
        transfer_id="t1", decode_address="decode:1", block_size=layout.block_size, num_tokens=n,
        layout=common_pb2.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                   head_dim=layout.head_dim, dtype=layout.dtype),
        kv_backends=list(backends))
    if pair is not None:
        t.pair.CopyFrom(pair.to_pb())
    return t


def _metrics():
    return ServiceMetrics("prefill", CollectorRegistry())


async def test_layer_zero_is_sent_while_the_last_layer_still_computes():
    eng = _engine()
    sender = RecordingSender()
    last = eng.runner.model.layers[-1]
    orig = last.forward

    def gated(*a, **k):  # NOTE: the last layer does not finish until layer 0 went out
        out = orig(*a, **k)
        sender.events.append(f"last layer done, layer 0 sent before: {sender.first_layer.wait(10)}")
        return out

    last.forward = gated
    ae = AsyncEngine(engine=eng)
    await ae.start()
    try:
        layout = _layout(eng)
        pusher = KVPusher({"grpc": sender}, "grpc", PairEndpoint("cpu"), layout, _metrics())
        svc = PrefillServicer(ae, pusher, pusher.metrics)
        prompt = list(range(3, 40))
        resp = await svc.Prefill(prefill_pb2.PrefillRequest(
            request_id="r1", prompt_token_ids=prompt, ticket=_ticket(layout, len(prompt)),
            params=common_pb2.RequestParams(max_tokens=4)), FakeContext())
        n = layout.num_layers
        assert sender.events[:2] == ["grpc open", "grpc send 0"]
        assert "last layer done, layer 0 sent before: True" in sender.events
        assert sender.events.index("grpc send 0") < sender.events.index(
            "last layer done, layer 0 sent before: True") < sender.events.index(f"grpc send {n - 1}")
        assert sender.events[-1] == "grpc finish"
        assert resp.kv_backend == "grpc" and resp.kv_bytes == layout.layer_nbytes(3) * n
        await svc.settled()
        held = await ae.call(lambda e: (e.kv.block_ids("r1"), dict(e.requests)))
        assert held == ([], {})  # released after the ack
    finally:
        await ae.stop()


async def test_failed_transfer_is_unavailable_and_frees_prefill_blocks():
    eng = _engine()
    ae = AsyncEngine(engine=eng)
    await ae.start()
    try:
        layout = _layout(eng)
        sender = RecordingSender()
        sender.fail_finish = True
        pusher = KVPusher({"grpc": sender}, "grpc", PairEndpoint("cpu"), layout, _metrics())
        svc = PrefillServicer(ae, pusher, pusher.metrics)
        ctx = FakeContext()
        with pytest.raises(Aborted):
            await svc.Prefill(prefill_pb2.PrefillRequest(
                request_id="r1", prompt_token_ids=list(range(3, 30)), ticket=_ticket(layout, 27),
                params=common_pb2.RequestParams(max_tokens=4)), ctx)
        assert ctx.code == grpc.StatusCode.UNAVAILABLE and "simulated" in ctx.details
        used = await ae.call(lambda e: (e.kv.block_ids("r1"), dict(e.requests), dict(e.layer_streamer.callbacks)))
        assert used == ([], {}, {})
        # a bad token id: refused before any layer, so the transfer was never opened
        sender.events.clear()
        with pytest.raises(Aborted):
            await svc.Prefill(prefill_pb2.PrefillRequest(
                request_id="r2", prompt_token_ids=[1, 2, 10**6], ticket=_ticket(layout, 3),
                params=common_pb2.RequestParams(max_tokens=4)), ctx)
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and sender.events == []
        assert not await ae.call(lambda e: e.layer_streamer.callbacks)
    finally:
        await ae.stop()


def test_route_picks_dist_or_falls_back_with_a_reason():
    layout = KVLayout(2, 2, 16, "fp32", 16)
    m = _metrics()
    g, d = RecordingSender("grpc"), RecordingSender("dist")
    p = KVPusher({"grpc": g, "dist": d}, "dist", PairEndpoint("cpu"), layout, m)
    peer = PairEndpoint("cpu", store_address="decode:2")
    assert p.route(_ticket(layout, 5, ["dist", "grpc"], peer)).backend == "dist"
    assert d.prepared == ["decode:1"]  # pairing starts while the prompt runs
    assert p.route(_ticket(layout, 5, ["grpc"])).backend == "grpc"
    assert p.route(_ticket(layout, 5)).backend == "grpc"  # a decode without the fields
    d._unusable = "handshake failed a moment ago"
    assert p.route(_ticket(layout, 5, ["dist", "grpc"], peer)).backend == "grpc"
    count = {s.labels["reason"]: s.value for s in m.kv_transfer_fallbacks.collect()[0].samples
             if s.name.endswith("_total")}
    assert count == {"not_accepted": 2.0, "pair_unavailable": 1.0}


async def test_push_switches_to_grpc_when_the_pair_cannot_be_made():
    import asyncio

    from engine.layer_stream import LayerExport
    import torch

    layout = KVLayout(2, 2, 16, "fp32", 16)
    events = []
    g = RecordingSender("grpc", events)
    d = RecordingSender("dist", events, open_error=PairUnavailable("store unreachable"))
    m = _metrics()
    p = KVPusher({"grpc": g, "dist": d}, "dist", PairEndpoint("cpu"), layout, m)
    peer = PairEndpoint("cpu", store_address="decode:2")
    ticket = _ticket(layout, 20, ["dist", "grpc"], peer)
    route = p.route(ticket)
    q: asyncio.Queue = asyncio.Queue()
    for i in range(2):
        q.put_nowait(LayerExport("r", i, 2, 20, torch.zeros(layout.layer_shape(2))))
    nbytes, backend = await p.push(route, ticket, "r", q)
    assert backend == "grpc" and nbytes == 2 * layout.layer_nbytes(2)
    assert events == ["grpc open", "grpc send 0", "grpc send 1", "grpc finish"]
