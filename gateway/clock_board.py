"""The gateway workers' shared view of the replicas' in-flight prompts (`splitserve up
--gateway-workers N`): each worker publishes its PrefillClock state (gateway/prefill_clock.py)
per replica into its own slot of one shared file, and reads its siblings' slots when it
predicts, so a worker's TTFT model sees the prompts every worker sent, as one gateway's would.

Slot (worker, replica): a sequence number (odd while its writer is mid-write: a seqlock, one
writer per slot), the writer's pid (a slot whose writer is dead is skipped: its prompts died
with it), the time the last of its prompts finished, its open prompts (admit time, tokens) and
its admits of the last RATE_WINDOW_S, at most KEEP of each (the newest). Times are
time.monotonic(), one clock for every process of the host.
"""
from __future__ import annotations

import math
import mmap
import os
import struct

import numpy as np

KEEP = 128  # open prompts and recent admits a slot holds
_HDR = struct.Struct("<QqdII")  # seq, pid, last_done, n_open, n_recent
_SEQ = struct.Struct("<Q")
_ENTRY = np.dtype([("t", "<f8"), ("k", "<u4")])
SLOT = _HDR.size + 2 * KEEP * _ENTRY.itemsize
_TRIES = 4  # reads of a slot caught mid-write before it is skipped this time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's pid: not our worker
        return False
    return True


class ClockBoard:
    """One worker's handle on the shared file (created, and sized, by whichever opens it first;
    every worker computes the same size from the same flags)."""

    def __init__(self, path: str, workers: int, index: int, replicas: int):
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} outside 0..{workers - 1}")
        if replicas < 1:
            raise ValueError("a board needs at least one replica")
        self.workers, self.index, self.replicas = workers, index, replicas
        size = workers * replicas * SLOT
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._pid = os.getpid()
        for r in range(replicas):  # a restarted worker's old prompts are gone
            self.publish(r, [], -math.inf, [])

    def _off(self, worker: int, replica: int) -> int:
        return (worker * self.replicas + replica) * SLOT

    def publish(self, replica: int, open_: list[tuple[float, int]], last_done: float,
                recent: list[tuple[float, int]]) -> None:
        mm, off = self._mm, self._off(self.index, replica)
        seq = _SEQ.unpack_from(mm, off)[0] | 1  # odd: readers retry
        _SEQ.pack_into(mm, off, seq)
        open_, recent = open_[-KEEP:], recent[-KEEP:]
        body = off + _HDR.size
        for start, rows in ((body, open_), (body + KEEP * _ENTRY.itemsize, recent)):
            if rows:
                np.frombuffer(mm, _ENTRY, len(rows), start)[:] = rows
        _HDR.pack_into(mm, off, seq, self._pid, last_done, len(open_), len(recent))
        _SEQ.pack_into(mm, off, seq + 1)

    def others(self, replica: int) -> list[tuple[list, float, list]]:
        """(open prompts, last finish, recent admits) of every live sibling for this replica."""
        out = []
        for w in range(self.workers):
            if w == self.index:
                continue
            got = self._read(self._off(w, replica))
            if got is not None:
                out.append(got)
        return out

    def _read(self, off: int):
        mm = self._mm
        body = off + _HDR.size
        for _ in range(_TRIES):
            seq, pid, last_done, n_open, n_recent = _HDR.unpack_from(mm, off)
            if seq & 1:
                continue
            if pid == 0:
                return None  # never written
            n_open, n_recent = min(n_open, KEEP), min(n_recent, KEEP)
            opens = np.frombuffer(mm, _ENTRY, n_open, body).tolist()
            recent = np.frombuffer(mm, _ENTRY, n_recent, body + KEEP * _ENTRY.itemsize).tolist()
            if _SEQ.unpack_from(mm, off)[0] == seq:
                return (opens, last_done, recent) if _alive(pid) else None
        return None

    def view(self, replica: int) -> "BoardView":
        return BoardView(self, replica)


class BoardView:
    """A PrefillClock's peers: its replica's slot on the board."""

    def __init__(self, board: ClockBoard, replica: int):
        self.board, self.replica = board, replica

    def publish(self, open_, last_done: float, recent) -> None:
        self.board.publish(self.replica, open_, last_done, recent)

    def others(self) -> list[tuple[list, float, list]]:
        return self.board.others(self.replica)
