"""Which KV transfer backend a prefill/decode pair uses, decided per ticket on the prefill side.

    grpc   bytes in gRPC messages (any host, any device; KV staged through host memory)
    dist   torch.distributed point-to-point over a two-rank group per pair: gloo between CPU
           caches, NCCL between CUDA caches (no host staging); control stays on gRPC
    nixl   NIXL one-sided READs (RDMA between hosts); needs the `nixl` package
    vmm    one host, CUDA: decode maps prefill's KV pool (CUDA virtual memory) and copies the
           prompt's blocks device to device (kvtransfer/backends/pool.py)
    shm    one host, CPU: the same with the pool in shared memory
    auto   (the default) the fastest the pair supports: vmm / shm on one host, else grpc

Decode advertises what it accepts in its Reserve ticket (`kv_backends`, preferred first, plus a
`PairEndpoint`); prefill wants one backend (its flag) and falls back to grpc, with a reason for
the logs and metrics, when the pair cannot use it. gRPC is always accepted, so a fallback
never fails a request.
"""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "grpc", "dist", "nixl", "vmm", "shm")
POOL_BACKENDS = ("vmm", "shm")


class BackendUnavailable(RuntimeError):
    """A selected backend cannot run in this process (e.g. nixl is not installed)."""


def backend_unavailable(backend: str) -> str | None:
    """Why `backend` cannot run in this process, or None (the services' flag check)."""
    if backend == "nixl":
        from kvtransfer.backends.nixl_probe import NOT_INSTALLED, nixl_available

        return None if nixl_available() else NOT_INSTALLED
    if backend == "vmm":
        try:
            from cuda.bindings import driver  # noqa: F401
        except ImportError:
            return "vmm needs the cuda-bindings package (pip install cuda-bindings)"
    return None


@dataclass(frozen=True)
class PairEndpoint:
    """One side's KV device as the pairing sees it (decode's comes from the ticket)."""
    device: str = "cpu"            # "cpu" | "cuda:N"
    device_uuid: str = ""          # CUDA: GPU UUID
    store_address: str = ""        # dist: decode's TCPStore host:port
    host_id: str = ""              # hostname + boot id (pool backends: one host only)

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @classmethod
    def from_pb(cls, pb) -> "PairEndpoint":
        return cls(device=pb.device or "cpu", device_uuid=pb.device_uuid,
                   store_address=pb.store_address, host_id=pb.host_id)

    def to_pb(self):
        from protos import common_pb2

        return common_pb2.PairEndpoint(device=self.device, device_uuid=self.device_uuid,
                                       store_address=self.store_address, host_id=self.host_id)


def local_endpoint(device: str, store_address: str = "") -> PairEndpoint:
    """This process's endpoint for its KV cache device ('cuda:N' gets the GPU's UUID)."""
    uuid = ""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        uuid = str(getattr(props, "uuid", ""))
    return PairEndpoint(device=device, device_uuid=uuid, store_address=store_address,
                        host_id=host_id())


def host_id() -> str:
    """This host's identity: hostname + boot id (equal for two processes of one host)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def device_id(ep: PairEndpoint) -> str:
    """What LoadStats.device_id reports: equal for two replicas on one device."""
    return f"cuda:{ep.device_uuid or ep.device}" if ep.device_type == "cuda" else f"cpu:{ep.host_id}"


def pool_backend_for(device: str) -> str:
    """The pool backend for a KV cache on `device` ('cpu' -> shm, 'cuda:N' -> vmm)."""
    return "vmm" if device.startswith("cuda") else "shm"


def ticket_backends(ticket) -> tuple[list[str], PairEndpoint | None]:
    """-> (backends decode accepts, its endpoint or None) from a TransferTicket."""
    backends = list(ticket.kv_backends) or ["grpc"]
    return backends, PairEndpoint.from_pb(ticket.pair) if ticket.HasField("pair") else None


def same_gpu(a: PairEndpoint, b: PairEndpoint) -> bool:
    if a.device_type != "cuda" or b.device_type != "cuda":
        return False
    if a.device_uuid and b.device_uuid:
        return a.device_uuid == b.device_uuid
    return a.device == b.device  # no UUIDs: assume one host, compare indices


@dataclass(frozen=True)
class Choice:
    backend: str                # what to use
    code: str | None = None     # why not the wanted one (a short metric label), None if it is
    why: str = ""               # the same for people (logs)


def choose_backend(want: str, accepted: list[str], peer: PairEndpoint | None,
                   local: PairEndpoint) -> Choice:
    """-> the backend for this pair; grpc (with a reason) when `want` cannot be used here.
    Never raises: grpc always works. `auto`: the pool backend when the pair can use it, else
    grpc without a fallback reason (nothing was asked for)."""
    if want == "grpc":
        return Choice("grpc")
    if want == "auto":
        pool = pool_backend_for(local.device)
        if pool in accepted and peer is not None and _pool_reason(pool, peer, local) is None:
            return Choice(pool)
        return Choice("grpc")
    if want not in accepted:
        return Choice("grpc", "not_accepted", f"decode does not accept {want} (it accepts {', '.join(accepted)})")
    if peer is None:
        return Choice("grpc", "no_endpoint", f"decode accepts {want} but sent no pair endpoint")
    if peer.device_type != local.device_type:
        # NOTE: gloo moves CPU tensors and NCCL CUDA ones; a mixed pair would need host
        # staging on one side, which is what the grpc backend does anyway.
        return Choice("grpc", "device_mismatch", f"KV caches on different device types "
                      f"(prefill {local.device}, decode {peer.device})")
    if want == "dist":
        if local.device_type not in ("cpu", "cuda"):
            return Choice("grpc", "device_mismatch", f"dist has no transport for {local.device}")
        if same_gpu(local, peer):
            return Choice("grpc", "same_gpu", f"prefill and decode share GPU {local.device}: NCCL "
                          "cannot pair two ranks on one GPU")
        if not peer.store_address:
            return Choice("grpc", "no_endpoint", "decode sent no rendezvous store address")
    if want in POOL_BACKENDS:
        why = _pool_reason(want, peer, local)
        if why is not None:
            return Choice("grpc", why[0], why[1])
    return Choice(want)


def _pool_reason(pool: str, peer: PairEndpoint, local: PairEndpoint) -> tuple[str, str] | None:
    """Why a pool backend cannot serve this pair ((code, words)), or None."""
    if pool != pool_backend_for(local.device) or pool != pool_backend_for(peer.device):
        return "device_mismatch", f"{pool} needs both KV caches on {'CUDA' if pool == 'vmm' else 'CPU'}"
    if not peer.host_id or peer.host_id != local.host_id:
        return "other_host", f"{pool} needs both sides on one host (decode on {peer.host_id or '?'})"
    return None


def pair_transport(device: str) -> str:
    """torch.distributed backend for a pair whose KV lives on `device`."""
    return "nccl" if device.startswith("cuda") else "gloo"
