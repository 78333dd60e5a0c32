"""Run a command and report the CPU other processes used while it ran: /proc/stat's busy time
less the CPU time of our own processes (the command's tree and the trees of --pids, e.g. a
running `splitserve up`), as a share of all cores. For benchmarks on a shared box.

    python -m lab.other_cpu --pids $(pgrep -f 'splitserve up' | head -1) -- python -m bench.serve ...

Prints one line `other_cpu: X% of N cores over S s (ours Y%)` on stderr at the end; exits with
the command's status. Linux only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from bench.procfs import TICK, children_by_parent, cpu_seconds


def busy_s() -> float:
    """All cores' busy time (s): every /proc/stat cpu field but idle and iowait."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / TICK  # user nice system idle iowait irq softirq steal


def tree_cpu(roots: list[int], seen: dict[int, float]) -> None:
    """Record utime + stime (s) of each live process under `roots` into `seen` (kept at its
    latest value, so a process that exits mid-run counts up to its last sample)."""
    kids, todo = children_by_parent(), list(roots)
    while todo:
        p = todo.pop()
        s = cpu_seconds(p)
        if s is not None:
            seen[p] = s
        todo += kids.get(p, [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.other_cpu")
    ap.add_argument("--pids", default="", help="comma list of our other process trees' roots")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    roots = [int(x) for x in a.pids.split(",") if x]
    start, end = {}, {}
    tree_cpu(roots, start)
    b0, t0 = busy_s(), time.monotonic()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        tree_cpu(roots, end)
        time.sleep(a.interval)
    rc = proc.wait()
    b1, t1 = busy_s(), time.monotonic()
    tree_cpu(roots, end)
    ru = os.times()  # the finished command's own CPU (its tree, waited for)
    ours = sum(v - start.get(p, 0.0) for p, v in end.items()) + ru.children_user + ru.children_system
    ncpu = os.cpu_count() or 1
    wall = t1 - t0
    other = max(0.0, (b1 - b0) - ours)
    print(f"other_cpu: {100 * other / (wall * ncpu):.1f}% of {ncpu} cores over {wall:.0f} s "
          f"(ours {100 * ours / (wall * ncpu):.1f}%)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
