"""PairGroup's thread without a peer (a fake process group): ops complete in order with up to
WINDOW in flight, the first failure breaks the group for good (queued and later ops fail at
once, on_broken fires once), and the watchdog fails a call that ignores its timeout."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtransfer.backends.dist_group import PairGroup
from kvtransfer.state import TransferError

pytestmark = pytest.mark.timeout(30)


class Work:
    def __init__(self, pg, i):
        self.pg, self.i = pg, i

    def wait(self, timeout=None):
        self.pg.waits.append(self.i)
        if self.i in self.pg.fail_at:
            raise RuntimeError("Connection closed by peer")
        if self.i in self.pg.hang_at:
            threading.Event().wait()  # ignores its timeout, like a stuck driver call
        return True


class FakePG:
    def __init__(self, fail_at=(), hang_at=()):
        self.issued, self.waits, self.aborted = [], [], 0
        self.fail_at, self.hang_at = set(fail_at), set(hang_at)

    def send(self, tensors, peer, tag):
        self.issued.append(("send", tensors[0].numel()))
        return Work(self, len(self.issued) - 1)

    def recv(self, tensors, peer, tag):
        tensors[0].fill_(len(self.issued))
        self.issued.append(("recv", tensors[0].numel()))
        return Work(self, len(self.issued) - 1)

    def abort(self):
        self.aborted += 1


def _group(pg, broken=None):
    return PairGroup(pg, 0, "gloo", "cpu", "test-pair", on_broken=(broken.append if broken is not None else None))


def test_ops_complete_in_order():
    pg = FakePG()
    g = _group(pg)
    futs = [g.submit_send(torch.zeros(10 + i, dtype=torch.uint8), 5) for i in range(6)]
    futs.append(g.submit_recv(7, 5, out=torch.empty(16, dtype=torch.uint8)))
    assert [f.result(5) for f in futs[:6]] == [10, 11, 12, 13, 14, 15]
    got = futs[6].result(5)
    assert got.numel() == 7 and int(got[0]) == 6  # a view of the given buffer, filled by recv 6
    assert pg.waits == list(range(7))
    g.close()
    assert g.join(5)


def test_first_failure_breaks_the_group_for_good():
    pg, broken = FakePG(fail_at={1}), []
    g = _group(pg, broken)
    futs = [g.submit_send(torch.zeros(4, dtype=torch.uint8), 5) for _ in range(3)]
    assert futs[0].result(5) == 4
    with pytest.raises(TransferError, match="Connection closed"):
        futs[1].result(5)
    with pytest.raises(TransferError, match="broken"):
        futs[2].result(5)
    with pytest.raises(TransferError, match="broken"):  # later ops fail at once
        g.submit_recv(4, 5).result(1)
    assert broken == [g.broken] and pg.aborted == 1
    g.close("done", orderly=False)
    assert g.join(5) and broken == [g.broken]  # fired once


def test_watchdog_fails_a_call_that_ignores_its_timeout(monkeypatch):
    monkeypatch.setattr(PairGroup, "GRACE_S", 0.3)
    pg, broken = FakePG(hang_at={0}), []
    g = _group(pg, broken)
    t0 = time.monotonic()
    f0 = g.submit_send(torch.zeros(4, dtype=torch.uint8), 0.2)
    f1 = g.submit_send(torch.zeros(4, dtype=torch.uint8), 0.2)
    with pytest.raises(TransferError, match="watchdog"):
        f0.result(10)
    with pytest.raises(TransferError):
        f1.result(10)
    assert time.monotonic() - t0 < 3
    assert broken and "watchdog" in broken[0] and pg.aborted == 1


def test_recv_allocator_runs_on_the_group_thread_when_issued():
    pg, calls = FakePG(), []

    def alloc(n):
        calls.append((n, threading.current_thread().name))
        return torch.empty(n + 3, dtype=torch.uint8)

    g = _group(pg)
    futs = [g.submit_recv(5 + i, 5, out=alloc) for i in range(3)]
    assert [f.result(5).numel() for f in futs] == [5, 6, 7]
    assert [n for n, _ in calls] == [5, 6, 7]
    assert all(name.startswith("kv-pair-") for _, name in calls)
    g.close()
    assert g.join(5)
