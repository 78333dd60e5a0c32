"""Kernel tests run under the Triton interpreter on CPU tensors by default.

TRITON_INTERPRET must be set before triton is first imported, hence here at conftest import.
On a GPU machine, SPLITSERVE_KERNEL_TESTS_GPU=1 runs the same tests compiled on cuda.
"""
import os

import pytest

_GPU = os.environ.get("SPLITSERVE_KERNEL_TESTS_GPU") == "1"
if not _GPU:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the install
    triton = None

collect_ignore_glob = [] if triton is not None else ["test_*.py"]


@pytest.fixture
def device():
    import torch

    if _GPU:
        if not torch.cuda.is_available():
            pytest.skip("SPLITSERVE_KERNEL_TESTS_GPU=1 but no cuda")
        return torch.device("cuda")
    return torch.device("cpu")
