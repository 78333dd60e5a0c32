"""`splitserve up --gateway-workers 2`: two gateway processes share the REST and gRPC ports.
Requests on fresh connections (REST and gRPC) all succeed and reach both workers; /metrics,
whichever worker answers it, counts every request; a worker killed with SIGKILL comes back on
the same ports while the other serves, and the dead one's counts stay in the sums; SIGTERM
stops them all cleanly."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import grpc
import httpx
import pytest

from protos import generate_pb2, generate_pb2_grpc
from tests.harness import TINY_CPU, UP_PORTS, splitserve_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _workers(up) -> dict[int, str]:
    """-> {pid: multiprocess metrics directory} of the gateway processes under `up`."""
    out = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up.popen.pid and b"gateway" in argv and b"-m" in argv:
            i = argv.index(b"--poll-interval")  # workers poll the replicas' Load more often
            assert float(argv[i + 1]) < 0.5, argv
            assert b"--worker-board" in argv and argv[argv.index(b"--workers") + 1] == b"2", argv
            out[pid] = env.get(b"PROMETHEUS_MULTIPROC_DIR", b"").decode()
    return out


def _finished_by(path: str, pid: int) -> float:
    """Requests the worker `pid` finished, read from its own counter file."""
    from prometheus_client.mmap_dict import MmapedDict

    total = 0.0
    for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(
            os.path.join(path, f"counter_{pid}.db")):
        if json.loads(key)[1] == "splitserve_requests_total":
            total += value
    return total


def _rest_total(up) -> float:
    with httpx.Client(timeout=10) as c:  # a fresh connection: any worker may answer
        body = c.get(up.rest + "/metrics").text
    return sum(float(v) for v in re.findall(r"^splitserve_requests_total\{[^}]*\} (\S+)$", body, re.M))


def _complete() -> dict:
    return {"model": "dummy-tiny-llama", "prompt": "hello there", "max_tokens": 3}


def _rest_one(up) -> None:
    with httpx.Client(timeout=30) as c:
        r = c.post(up.rest + "/v1/completions", json=_complete())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def _grpc_one(up) -> None:
    # a channel of its own (no shared subchannel): a connection of its own
    with grpc.insecure_channel(up.grpc_address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(range(200, 212))),
                                           max_tokens=3, ignore_eos=True,
                                           sampling=generate_pb2.SamplingParams(temperature=0.0))
        n = sum(len(r.token_ids) for r in generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30))
    assert n == 3


def test_gateway_workers_share_ports_metrics_and_survive_a_kill():
    with splitserve_up([*UP_PORTS, *TINY_CPU, "--gateway-workers", "2"]) as up:
        workers = _workers(up)
        assert len(workers) == 2, up.log()
        path = next(iter(workers.values()))
        assert path and all(p == path for p in workers.values()), workers
        for _ in range(12):
            _rest_one(up)
            _grpc_one(up)
        per = {pid: _finished_by(path, pid) for pid in workers}
        assert sum(per.values()) == 24 and all(v > 0 for v in per.values()), per
        for _ in range(4):  # whichever worker answers, it counts both
            assert _rest_total(up) == 24
        with httpx.Client(timeout=10) as c:  # the gateway's series only, though every
            body = c.get(up.rest + "/metrics").text  # process writes all it creates
        assert "splitserve_admission_decisions_total" in body and "splitserve_replica_up" in body
        assert "splitserve_engine_steps" not in body and "splitserve_kv_cache_usage" not in body
        victim = sorted(workers)[-1]
        os.kill(victim, signal.SIGKILL)
        served = 0
        deadline = time.monotonic() + 60
        while "is back" not in up.log():  # the other keeps serving meanwhile
            assert time.monotonic() < deadline, up.log()[-3000:]
            _rest_one(up)
            served += 1
        after = _workers(up)
        assert len(after) == 2 and victim not in after, (after, up.log()[-3000:])
        for _ in range(6):
            _rest_one(up)
            _grpc_one(up)
        total = 24 + served + 12
        assert _rest_total(up) == total  # the killed worker's counts are kept
        assert sum(_finished_by(path, pid) for pid in set(workers) | set(after)) == total
        up.popen.send_signal(signal.SIGTERM)  # every worker drains, then the services
        assert up.popen.wait(60) == 0, up.log()[-3000:]
