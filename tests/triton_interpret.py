"""Triton kernels under test run under the Triton interpreter on CPU tensors by default; on a
GPU machine SPLITSERVE_KERNEL_TESTS_GPU=1 runs the same tests compiled on cuda.

A conftest imports this module (and its `device` fixture) before anything imports triton:
TRITON_INTERPRET is read when triton is first imported.
"""
import os

import pytest

GPU = os.environ.get("SPLITSERVE_KERNEL_TESTS_GPU") == "1"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device():
    import torch

    if GPU:
        if not torch.cuda.is_available():
            pytest.skip("SPLITSERVE_KERNEL_TESTS_GPU=1 but no cuda")
        return torch.device("cuda")
    return torch.device("cpu")
