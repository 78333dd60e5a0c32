"""Processes as Linux's /proc shows them: a process's CPU seconds, and the tree under a root
(bench.pd_hops, lab/host_profile.py, lab/other_cpu.py). Every reader answers None or nothing
for a process that exited or a /proc it cannot read, never raises."""
from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads)."""
    f = _stat(pid)
    try:
        return (int(f[11]) + int(f[12])) / TICK if f else None
    except (IndexError, ValueError):
        return None


def children_by_parent() -> dict[int, list[int]]:
    """{parent pid: its children's pids} over every process now running ({} without /proc)."""
    kids: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return kids
    for d in names:
        if d.isdigit():
            f = _stat(int(d))
            try:
                kids.setdefault(int(f[1]), []).append(int(d))
            except (TypeError, IndexError, ValueError):
                continue
    return kids


def descendants(root: int) -> list[int]:
    """The pids under root, its children first (root itself left out)."""
    kids, out, todo = children_by_parent(), [], [root]
    while todo:
        for k in kids.get(todo.pop(0), []):
            out.append(k)
            todo.append(k)
    return out


def cmdline(pid: int) -> list[str]:
    """A process's argv ([] when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [x.decode(errors="replace") for x in f.read().split(b"\0") if x]
    except OSError:
        return []
