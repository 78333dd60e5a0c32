"""The lab's kernel-input check runs like the kernel tests: under the Triton interpreter on CPU
tensors, compiled on cuda with SPLITSERVE_KERNEL_TESTS_GPU=1 (tests/triton_interpret.py)."""
from tests.triton_interpret import device  # noqa: F401 - the fixture
