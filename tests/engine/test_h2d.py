"""engine/h2d.py: a host list on the device, without waiting for the device's queue."""
from __future__ import annotations

import pytest
import torch

from engine.h2d import h2d


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32, torch.bool])
def test_values_and_dtype_on_cpu(dtype):
    vals = [3, 0, 1, 7] if dtype != torch.bool else [True, False, True, True]
    t = h2d(vals, dtype, "cpu")
    assert t.dtype == dtype and t.device.type == "cpu"
    assert t.tolist() == [type(t.tolist()[0])(v) for v in vals]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_is_queued_behind_running_work_not_waited_for():
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles queued ahead
    done.record()
    t = h2d(list(range(64)), torch.long, dev)
    assert not done.query(), "h2d waited for the queued work"
    ref = torch.tensor(list(range(64)), dtype=torch.long, device=dev)  # the blocking way
    assert done.query()
    assert torch.equal(t, ref)
