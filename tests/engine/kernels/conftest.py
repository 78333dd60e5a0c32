"""Kernel tests run under the Triton interpreter on CPU tensors by default; on a GPU machine,
SPLITSERVE_KERNEL_TESTS_GPU=1 runs the same tests compiled on cuda (tests/triton_interpret.py,
imported first: it sets TRITON_INTERPRET before triton is imported)."""
from tests.triton_interpret import device  # noqa: F401 - the fixture

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the install
    triton = None

collect_ignore_glob = [] if triton is not None else ["test_*.py"]
