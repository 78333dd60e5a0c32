"""engine.cuda_vmm's call sequence on a CPU stand-in for the CUDA driver: what is created is
mapped, exported and, on close or on any failure, unmapped, freed and released in order."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from engine import cuda_vmm
from engine.kv_memory import PoolMeta

GRAN = 2 << 20


class _Obj(SimpleNamespace):
    def __init__(self):
        super().__init__(location=SimpleNamespace(type=None, id=None), type=None,
                         requestedHandleTypes=None, flags=None)


class FakeDriver:
    """The subset of cuda.bindings.driver that cuda_vmm calls; returns (err, value) like it."""
    CUmemAllocationProp = CUmemAccessDesc = _Obj
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    def __init__(self, fail: str | None = None):
        self.calls, self.fail, self.live = [], fail, set()

    def _ret(self, name, value=None):
        self.calls.append(name)
        return (1 if name == self.fail else 0, value)

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_FAKE"

    def cuMemGetAllocationGranularity(self, prop, flag):
        return self._ret("granularity", GRAN)

    def cuMemCreate(self, size, prop, flags):
        assert size % GRAN == 0 and prop.requestedHandleTypes == 1
        self.live.add("handle")
        return self._ret("create", "h")

    def cuMemImportFromShareableHandle(self, fd, kind):
        self.live.add("handle")
        return self._ret("import", "h")

    def cuMemAddressReserve(self, size, align, addr, flags):
        self.live.add("va")
        return self._ret("reserve", 4096)

    def cuMemMap(self, va, size, off, handle, flags):
        if self.fail != "map":
            self.live.add("map")
        return self._ret("map")

    def cuMemSetAccess(self, va, size, descs, n):
        assert descs[0].flags == 3 and n == 1
        return self._ret("access")

    def cuMemExportToShareableHandle(self, handle, kind, flags):
        return self._ret("export", os.open(os.devnull, os.O_RDONLY))

    def cuMemUnmap(self, va, size):
        self.live.discard("map")
        return self._ret("unmap")

    def cuMemAddressFree(self, va, size):
        self.live.discard("va")
        return self._ret("free")

    def cuMemRelease(self, handle):
        self.live.discard("handle")
        return self._ret("release")


@pytest.fixture(autouse=True)
def cpu_stand_in(monkeypatch):
    monkeypatch.setattr(cuda_vmm, "_ensure_context", lambda drv, dev: 0)
    monkeypatch.setattr(cuda_vmm, "_tensor", lambda ptr, n, idx: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(cuda_vmm.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda_vmm.torch.cuda, "device", lambda i: _Null())


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_create_rounds_maps_exports_and_close_undoes_it_in_order():
    drv = FakeDriver()
    pool = cuda_vmm.create(3 * GRAN + 5, torch.device("cuda:0"), driver=drv)
    assert pool.meta == PoolMeta("cuda_vmm", 3 * GRAN + 5, 4 * GRAN, "cuda:0")
    assert drv.calls == ["granularity", "create", "reserve", "map", "access", "export"]
    meta, fd = pool.export()
    assert fd >= 0 and pool.tensor.numel() == 3 * GRAN + 5
    pool.close()
    assert drv.calls[-3:] == ["unmap", "free", "release"] and not drv.live


@pytest.mark.parametrize("fail", ["map", "access", "export"])
def test_a_failed_step_leaves_nothing_mapped_or_held(fail):
    drv = FakeDriver(fail=fail)
    with pytest.raises(cuda_vmm.VMMError, match="CUDA_ERROR_FAKE"):
        cuda_vmm.create(GRAN, torch.device("cuda:0"), driver=drv)
    assert not drv.live, drv.calls


def test_import_maps_with_access_for_the_local_device_and_closes_the_fd():
    drv = FakeDriver()
    fd = os.open(os.devnull, os.O_RDONLY)
    pool = cuda_vmm.import_(PoolMeta("cuda_vmm", 100, GRAN, "cuda:1"), fd, torch.device("cuda:0"), drv)
    assert drv.calls == ["import", "reserve", "map", "access"]
    pool.close()
    assert not drv.live
    with pytest.raises(OSError):
        os.fstat(fd)  # the pool owned the fd


def test_a_failed_import_closes_the_fd_and_releases_the_handle():
    drv = FakeDriver(fail="map")
    fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(cuda_vmm.VMMError):
        cuda_vmm.import_(PoolMeta("cuda_vmm", 100, GRAN, "cuda:0"), fd, torch.device("cuda:0"), drv)
    assert not drv.live
    with pytest.raises(OSError):
        os.fstat(fd)
