"""Routing: least predicted delay wins; replicas marked down go last."""
from gateway.admission import AdmissionConfig, LoadView, Predictor
from gateway.routing import Replica, load_view_from_pb, order_decode, order_prefill
from protos import common_pb2


def test_prefill_goes_to_least_predicted_ttft():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0))
    a = Replica("a:1", "prefill", load=LoadView(queued_tokens=5000))
    b = Replica("b:1", "prefill", load=LoadView(queued_tokens=100))
    c = Replica("c:1", "prefill", load=LoadView(queued_tokens=0, inflight_tokens=3000))
    assert [r.address for r in order_prefill([a, b, c], p, 50)] == ["b:1", "c:1", "a:1"]
    b.mark_down("gone")
    assert [r.address for r in order_prefill([a, b, c], p, 50)] == ["c:1", "a:1", "b:1"]


def test_prefill_uses_replica_rate():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0))
    slow = Replica("slow:1", "prefill", load=LoadView(queued_tokens=100, tokens_per_s=10.0))
    fast = Replica("fast:1", "prefill", load=LoadView(queued_tokens=1000, tokens_per_s=100000.0))
    assert order_prefill([slow, fast], p, 10)[0].address == "fast:1"


def test_decode_avoids_full_and_busy():
    p = Predictor(AdmissionConfig())
    full = Replica("full:1", "decode", load=LoadView(running=1, num_free_blocks=0, kv_usage=1.0))
    busy = Replica("busy:1", "decode", load=LoadView(running=50, num_free_blocks=10, kv_usage=0.5))
    idle = Replica("idle:1", "decode", load=LoadView(running=1, num_free_blocks=90, kv_usage=0.1))
    assert [r.address for r in order_decode([full, busy, idle], p)] == ["idle:1", "busy:1", "full:1"]


def test_load_view_keeps_own_inflight():
    keep = LoadView(inflight_tokens=7, inflight_requests=1)
    pb = common_pb2.LoadStats(running=2, waiting=3, kv_usage=0.25, queued_tokens=40,
                              num_free_blocks=30, num_total_blocks=40, tokens_per_s=123)
    v = load_view_from_pb(pb, keep)
    assert (v.running, v.waiting, v.queued_tokens, v.num_free_blocks, v.tokens_per_s) == (2, 3, 40, 30, 123)
    assert v.inflight_tokens == 7 and v.inflight_requests == 1
