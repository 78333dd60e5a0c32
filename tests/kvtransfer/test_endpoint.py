"""Which backend a prefill/decode pair uses: the selected one when decode accepts it and the
pair can use it, else grpc with a reason (never an error)."""
from __future__ import annotations

from kvtransfer.endpoint import PairEndpoint, choose_backend, ticket_backends
from protos import common_pb2

CPU = PairEndpoint("cpu", store_address="h:1")
GPU0 = PairEndpoint("cuda:0", "GPU-aaaa", "h:1")
GPU1 = PairEndpoint("cuda:1", "GPU-bbbb", "h:1")


def test_grpc_wanted_is_grpc():
    c = choose_backend("grpc", ["dist", "grpc"], CPU, CPU)
    assert c.backend == "grpc" and c.code is None


def test_dist_between_cpu_caches_and_between_two_gpus():
    assert choose_backend("dist", ["dist", "grpc"], CPU, CPU).backend == "dist"
    assert choose_backend("dist", ["dist", "grpc"], GPU1, GPU0).backend == "dist"


def test_fallbacks_carry_a_reason():
    cases = [
        (["grpc"], CPU, CPU, "not_accepted"),
        (["dist", "grpc"], None, CPU, "no_endpoint"),
        (["dist", "grpc"], GPU1, CPU, "device_mismatch"),
        (["dist", "grpc"], PairEndpoint("cuda:3", "GPU-aaaa", "h:1"), GPU0, "same_gpu"),  # same UUID
        (["dist", "grpc"], PairEndpoint("cpu"), CPU, "no_endpoint"),  # no store address
    ]
    for accepted, peer, local, code in cases:
        c = choose_backend("dist", accepted, peer, local)
        assert (c.backend, c.code) == ("grpc", code), (accepted, peer, local)
        assert c.why
    assert choose_backend("nixl", ["dist", "grpc"], CPU, CPU).code == "not_accepted"
    assert choose_backend("nixl", ["nixl", "grpc"], PairEndpoint("cpu"), CPU).backend == "nixl"


def test_ticket_fields():
    t = common_pb2.TransferTicket(transfer_id="x")
    assert ticket_backends(t) == (["grpc"], None)  # a decode that predates the fields
    t.kv_backends.extend(["dist", "grpc"])
    t.pair.CopyFrom(GPU1.to_pb())
    accepted, peer = ticket_backends(t)
    assert accepted == ["dist", "grpc"] and peer == GPU1
