"""lab.kernel_resources on stand-ins for compiled kernels (real ones need a GPU)."""
from types import SimpleNamespace

from lab.kernel_resources import compiled_rows, rows_for


def _kernel(n_regs, warps, shared, constants, spills=0):
    return SimpleNamespace(n_regs=n_regs, n_spills=spills, src=SimpleNamespace(constants=constants),
                           metadata=SimpleNamespace(num_warps=warps, shared=shared, num_stages=3))


def test_rows_for_reads_resources_and_named_constexprs():
    fn = SimpleNamespace(arg_names=["x_ptr", "N", "BLOCK_N", "ROPE"],
                         device_caches={0: ({"a": _kernel(91, 8, 74240, {(2,): 128, (3,): True}),
                                             "b": _kernel(0, 4, 0, {}),  # never loaded: skipped
                                             "c": _kernel(64, 4, 0, {"BLOCK_N": 16}, spills=8)},
                                            {}, None, None, None)})
    rows = rows_for("_decode_split_kernel", fn)
    assert [r["regs"] for r in rows] == [91, 64]
    assert rows[0]["variant"] == "BLOCK_N=128 ROPE=1"
    # 91 registers -> 12 x 256 per warp, 8 warps: 2 programs by registers (3 by shared memory)
    assert rows[0]["fit_per_sm"] == 2
    assert rows[1]["variant"] == "BLOCK_N=16" and rows[1]["spills"] == 8
    assert rows[1]["fit_per_sm"] == 8  # 64 regs x 128 threads = 8192 of 65536 registers


def test_compiled_rows_on_cpu_is_empty_not_an_error():
    assert compiled_rows() == []  # interpreter / nothing launched on a GPU
