"""nixl backend: KV layers move by NIXL one-sided READs (UCX: RDMA between hosts, NVLink /
CUDA IPC within one), behind the same KVSender / KVReceiver interfaces as the others. This
module: the agent, the descriptors and decode's side (NixlPlane); prefill's side (staging,
NixlKVSender) is nixl_sender.py.

Runs on the registry's NIXL wheels (nixl-cu12 / nixl-cu13; nixl_probe.py finds the module):
two processes over UCX in tests/kvtransfer/test_nixl_real.py and bench/kv_transfer.py. The
failure paths are also tested with a fake agent that copies memory
(tests/kvtransfer/backends/fake_nixl.py). Calls used (nixl._api.nixl_agent): register_memory,
get_agent_metadata, add_remote_agent, get_xfer_descs, initialize_xfer (with a notification),
transfer, check_xfer_state, release_xfer_handle, get_new_notifs, remove_remote_agent.

Design (pull, like the NIXL connectors of vLLM and Dynamo, but our own code):
- one agent per process; prefill registers a staging pool once, decode registers its KV cache
  tensors once (per layer [2, num_blocks, block_size, kv_heads, head_dim]);
- handshake on the PairSession control stream (kvtransfer.proto): prefill's hello carries its
  agent metadata, decode loads it (add_remote_agent) and answers with its own;
- per layer, prefill copies the layer into a staging range and sends the header with the
  range's address; decode checks the header against the open transfer's reservation, then
  READs the bytes straight into its reserved blocks (block-level descriptors built from the
  block ids) and polls the transfer to completion; commit / ack as for every backend;
- while prefill's staging is more than half full, a layer's header asks for a notification:
  that READ carries one naming the staged layer and prefill frees the range when it arrives, so
  a request larger than the buffer streams through it. Not always: a READ with a notification
  completes only once the notification is delivered (UCX AM over tcp; ~0.1 ms idle, tens of ms
  on a loaded host), against ~0.05 ms for a 512 KiB READ without one (cma).

Hazards:
- NOTE: decode READs into engine-owned blocks outside the engine thread. A transfer that fails
  while a READ is in flight must not free those blocks before the READ ends: each READ is
  counted in an InflightGuard, and decode's sink is a GuardedSink whose release waits for the
  request's READs (kvtransfer.guard).
- NOTE: prefill frees a staged layer's range on its READ's notification (when asked for), and
  the rest of a transfer's ranges once it is over (ack, nack, abort). A READ still in flight after a nack
  lands in the failed transfer's own (guarded) blocks.
- NOTE: a READ that neither completes nor errors is given up at its deadline
  (release_xfer_handle cancels it); the pair is then broken.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Sequence

import torch

from kvtransfer.backends.nixl_probe import NOT_INSTALLED, nixl_api, nixl_available  # noqa: F401 - re-exported
from kvtransfer.backends.pair_service import RecvPlane
from kvtransfer.endpoint import BackendUnavailable
from kvtransfer.guard import InflightGuard
from kvtransfer.state import KVLayout, TransferError
from protos import kvtransfer_pb2

log = logging.getLogger("splitserve.kvtransfer.nixl")

def make_agent(name: str):
    """A real nixl agent (UCX backend); BackendUnavailable when nixl is missing."""
    try:
        api = nixl_api()
    except ImportError as e:
        raise BackendUnavailable(f"{NOT_INSTALLED} [{e}]") from e
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def mem_type(device: str | torch.device) -> str:
    return "VRAM" if str(device).startswith("cuda") else "DRAM"


def device_id(device: str | torch.device) -> int:
    d = torch.device(device)
    return (d.index or 0) if d.type == "cuda" else 0


# ---- descriptors ------------------------------------------------------------------------
def layer_block_descs(base: int, blocks_in_tensor: int, block_bytes: int, block_ids: Sequence[int],
                      dev: int) -> list[tuple[int, int, int]]:
    """(addr, nbytes, device) of the given blocks, K half then V half, in a contiguous layer
    tensor [2, blocks_in_tensor, block_size, kv_heads, head_dim] starting at `base`."""
    return [(base + (kv * blocks_in_tensor + b) * block_bytes, block_bytes, dev)
            for kv in (0, 1) for b in block_ids]


def merge_contiguous(local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]):
    """Merge neighbouring descriptor pairs that are contiguous on both sides (fewer, larger
    RDMA ops; consecutive block ids are common). -> (local, remote), same length."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local vs {len(remote)} remote descriptors")
    lo: list[list[int]] = []
    ro: list[list[int]] = []
    for (la, ln, ld), (ra, rn, rd) in zip(local, remote):
        if ln != rn:
            raise ValueError(f"descriptor sizes differ: {ln} vs {rn}")
        if lo and lo[-1][0] + lo[-1][1] == la and ro[-1][0] + ro[-1][1] == ra \
                and lo[-1][2] == ld and ro[-1][2] == rd:
            lo[-1][1] += ln
            ro[-1][1] += rn
        else:
            lo.append([la, ln, ld])
            ro.append([ra, rn, rd])
    return [tuple(x) for x in lo], [tuple(x) for x in ro]


