"""Gateway workers' shared clock board (gateway/clock_board.py): a worker's published prompts
reach its siblings' PrefillClock.ahead as if it had sent them itself; a dead writer's slot, a
slot caught mid-write and a never-written one are skipped; a restarted worker starts empty."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from gateway.clock_board import _HDR, _SEQ, KEEP, ClockBoard
from gateway.prefill_clock import PrefillClock


@pytest.fixture
def boards(tmp_path):
    path = str(tmp_path / "board")
    return ClockBoard(path, 2, 0, 3), ClockBoard(path, 2, 1, 3)


def test_published_prompts_reach_the_sibling(boards):
    a, b = boards
    assert b.others(1) == [([], -math.inf, [])]
    a.publish(1, [(10.0, 100), (10.5, 40)], 9.0, [(10.0, 100), (10.5, 40)])
    opens, done, recent = b.others(1)[0]
    assert opens == [(10.0, 100), (10.5, 40)] and done == 9.0 and recent == opens
    assert b.others(0) == [([], -math.inf, [])] and b.others(2) == [([], -math.inf, [])]
    assert a.others(1) == [([], -math.inf, [])]  # its own slot is not among its others
    many = [(float(i), i) for i in range(KEEP + 10)]
    a.publish(1, many, 0.0, [])
    assert b.others(1)[0][0] == many[-KEEP:]  # the newest kept


def test_dead_mid_write_and_unwritten_slots_are_skipped(tmp_path, boards):
    a, b = boards
    a.publish(0, [(1.0, 5)], 0.0, [])
    off = a._off(0, 0)
    seq = _SEQ.unpack_from(a._mm, off)[0]
    _SEQ.pack_into(a._mm, off, seq + 1)  # odd: a write in progress
    assert b.others(0) == []
    _SEQ.pack_into(a._mm, off, seq)
    assert b.others(0) != []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    _HDR.pack_into(a._mm, off, seq, int(dead), 0.0, 1, 0)
    assert b.others(0) == []  # its writer is gone, and its prompts with it
    fresh = ClockBoard(str(tmp_path / "other"), 3, 0, 1)
    assert fresh.others(0) == []  # slots 1 and 2 were never written


def test_a_restarted_worker_starts_empty(tmp_path, boards):
    a, b = boards
    a.publish(2, [(1.0, 5)], 0.0, [])
    ClockBoard(str(tmp_path / "board"), 2, 0, 3)  # worker 0 again, a new process in real life
    assert b.others(2) == [([], -math.inf, [])]


def test_ahead_merges_the_siblings_prompts(boards):
    a, b = boards
    mine, theirs = PrefillClock(peers=b.view(0)), PrefillClock(peers=a.view(0))
    theirs.admit(300, 100.0)  # the sibling's prompt runs since t=100
    k = mine.admit(50, 100.2)  # ours came after it: it waits for the running step
    ah = mine.ahead(100.3, budget=2048)
    assert ah.running_tokens == 300 and ah.queued_tokens == 50
    assert ah.elapsed_ms == pytest.approx(300.0)
    assert ah.tokens_per_ms == pytest.approx(350 / 500)
    alone = PrefillClock()
    alone.admit(50, 100.2)
    assert alone.ahead(100.3).running_tokens == 50  # without the board: the step looks like ours
    theirs.done(1, 100.4)  # their step ended: ours is the one running now
    ah = mine.ahead(100.5, budget=2048)
    assert ah.running_tokens == 50 and ah.queued_tokens == 0
    assert ah.elapsed_ms == pytest.approx(100.0)
    mine.done(k, 100.6)
    assert mine.ahead(100.7).running_tokens == 0


def test_bad_index_is_refused(tmp_path):
    with pytest.raises(ValueError, match="worker index 2"):
        ClockBoard(str(tmp_path / "b"), 2, 2, 1)
