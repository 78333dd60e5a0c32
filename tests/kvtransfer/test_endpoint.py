"""Which backend a prefill/decode pair uses: the selected one when decode accepts it and the
pair can use it, else grpc with a reason (never an error)."""
from __future__ import annotations

from kvtransfer.endpoint import Choice, PairEndpoint, choose_backend, host_id, local_endpoint, ticket_backends
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


def test_auto_takes_the_pool_backend_on_one_host_only():
    h = "host/boot"
    cpu, gpu0, gpu1 = (PairEndpoint("cpu", host_id=h), PairEndpoint("cuda:0", "u0", host_id=h),
                       PairEndpoint("cuda:1", "u1", host_id=h))
    assert choose_backend("auto", ["shm", "grpc"], cpu, cpu) == Choice("shm")
    assert choose_backend("auto", ["vmm", "grpc"], gpu0, gpu0) == Choice("vmm")    # one GPU
    assert choose_backend("auto", ["vmm", "grpc"], gpu1, gpu0) == Choice("vmm")    # two GPUs, one host
    other = PairEndpoint("cpu", host_id="other/boot")
    assert choose_backend("auto", ["shm", "grpc"], other, cpu) == Choice("grpc")   # no reason: auto
    assert choose_backend("auto", ["grpc"], cpu, cpu) == Choice("grpc")            # decode offers none
    assert choose_backend("auto", ["vmm", "grpc"], gpu0, cpu) == Choice("grpc")    # CPU prefill
    assert choose_backend("auto", ["shm", "grpc"], None, cpu) == Choice("grpc")


def test_a_forced_pool_backend_falls_back_with_its_reason():
    cpu = PairEndpoint("cpu", host_id="a")
    assert choose_backend("shm", ["shm", "grpc"], PairEndpoint("cpu", host_id="b"), cpu).code == "other_host"
    assert choose_backend("vmm", ["vmm", "grpc"], PairEndpoint("cpu", host_id="a"), cpu).code == "device_mismatch"
    assert choose_backend("shm", ["grpc"], cpu, cpu).code == "not_accepted"


def test_host_id_travels_in_the_ticket():
    ep = local_endpoint("cpu")
    assert ep.host_id and ep.host_id == host_id()
    assert PairEndpoint.from_pb(ep.to_pb()) == ep
