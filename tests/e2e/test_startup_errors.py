"""Start-up errors are one line that says what is wrong: a busy port is found before any model
loads (by `up` for all its ports, by each service for its own), and `up` names the child that
failed and why."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from common.grpc_util import PortInUseError, check_ports_free
from tests.harness import ROOT, TINY_CPU, UP_PORTS, child_env, splitserve_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@contextlib.contextmanager
def busy_port():
    """A port someone else listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def _run(args: list[str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=timeout)
    return r, time.monotonic() - t0


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# ---- the check itself -----------------------------------------------------------------------

def test_check_ports_free():
    with busy_port() as p:
        with pytest.raises(PortInUseError) as e:
            check_ports_free("127.0.0.1", [("x gRPC", 0), ("y REST", p)])
        assert str(e.value) == f"port {p} (y REST) on 127.0.0.1 is already in use"
    check_ports_free("127.0.0.1", [("a", None), ("b", 0), ("c", -1)])  # nothing to bind
    with busy_port() as p:
        pass
    check_ports_free("127.0.0.1", [("freed", p)])
    with pytest.raises(PortInUseError, match=r"port 1234 is given twice \(a and b\)"):
        check_ports_free("127.0.0.1", [("a", 1234), ("b", 1234)])
    with pytest.raises(PortInUseError, match="cannot resolve host"):
        check_ports_free("no-such-host.invalid", [("a", 1234)])


def test_a_port_left_in_time_wait_is_free():
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    c = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end waits in TIME_WAIT
    c.close()
    srv.close()
    check_ports_free("127.0.0.1", [("reused", port)])


# ---- each service, before its model loads ------------------------------------------------------

@pytest.mark.parametrize("module,flag,label", [("prefill_svc", "--port", "prefill gRPC"),
                                               ("decode_svc", "--port", "decode gRPC"),
                                               ("decode_svc", "--metrics-port", "decode metrics")])
def test_service_with_a_busy_port_says_so_in_one_line_before_loading(module, flag, label):
    with busy_port() as p:
        args = [module, "--model", "default", "--device", "cpu"]
        args += ["--port", str(p)] if flag == "--port" else ["--port", "0", flag, str(p)]
        r, _ = _run(args)
    assert r.returncode == 2
    assert _lines(r.stderr) == [f"{module}: cannot start: port {p} ({label}) on 127.0.0.1 is "
                                f"already in use"], r.stderr
    assert "gguf" not in r.stdout + r.stderr  # the model was never opened


def test_gateway_with_a_busy_port_says_so_in_one_line():
    with busy_port() as p:
        r, _ = _run(["gateway", "--port", "0", "--http-port", str(p)])
    assert r.returncode == 2
    assert _lines(r.stderr) == [f"gateway: port {p} (gateway REST) on 127.0.0.1 is already in use"]


# ---- up ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,label", [("--http-port", "gateway REST"), ("--grpc-port", "gateway gRPC"),
                                        ("--prefill-port", "prefill gRPC"),
                                        ("--decode-port", "decode gRPC")])
def test_up_checks_every_port_before_starting_anything(flag, label):
    with busy_port() as p:
        ports = list(UP_PORTS)
        ports[ports.index(flag) + 1] = str(p)
        r, took = _run(["splitserve_cli", "up", *ports, *TINY_CPU])
    assert r.returncode == 2
    assert _lines(r.stderr) == [f"splitserve up: port {p} ({label}) on 127.0.0.1 is already in use"]
    assert took < 30  # nothing started (a service start imports torch and loads a model)


def test_up_rejects_a_port_given_twice():
    r, _ = _run(["splitserve_cli", "up", "--http-port", "18555", "--grpc-port", "0",
                 "--prefill-port", "18555", "--decode-port", "0", *TINY_CPU])
    assert r.returncode == 2
    assert _lines(r.stderr) == ["splitserve up: port 18555 is given twice (gateway REST and "
                                "prefill gRPC)"]


def test_up_names_the_child_that_failed_and_why(tmp_path):
    missing = str(tmp_path / "no-model")
    r, _ = _run(["splitserve_cli", "up", *UP_PORTS, "--model", missing, "--device", "cpu"], 120)
    assert r.returncode == 1
    last = _lines(r.stderr)[-1]
    assert re.fullmatch(r"splitserve up: (prefill|decode) failed before it was ready \(exit code 2: "
                        r"(prefill|decode)_svc: cannot start: model '.*no-model' not found.*\)",
                        last), r.stderr


def test_up_names_a_child_that_dies_later():
    with splitserve_up([*UP_PORTS, "--max-restarts", "0", *TINY_CPU]) as up:
        decode_port = re.search(r"decode\s+127\.0\.0\.1:(\d+)", up.log()).group(1)
        pid = _listener_pid(int(decode_port))
        os.kill(pid, signal.SIGKILL)
        assert up.popen.wait(60) == 1
    last = _lines(up.log())[-1]
    assert last == ("splitserve up: decode stopped (killed by SIGKILL (out of memory?)); the others "
                    "were stopped"), last


def _listener_pid(port: int) -> int:
    """The pid of the process listening on 127.0.0.1:port (from /proc)."""
    hexport = f"{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[1].endswith(":" + hexport) and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")
