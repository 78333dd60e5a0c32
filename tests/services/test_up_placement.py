"""`splitserve up --prefill-gpu N --decode-gpu M`: each service on its own device, the services'
default backend (auto: vmm on one host) unless one is given, and clear errors (before anything starts) for flags that cannot work."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from splitserve_cli import up
from tests.harness import ROOT


def _args(*argv):
    p = argparse.ArgumentParser()
    up.add_args(p)
    return p.parse_known_args(list(argv))


def _place(*argv, cuda=2):
    a, rest = _args(*argv)
    return up.placement(a, rest, cuda_count=cuda)


def test_two_gpus_get_their_devices_and_the_services_default(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KV_TRANSFER_BACKEND", raising=False)
    extra, backend = _place("--prefill-gpu", "0", "--decode-gpu", "1")
    assert extra == {"prefill": ["--device", "cuda:0"], "decode": ["--device", "cuda:1"]}
    assert backend is None  # the services' default: auto
    assert _place("--prefill-gpu", "1", "--decode-gpu", "0", "--kv-transfer-backend", "dist")[1] == "dist"
    assert _place("--prefill-gpu", "0", "--decode-gpu", "0")[1] is None
    assert _place(cuda=0) == ({"prefill": [], "decode": []}, None)  # no GPU flags: as before
    monkeypatch.setenv("SPLITSERVE_KV_TRANSFER_BACKEND", "grpc")
    assert _place("--prefill-gpu", "0", "--decode-gpu", "1")[1] == "grpc"  # env wins over the default


@pytest.mark.parametrize("argv, cuda, msg", [
    (["--prefill-gpu", "0", "--decode-gpu", "0", "--kv-transfer-backend", "dist"], 2, "NCCL cannot pair"),
    (["--prefill-gpu", "0", "--decode-gpu", "1"], 0, "no GPU"),
    (["--prefill-gpu", "0", "--decode-gpu", "2"], 2, "has 2 GPU"),
    (["--prefill-gpu", "0"], 2, "go together"),
    (["--prefill-gpu", "0", "--decode-gpu", "1", "--device", "cuda"], 2, "conflicts"),
])
def test_flags_that_cannot_work_are_refused(argv, cuda, msg):
    with pytest.raises(up.UpError, match=msg):
        _place(*argv, cuda=cuda)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_gpu_flags_on_a_cpu_machine_exit_2_before_starting_anything():
    r = subprocess.run([sys.executable, "-m", "splitserve_cli", "up", "--prefill-gpu", "0",
                        "--decode-gpu", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "torch sees no GPU" in r.stderr, r.stderr
