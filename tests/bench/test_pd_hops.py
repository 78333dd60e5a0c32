"""bench.pd_hops (per-hop ITL means, CPU shares, finding `up`'s services) and
bench.client_pool (splitting a case over client processes)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.client_pool import split
from bench.pd_hops import itl_means, service_pids
from bench.procfs import cpu_seconds

_ITL = "splitserve_inter_token_latency_seconds"


def test_itl_means_per_hop_over_the_case_only():
    before = {"t": 10.0, f"decode:{_ITL}_sum": 1.0, f"decode:{_ITL}_count": 100.0,
              f"gateway:{_ITL}_sum": 2.0, f"gateway:{_ITL}_count": 100.0, "cpu_s:decode": 5.0}
    after = {"t": 12.0, f"decode:{_ITL}_sum": 1.2, f"decode:{_ITL}_count": 200.0,
             f"gateway:{_ITL}_sum": 2.3, f"gateway:{_ITL}_count": 200.0, "cpu_s:decode": 6.5,
             "cpu_s:gateway": 3.0}  # no gateway CPU before: no share
    out = itl_means(before, after)
    assert out["decode_itl_ms_mean"] == pytest.approx(2.0)
    assert out["gateway_itl_ms_mean"] == pytest.approx(3.0)
    assert out["decode_cpu_share"] == pytest.approx(0.75)
    assert "gateway_cpu_share" not in out


def test_itl_means_skips_a_hop_without_gaps():
    s = {"t": 1.0, f"decode:{_ITL}_sum": 1.0, f"decode:{_ITL}_count": 5.0}
    assert itl_means(s, dict(s)) == {}


def test_cpu_seconds_grows_with_work_and_is_none_for_no_process():
    t0 = cpu_seconds(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert cpu_seconds(os.getpid()) - t0 >= 0.1
    assert cpu_seconds(2**22 + 12345) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")
def test_service_pids_finds_services_by_module_under_the_root():
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', "
            "'-m', 'decode_svc']); print(p.pid, flush=True); time.sleep(30)")
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(root.stdout.readline())
        pids = service_pids(root.pid)
        assert pids["decode"] == child and pids["client"] == os.getpid()
        assert "gateway" not in pids
    finally:
        subprocess.run(["pkill", "-P", str(root.pid)], check=False)
        root.kill()
        root.wait()


def test_split_deals_round_robin_and_drops_empty_parts():
    assert split(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert split([1, 2], 4) == [[1], [2]]
    assert split([], 3) == []
