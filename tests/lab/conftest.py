"""The lab's kernel-input check runs like the kernel tests: under the Triton interpreter on CPU
tensors, compiled on cuda with SPLITSERVE_KERNEL_TESTS_GPU=1. TRITON_INTERPRET must be set
before triton is first imported, hence here at conftest import."""
import os

import pytest

_GPU = os.environ.get("SPLITSERVE_KERNEL_TESTS_GPU") == "1"
if not _GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device():
    import torch

    if _GPU:
        if not torch.cuda.is_available():
            pytest.skip("SPLITSERVE_KERNEL_TESTS_GPU=1 but no cuda")
        return torch.device("cuda")
    return torch.device("cpu")
