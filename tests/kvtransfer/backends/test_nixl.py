"""nixl adapter without nixl: descriptor arithmetic against real tensor addresses, the whole
pull flow (handshake, staging, block-level READs into scattered reserved blocks, commit) over a
real PairSession with a fake agent that copies memory and checks every address was
registered, the in-flight-READ guard on release, and the clear error when nixl is missing.
A real-nixl smoke test runs only where the package imports (two processes:
tests/kvtransfer/test_nixl_real.py)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from common.grpc_util import create_server
from kvtransfer import KVLayout, KVReceiver, TransferError, TransferState, send_blocks
from kvtransfer.backends.nixl import (NixlPlane, block_bytes, layer_block_descs, make_agent,
                                      merge_contiguous, nixl_available, register_kv_caches)
from kvtransfer.backends.nixl_sender import NixlKVSender
from kvtransfer.backends.pair_service import KVTransferService
from kvtransfer.endpoint import BackendUnavailable, PairEndpoint
from kvtransfer.guard import GuardedSink, InflightGuard
from kvtransfer.loopback import MemorySink
from protos import kvtransfer_pb2_grpc
from tests.harness import ROOT, child_env
from tests.kvtransfer._util import random_blocks
from tests.kvtransfer.backends.fake_nixl import FakeAgent

pytestmark = pytest.mark.timeout(60)


def _layout(dtype="bf16", layers=3):
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=16)


def test_block_descriptors_match_tensor_addresses():
    layout = _layout("fp32")
    cache = torch.zeros(layout.layer_shape(10), dtype=torch.float32)
    bb = block_bytes(layout)
    descs = layer_block_descs(cache.data_ptr(), 10, bb, [7, 2], dev=0)
    want = [(cache[kv, b].data_ptr(), bb, 0) for kv in (0, 1) for b in (7, 2)]
    assert descs == want
    staged = torch.zeros(layout.layer_shape(2), dtype=torch.float32)  # a gathered 2-block layer
    assert layer_block_descs(staged.data_ptr(), 2, bb, range(2), 0) == [
        (staged[kv, b].data_ptr(), bb, 0) for kv in (0, 1) for b in (0, 1)]


def test_merge_contiguous_only_where_both_sides_are():
    local = [(100, 10, 0), (110, 10, 0), (200, 10, 0), (210, 10, 0)]
    remote = [(0, 10, 1), (10, 10, 1), (20, 10, 1), (40, 10, 1)]
    lo, ro = merge_contiguous(local, remote)
    assert lo == [(100, 20, 0), (200, 10, 0), (210, 10, 0)]
    assert ro == [(0, 20, 1), (20, 10, 1), (40, 10, 1)]
    with pytest.raises(ValueError):
        merge_contiguous(local, remote[:2])


class _Rig:
    def __init__(self, layout, hold=None, staging_bytes=64 << 10):
        self.layout = layout
        self.sink = MemorySink(layout, 24)
        self.guard = InflightGuard()
        self.rx = KVReceiver(GuardedSink(self.sink, self.guard), layout, default_timeout_s=10,
                             reap_interval_s=0.05)
        self.dec_agent = FakeAgent("decode", hold)
        register_kv_caches(self.dec_agent, self.sink.cache)

        async def block_ids_of(rid):
            return self.sink.block_ids[rid]

        plane = lambda: NixlPlane(self.dec_agent, self.sink.cache, layout, block_ids_of, self.guard, 5)  # noqa: E731
        self.svc = KVTransferService(self.rx, {"nixl": plane})
        self.pre_agent = FakeAgent("prefill")
        self.sender = NixlKVSender(PairEndpoint("cpu"), staging_bytes=staging_bytes, agent=self.pre_agent,
                                   op_timeout_s=5, connect_timeout_s=5)

    async def start(self):
        self.server = create_server()
        kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(self.svc, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def stop(self):
        await self.sender.close()
        await self.svc.close()
        await self.rx.close()
        await self.server.stop(0)


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
async def test_pull_flow_lands_byte_exact_in_reserved_blocks(dtype):
    layout = _layout(dtype)
    rig = await _Rig(layout).start()
    try:
        kv = random_blocks(layout, 4, seed=1, short=1)
        rig.sink.block_ids["r1"] = [9, 10, 11, 3]  # three contiguous + one elsewhere
        rig.rx.expect("t1", "r1", 4, kv.num_tokens)
        n = await send_blocks(rig.sender, rig.address, "t1", "r1", kv, layout, 10, peer=PairEndpoint("cpu"))
        assert n == kv.nbytes()
        assert (await rig.rx.wait("t1", 5)).state is TransferState.DONE
        for i, t in enumerate(kv.layers):
            assert rig.sink.read("r1", i, 4) == t.view(torch.uint8).numpy().tobytes(), f"layer {i}"
        # per layer: K and V halves, blocks 9-11 merged -> 2 descriptors per half
        assert rig.dec_agent.reads == [4] * layout.num_layers
        assert rig.dec_agent.released == layout.num_layers
        assert rig.dec_agent.notified == 0  # staging never half full: no READ waits on a notification
        if dtype == "fp8_e4m3":
            assert rig.sink.scales["r1"] == (pytest.approx(kv.k_scales), pytest.approx(kv.v_scales))
        # staging ranges were freed with the ack: a transfer as large as the pool fits again
        assert not rig.sender.staging._used
    finally:
        await rig.stop()


async def test_a_request_larger_than_staging_streams_through_it():
    """Once staging is half full, READs notify and free their ranges: 3 layers of 20 KiB
    through 32 KiB."""
    layout = _layout()
    rig = await _Rig(layout, staging_bytes=32 << 10).start()
    try:
        kv = random_blocks(layout, 20, seed=4, short=1)
        assert kv.nbytes() > 32 << 10
        rig.sink.block_ids["r1"] = list(range(20))
        rig.rx.expect("t1", "r1", 20, kv.num_tokens)
        await send_blocks(rig.sender, rig.address, "t1", "r1", kv, layout, 10, peer=PairEndpoint("cpu"))
        assert (await rig.rx.wait("t1", 5)).state is TransferState.DONE
        for i, t in enumerate(kv.layers):
            assert rig.sink.read("r1", i, 20) == t.view(torch.uint8).numpy().tobytes(), f"layer {i}"
        assert not rig.sender.staging._used and not rig.sender.ranges
        assert rig.dec_agent.notified >= 1
    finally:
        await rig.stop()


async def test_release_waits_for_a_read_in_flight():
    hold = asyncio.Event()
    layout = _layout()
    rig = await _Rig(layout, hold).start()
    try:
        kv = random_blocks(layout, 2, seed=2, short=1)
        rig.sink.block_ids["r1"] = [0, 1]
        rig.rx.expect("t1", "r1", 2, kv.num_tokens)
        tx = await rig.sender.open(rig.address, "t1", "r1", layout, kv.num_tokens, 10, peer=PairEndpoint("cpu"))
        tx.send_layer(0, kv.layers[0])
        for _ in range(100):  # the READ is posted and held
            if rig.guard._n.get("r1"):
                break
            await asyncio.sleep(0.02)
        assert rig.guard._n.get("r1") == 1
        rig.rx.fail("t1", "deadline (simulated)")
        await asyncio.sleep(0.2)
        assert rig.sink.released == []  # NOTE: the READ still writes into those blocks
        hold.set()
        for _ in range(100):
            if rig.sink.released:
                break
            await asyncio.sleep(0.02)
        assert rig.sink.released == ["r1"]
        with pytest.raises(TransferError):
            await tx.finish()
    finally:
        await rig.stop()


async def test_unregistered_memory_fails_the_transfer():
    layout = _layout()
    rig = await _Rig(layout).start()
    rig.dec_agent.regions.clear()  # as if decode never registered its cache
    try:
        kv = random_blocks(layout, 1, seed=3, short=1)
        rig.sink.block_ids["r1"] = [5]
        rig.rx.expect("t1", "r1", 1, kv.num_tokens)
        with pytest.raises(TransferError):
            await send_blocks(rig.sender, rig.address, "t1", "r1", kv, layout, 10, peer=PairEndpoint("cpu"))
        with pytest.raises(TransferError):
            await rig.rx.wait("t1", 5)
    finally:
        await rig.stop()


# NOTE: None in sys.modules makes an import fail: the services run as if no NIXL wheel were installed
_NO_NIXL = ("import runpy, sys; sys.modules.update(dict.fromkeys(['nixl', 'nixl._api', 'nixl_cu12', "
            "'nixl_cu12._api', 'nixl_cu13', 'nixl_cu13._api'])); sys.argv = sys.argv[1:]; "
            "runpy.run_module(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("service", ["prefill_svc", "decode_svc"])
def test_missing_nixl_is_a_clear_error(service):
    r = subprocess.run([sys.executable, "-c", _NO_NIXL, service, "--kv-transfer-backend", "nixl",
                        "--model", "dummy:tiny-llama", "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**child_env(), "SPLITSERVE_INTERNAL_SECRET": "0" * 64})  # other checks pass
    assert r.returncode == 2 and "nixl is not installed (pip install nixl-cu12" in r.stderr, r.stderr


def test_make_agent_without_nixl_names_the_package(monkeypatch):
    for m in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api", "nixl_cu13", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, m, None)
    assert not nixl_available()
    with pytest.raises(BackendUnavailable, match=r"nixl is not installed \(pip install nixl-cu12"):
        make_agent("x")