def block_bytes(layout: KVLayout) -> int:
    return layout.layer_nbytes(1) // 2


def read_notif(transfer_id: str, remote_addr: int) -> bytes:
    """The notification a finished READ delivers to prefill: which staged layer was read, so
    its staging range is reused before the transfer ends (a request larger than the buffer)."""
    return f"{transfer_id}|{remote_addr}".encode()


def parse_read_notif(msg: bytes) -> tuple[str, int] | None:
    tid, sep, addr = bytes(msg).decode(errors="replace").rpartition("|")
    return (tid, int(addr)) if sep and addr.isdigit() else None


# ---- decode side ------------------------------------------------------------------------
class NixlPlane(RecvPlane):
    """Decode's data side of one nixl pair: READ each layer into the reserved blocks.

    agent: this process's agent, with `kv_caches` registered once (register_kv_caches);
    block_ids_of(request_id) -> the request's reserved block ids (from the engine)."""

    backend = "nixl"

    def __init__(self, agent, kv_caches: list[torch.Tensor], layout: KVLayout,
                 block_ids_of: Callable[[str], Awaitable[list[int]]], guard: InflightGuard,
                 default_timeout_s: float = 30.0):
        self.agent = agent
        self.kv_caches = kv_caches
        self.layout = layout
        self.block_ids_of = block_ids_of
        self.guard = guard
        self.timeout_s = default_timeout_s
        self.peer_name: str | None = None
        self.peer_mem = "DRAM"

    async def accept(self, hello) -> kvtransfer_pb2.PairAccept:
        if not hello.nixl_metadata:
            raise TransferError("nixl hello without agent metadata")
        self.peer_name = self.agent.add_remote_agent(hello.nixl_metadata)
        self.peer_mem = mem_type(hello.device or "cpu")
        if hello.timeout_ms:
            self.timeout_s = hello.timeout_ms / 1e3
        return kvtransfer_pb2.PairAccept(nixl_metadata=self.agent.get_agent_metadata())

    async def join(self, hello) -> None:
        return None

    def post(self, header, request_id: str | None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if request_id is None:  # refused: nothing to drain, the bytes stay on prefill
            fut = loop.create_future()
            fut.set_result(None)
            return fut
        self.guard.enter(request_id)  # NOTE: synchronously, before the header is acted on
        return loop.create_task(self._read(header, request_id))

    async def _read(self, h, rid: str) -> None:
        try:
            n = int(h.shape[1])
            ids = (await self.block_ids_of(rid))[:n]
            if len(ids) < n:
                raise TransferError(f"{n} blocks announced, {len(ids)} reserved")
            cache = self.kv_caches[h.layer_index]
            bb = block_bytes(self.layout)
            local = layer_block_descs(cache.data_ptr(), cache.shape[1], bb, ids, device_id(cache.device))
            remote = layer_block_descs(int(h.remote_addr), n, bb, range(n), int(h.remote_device))
            local, remote = merge_contiguous(local, remote)
            notif = read_notif(h.transfer_id, int(h.remote_addr)) if h.notify_read else b""
            await self._transfer(local, remote, notif)
        finally:
            self.guard.exit(rid)

    async def _transfer(self, local, remote, notif: bytes) -> None:
        a = self.agent
        ldesc = a.get_xfer_descs(local, mem_type(self.kv_caches[0].device))
        rdesc = a.get_xfer_descs(remote, self.peer_mem)
        handle = a.initialize_xfer("READ", ldesc, rdesc, self.peer_name, notif)
        try:
            state = a.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            pause = 20e-6
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"nixl READ not done after {self.timeout_s:.1f}s")
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1e-3)
                state = a.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"nixl READ failed ({state})")
        finally:
            a.release_xfer_handle(handle)  # NOTE: also cancels a READ still in flight

    def close(self, reason: str, orderly: bool) -> None:
        if self.peer_name is not None:
            try:
                self.agent.remove_remote_agent(self.peer_name)
            except Exception:  # noqa: BLE001 - best effort
                log.debug("remove_remote_agent failed", exc_info=True)
            self.peer_name = None


def register_kv_caches(agent, kv_caches: list[torch.Tensor]):
    """Decode: register the KV cache tensors once (they never move)."""
    return agent.register_memory(list(kv_caches))
