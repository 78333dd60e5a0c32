"""bench.common.print_table and bench.timing.copy_bandwidth_gbs, shared by the GPU benchmarks
(which need a GPU to run whole): the table layout and the copy-rate arithmetic."""
from bench.common import print_table
from bench.timing import copy_bandwidth_gbs


def test_print_table_aligns_and_formats_floats(capsys):
    rows = [{"kernel": "a", "us": 12.345678, "n": 3}, {"kernel": "longer", "us": 0.5}]
    print_table(rows, ["kernel", "us", "n"], float_fmt=".3g")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["kernel", "us", "n"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["a", "12.3", "3"] and lines[3].split() == ["longer", "0.5"]
    print_table(rows, ["us"])  # no float_fmt: cells as str() gives them
    assert capsys.readouterr().out.splitlines()[2].strip() == "12.345678"


def test_copy_bandwidth_counts_read_and_write_bytes():
    calls = []

    def timer(fn, iters):
        fn()
        calls.append(iters)
        return 2.0  # ms

    # 1 MiB read + 1 MiB written in 2 ms
    assert copy_bandwidth_gbs(1 << 20, "cpu", timer=timer) == 2 * (1 << 20) / 2e-3 / 1e9
    assert calls == [20]
