"""The lab's kernel-input check runs like the kernel tests: under the Triton interpreter on CPU,
compiled on cuda with SPLITSERVE_KERNEL_TESTS_GPU=1. Importing the kernel tests' conftest sets
TRITON_INTERPRET before triton is first imported."""
from tests.kernels.conftest import device  # noqa: F401
