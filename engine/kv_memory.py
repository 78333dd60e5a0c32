"""KV pool memory that a second process on the same host can map (disaggregation without copies
through a wire).

    pool = allocate_pool(nbytes, device, shareable=True)   # one zeroed uint8 tensor
    meta, fd = pool.export()                                # send both over a Unix socket
    peer = map_pool(meta, fd, device)                       # in the other process: same bytes
    peer.tensor ... ; peer.close()

Kinds:
    plain     torch allocation; not shareable (the default when nothing needs to map it)
    memfd     CPU: an anonymous memory file mapped MAP_SHARED; the fd is the handle
    cuda_vmm  CUDA virtual memory: cuMemCreate with a POSIX fd handle, mapped in the peer with
              cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess (cuda.bindings).
              Chosen over torch's CUDA IPC, which fails between processes on some drivers
              (cudaErrorDeviceUninitialized); a peer on another GPU of the host maps it the
              same way and reaches it over NVLink / PCIe peer access.

Hazards:
- NOTE: a mapped pool's tensor does not own its memory: `close()` only after every use of it
  has completed (the caller synchronizes its streams first).
- NOTE: a peer's mapping keeps the physical memory alive after the owner exits; the peer must
  close its mapping when the owner goes away, or the memory leaks until the peer exits.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import asdict, dataclass

import torch

KINDS = ("plain", "memfd", "cuda_vmm")


@dataclass(frozen=True)
class PoolMeta:
    """What a peer needs besides the fd to map a pool."""
    kind: str
    nbytes: int          # usable bytes (the tensor's length)
    map_bytes: int       # bytes of the allocation (rounded to the mapping granularity)
    device: str          # the owner's device ("cpu" | "cuda:N")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PoolMeta":
        return cls(str(d["kind"]), int(d["nbytes"]), int(d["map_bytes"]), str(d["device"]))


class Pool:
    """One allocation viewed as a uint8 tensor [nbytes]; `export` gives a handle for a peer."""

    def __init__(self, kind: str, tensor: torch.Tensor, meta: PoolMeta, closer=None, fd: int = -1):
        self.kind, self.tensor, self.meta = kind, tensor, meta
        self._closer, self._fd = closer, fd

    @property
    def shareable(self) -> bool:
        return self.kind != "plain"

    def export(self) -> tuple[PoolMeta, int]:
        """-> (meta, fd). The fd stays owned by the pool (send a duplicate, never close it)."""
        if not self.shareable:
            raise ValueError("a plain pool cannot be shared (allocate it with shareable=True)")
        return self.meta, self._fd

    def close(self) -> None:
        self.tensor = None
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def allocate_pool(nbytes: int, device: torch.device | str, shareable: bool = False) -> Pool:
    """A zeroed pool of `nbytes` on `device`; shareable: memfd on CPU, CUDA VMM on a GPU."""
    device = torch.device(device)
    if not shareable:
        t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return Pool("plain", t, PoolMeta("plain", nbytes, nbytes, str(device)))
    if device.type == "cpu":
        return _memfd_pool(nbytes)
    if device.type == "cuda":
        from engine import cuda_vmm

        return cuda_vmm.create(nbytes, device)
    raise ValueError(f"no shareable KV memory on {device}")


def map_pool(meta: PoolMeta, fd: int, device: torch.device | str) -> Pool:
    """Map a peer's exported pool into this process (takes ownership of `fd`)."""
    device = torch.device(device)
    if meta.kind == "memfd":
        try:
            if device.type != "cpu":
                raise ValueError(f"a memfd pool maps on the CPU, not {device}")
            return _memfd_map(meta, fd)
        except BaseException:
            os.close(fd)
            raise
    if meta.kind == "cuda_vmm":
        if device.type != "cuda":
            os.close(fd)
            raise ValueError(f"a CUDA pool maps on a CUDA device, not {device}")
        from engine import cuda_vmm  # it closes the fd if the mapping fails

        return cuda_vmm.import_(meta, fd, device)
    os.close(fd)
    raise ValueError(f"cannot map a pool of kind {meta.kind!r}")


def _memfd_pool(nbytes: int) -> Pool:
    fd = os.memfd_create("splitserve-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))  # a new memfd reads as zeros
        pool = _memfd_map(PoolMeta("memfd", nbytes, max(nbytes, 1), "cpu"), fd)
    except BaseException:
        os.close(fd)
        raise
    return pool


def _memfd_map(meta: PoolMeta, fd: int) -> Pool:
    mm = mmap.mmap(fd, meta.map_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(mm, dtype=torch.uint8, count=meta.nbytes) if meta.nbytes else \
        torch.empty(0, dtype=torch.uint8)

    def close():
        try:
            mm.close()
        except BufferError:  # views still alive: the mapping goes when the last one does
            pass

    return Pool("memfd", t, meta, close, fd)
