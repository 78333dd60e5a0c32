"""`splitserve up --topology`: colocated by default without a GPU (decode on every core, the
gateway prefilling on decode), split one flag away or with a GPU; explicit flags win."""
from __future__ import annotations

import pytest

from splitserve_cli import up_topology as t


def _no_gpu():
    return 0


def _gpus():
    return 2


@pytest.mark.parametrize("topology, engine_args, gpu_flags, cuda, want", [
    ("auto", [], False, _no_gpu, "colocated"),
    ("auto", [], False, _gpus, "split"),
    ("auto", ["--device", "cpu"], False, _gpus, "colocated"),
    ("auto", ["--device=cuda:1"], False, _no_gpu, "split"),
    ("auto", [], True, _no_gpu, "split"),  # --prefill-gpu / --decode-gpu
    ("split", [], False, _no_gpu, "split"),
    ("colocated", [], False, _gpus, "colocated"),
])
def test_resolve(monkeypatch, topology, engine_args, gpu_flags, cuda, want):
    monkeypatch.delenv("SPLITSERVE_DEVICE", raising=False)
    assert t.resolve(topology, engine_args, gpu_flags, cuda) == want


def test_resolve_reads_the_device_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_DEVICE", "cpu")
    assert t.resolve("auto", [], False, _gpus) == "colocated"


def test_colocated_flags_give_decode_every_core(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CPU_THREADS", raising=False)
    extra, gw = t.colocated_flags([], [], 4)
    assert extra == {"prefill": ["--cpu-threads", "1"], "decode": ["--cpu-threads", "4"]}
    assert gw == ["--prefill-on-decode", "always"]


def test_colocated_flags_leave_what_the_user_gave(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CPU_THREADS", raising=False)
    extra, gw = t.colocated_flags(["--cpu-threads=3"], ["--prefill-on-decode=auto"], 4)
    assert extra == {"prefill": [], "decode": []} and gw == []
    monkeypatch.setenv("SPLITSERVE_CPU_THREADS", "2")
    assert t.colocated_flags([], [], 4)[0] == {"prefill": [], "decode": []}


def test_flag_value_and_cores():
    assert t.flag_value("--cpu-threads", ["--cpu-threads", "2", "--cpu-threads=5"]) == "5"
    assert t.flag_value("--cpu-threads", ["--cpu-threads"]) is None
    assert t.usable_cores() >= 1
