"""CUDA virtual-memory pools that another process can map (engine.kv_memory's `cuda_vmm` kind).

Owner:  cuMemCreate(POSIX fd handle) -> cuMemAddressReserve -> cuMemMap -> cuMemSetAccess,
        cuMemExportToShareableHandle -> an fd for the peer.
Peer:   cuMemImportFromShareableHandle(fd) -> reserve -> map -> set access for its own device
        (the same GPU, or another GPU of the host through peer access).
Close:  cuMemUnmap -> cuMemAddressFree -> cuMemRelease, in that order; the physical memory is
        freed when the last process holding a handle or mapping releases it.

`driver` is the cuda.bindings driver module, or a stand-in with the same calls (tests).
"""
from __future__ import annotations

import os

import torch

from engine.kv_memory import Pool, PoolMeta


class VMMError(RuntimeError):
    pass


def _drv():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 names it cuda.cuda
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as e:
            raise VMMError("CUDA VMM pools need the `cuda-bindings` package "
                           "(pip install cuda-bindings)") from e
    return driver


def _ok(drv, ret):
    """cuda.bindings returns (CUresult, *values): raise on an error, else the values."""
    err, *vals = ret if isinstance(ret, tuple) else (ret,)
    if int(err) != 0:
        _, name = drv.cuGetErrorName(err)
        raise VMMError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    return vals[0] if len(vals) == 1 else vals


def _ensure_context(drv, device: torch.device) -> int:
    """Make the device's primary context current on this thread (torch uses the same one)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()
    with torch.cuda.device(idx):
        torch.cuda.synchronize()  # creates the primary context if torch had not yet
    _ok(drv, drv.cuInit(0))
    dev = _ok(drv, drv.cuDeviceGet(idx))
    ctx = _ok(drv, drv.cuDevicePrimaryCtxRetain(dev))
    _ok(drv, drv.cuCtxSetCurrent(ctx))
    _ok(drv, drv.cuDevicePrimaryCtxRelease(dev))  # torch holds its own reference
    return idx


def _prop(drv, idx: int):
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = idx
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _map(drv, handle, size: int, idx: int) -> int:
    """Reserve an address range, map `handle` there, give device `idx` read/write access."""
    va = _ok(drv, drv.cuMemAddressReserve(size, 0, 0, 0))
    try:
        _ok(drv, drv.cuMemMap(va, size, 0, handle, 0))
        try:
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = idx
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _ok(drv, drv.cuMemSetAccess(va, size, [desc], 1))
        except BaseException:
            drv.cuMemUnmap(va, size)
            raise
    except BaseException:
        drv.cuMemAddressFree(va, size)
        raise
    return int(va)


class _CudaArray:
    """A raw device range as __cuda_array_interface__, for torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2, "strides": None}


def _tensor(ptr: int, nbytes: int, idx: int) -> torch.Tensor:
    return torch.as_tensor(_CudaArray(ptr, nbytes), device=f"cuda:{idx}")


def _closer(drv, va: int, size: int, handle, idx: int):
    def close():
        with torch.cuda.device(idx):
            torch.cuda.synchronize()  # see engine.kv_memory: no use may outlive the mapping
        drv.cuMemUnmap(va, size)
        drv.cuMemAddressFree(va, size)
        drv.cuMemRelease(handle)
    return close


def create(nbytes: int, device: torch.device, driver=None) -> Pool:
    drv = driver or _drv()
    idx = _ensure_context(drv, device)
    prop = _prop(drv, idx)
    gran = _ok(drv, drv.cuMemGetAllocationGranularity(
        prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    size = max(-(-nbytes // int(gran)) * int(gran), int(gran))
    handle = _ok(drv, drv.cuMemCreate(size, prop, 0))
    try:
        va = _map(drv, handle, size, idx)
    except BaseException:
        drv.cuMemRelease(handle)
        raise
    close = _closer(drv, va, size, handle, idx)
    try:
        fd = int(_ok(drv, drv.cuMemExportToShareableHandle(
            handle, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
        t = _tensor(va, nbytes, idx)
        t.zero_()  # VMM memory is not zeroed by the driver
    except BaseException:
        close()
        raise
    return Pool("cuda_vmm", t, PoolMeta("cuda_vmm", nbytes, size, f"cuda:{idx}"), close, fd)


def import_(meta: PoolMeta, fd: int, device: torch.device, driver=None) -> Pool:
    drv = driver or _drv()
    try:
        idx = _ensure_context(drv, device)
        handle = _ok(drv, drv.cuMemImportFromShareableHandle(
            fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    except BaseException:
        os.close(fd)
        raise
    try:
        va = _map(drv, handle, meta.map_bytes, idx)
    except BaseException:
        drv.cuMemRelease(handle)
        os.close(fd)
        raise
    close = _closer(drv, va, meta.map_bytes, handle, idx)
    return Pool("cuda_vmm", _tensor(va, meta.nbytes, idx), meta, close, fd)
