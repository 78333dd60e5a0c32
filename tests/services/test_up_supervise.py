"""splitserve_cli/supervise.py without processes: a restarted child keeps its ports, the
backoff doubles while it keeps dying, --max-restarts ends it (0: the old stop-all)."""
from __future__ import annotations

from splitserve_cli import supervise
from splitserve_cli.supervise import Supervisor, pin_flag, pinned_argv


def test_pin_flag_replaces_either_form_or_appends():
    assert pin_flag(["-m", "x", "--port", "0", "--a"], "--port", "5") == ["-m", "x", "--port", "5", "--a"]
    assert pin_flag(["--port=0"], "--port", "5") == ["--port=5"]
    assert pin_flag(["--x", "1"], "--port", "5") == ["--x", "1", "--port", "5"]


def test_pinned_argv_keeps_the_ports_of_the_first_start():
    argv = ["py", "-m", "decode_svc", "--port", "0", "--metrics-port", "0"]
    assert pinned_argv("decode", argv, ["4001", "4002"])[-4:] == ["--port", "4001", "--metrics-port", "4002"]
    assert pinned_argv("decode", ["--port", "0"], ["4001", "-1"]) == ["--port", "4001"]
    gw = pinned_argv("gateway", ["--port", "0", "--http-port", "0"], ["5001", "5002"])
    assert gw == ["--port", "5001", "--http-port", "5002"]


class _Proc:
    pid = 1


class _Child:
    def __init__(self, name, argv=(), ready_file="/nonexistent/ready", alive=True):
        self.name, self.argv, self.ready_file, self._alive = name, list(argv), ready_file, alive
        self.proc = _Proc()

    def alive(self):
        return self._alive

    def ready(self):
        return ["1", "2"] if self._alive else None

    def why(self):
        return "killed by SIGKILL"


def _sup(max_restarts, spawned):
    def spawn(name, argv, rf, restarts):
        c = _Child(name, argv, rf, alive=False)  # every restart dies again at once
        spawned.append(c)
        return c
    kids = [_Child("decode", ["--port", "0"])]
    return Supervisor(kids, {"decode": ["7001", "-1"]}, spawn, max_restarts=max_restarts,
                      drain_timeout_s=1.0)


def test_restart_on_the_same_port_with_doubling_backoff(monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr(supervise.time, "monotonic", lambda: now[0])
    spawned = []
    sup = _sup(3, spawned)
    slot = sup.slots["decode"]
    slot.child._alive = False
    waits = []
    for _ in range(3):
        assert sup._check("decode", slot, now[0]) is None  # found dead: a restart is scheduled
        waits.append(slot.restart_at - now[0])
        now[0] = slot.restart_at
        assert sup._check("decode", slot, now[0]) is None  # restarted
    assert waits == [1.0, 2.0, 4.0]
    assert [c.argv for c in spawned] == [["--port", "7001"]] * 3
    why = sup._check("decode", slot, now[0])  # the 4th death in a row: past max_restarts=3
    assert why.startswith("decode stopped (killed by SIGKILL) after 3 restart(s) in a row")
    assert "restart 1 in 1 s" in capsys.readouterr().err


def test_max_restarts_zero_stops_all_at_the_first_death():
    sup = _sup(0, [])
    slot = sup.slots["decode"]
    slot.child._alive = False
    assert sup._check("decode", slot, 0.0) == "decode stopped (killed by SIGKILL); the others were stopped"
