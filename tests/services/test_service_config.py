"""Service configuration: SPLITSERVE_* env defaults, flags win, bad values fail with a clear
message (and a bad flag makes the service exit 2 before loading anything)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from common.envs import EnvError, env_bool, env_int
from common.service_args import engine_config_from_args
from engine.config import ConfigError
from prefill_svc.__main__ import parse_args as prefill_args
from decode_svc.__main__ import parse_args as decode_args
from tests.harness import ROOT


def test_env_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_MODEL", "dummy:tiny-qwen2")
    monkeypatch.setenv("SPLITSERVE_BLOCK_SIZE", "32")
    monkeypatch.setenv("SPLITSERVE_ENFORCE_EAGER", "true")
    a = prefill_args(["--max-num-seqs", "4"])
    cfg = engine_config_from_args(a)
    assert cfg.model.model == "dummy:tiny-qwen2" and cfg.cache.block_size == 32
    assert cfg.device.enforce_eager and cfg.scheduler.max_num_seqs == 4
    assert cfg.cache.enable_prefix_caching
    a = decode_args(["--block-size", "16", "--kv-cache-dtype", "fp8_e4m3", "--num-blocks", "10"])
    cfg = engine_config_from_args(a, prefix_caching=False)
    assert cfg.cache.block_size == 16 and cfg.cache.kv_cache_dtype == "fp8_e4m3"
    assert cfg.cache.num_blocks == 10 and not cfg.cache.enable_prefix_caching
    assert a.host == "127.0.0.1" and a.port == 50071 and a.metrics_port is None
    assert engine_config_from_args(decode_args(["--device", "cuda"])).device.device == "cuda:0"
    assert engine_config_from_args(decode_args(["--device", "cpu"])).device.device == "cpu"


def test_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_NUM_BLOCKS", "lots")
    with pytest.raises(EnvError, match="SPLITSERVE_NUM_BLOCKS"):
        env_int("SPLITSERVE_NUM_BLOCKS")
    monkeypatch.setenv("SPLITSERVE_ENFORCE_EAGER", "maybe")
    with pytest.raises(EnvError, match="boolean"):
        env_bool("SPLITSERVE_ENFORCE_EAGER")
    monkeypatch.delenv("SPLITSERVE_NUM_BLOCKS")
    monkeypatch.delenv("SPLITSERVE_ENFORCE_EAGER")
    with pytest.raises(ConfigError, match="block_size"):
        engine_config_from_args(prefill_args(["--block-size", "7"]))


def test_bad_flag_exits_2_with_message():
    r = subprocess.run([sys.executable, "-m", "decode_svc", "--block-size", "7", "--model",
                        "dummy:tiny-llama", "--insecure-internal"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "block_size must be 16 or 32" in r.stderr


def test_cuda_graph_flags(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CUDA_GRAPH_MAX_PREFILL_TOKENS", "256")
    d = engine_config_from_args(prefill_args([])).device
    assert d.cuda_graph_max_prefill_tokens == 256 and d.cuda_graph_max_batch is None
    d = engine_config_from_args(decode_args(["--cuda-graph-max-prefill-tokens", "0",
                                             "--cuda-graph-max-batch", "16"])).device
    assert d.cuda_graph_max_prefill_tokens == 0 and d.cuda_graph_max_batch == 16
    with pytest.raises(ConfigError, match="cuda_graph_max_prefill_tokens"):
        engine_config_from_args(prefill_args(["--cuda-graph-max-prefill-tokens", "-5"]))
    monkeypatch.delenv("SPLITSERVE_CUDA_GRAPH_MAX_PREFILL_TOKENS")
    assert engine_config_from_args(prefill_args([])).device.cuda_graph_max_prefill_tokens == 2048
    # decode prefills only to recompute preempted requests: no prefill graphs unless asked for
    cfg = engine_config_from_args(decode_args([]), prefix_caching=False, role="decode")
    assert cfg.device.cuda_graph_max_prefill_tokens == 0
    cfg = engine_config_from_args(decode_args(["--cuda-graph-max-prefill-tokens", "512"]),
                                  role="decode")
    assert cfg.device.cuda_graph_max_prefill_tokens == 512
    from engine.generate import build_config, parse_args as generate_args

    d = build_config(generate_args(["--prompt", "x", "--cuda-graph-max-prefill-tokens", "128",
                                    "--cuda-graph-max-batch", "4"])).device
    assert d.cuda_graph_max_prefill_tokens == 128 and d.cuda_graph_max_batch == 4


def test_skinny_gemm_flag(monkeypatch):
    from common.service_args import add_engine_args, engine_config_from_args
    import argparse

    def parse(argv):
        p = argparse.ArgumentParser()
        add_engine_args(p)
        return p.parse_args(argv)

    assert engine_config_from_args(parse([])).device.skinny_gemm_max_batch is None
    assert engine_config_from_args(parse(["--skinny-gemm-max-batch", "0"])).device.skinny_gemm_max_batch == 0
    monkeypatch.setenv("SPLITSERVE_SKINNY_GEMM_MAX_BATCH", "4")
    assert engine_config_from_args(parse([])).device.skinny_gemm_max_batch == 4
    with pytest.raises(ConfigError, match="skinny_gemm_max_batch"):
        engine_config_from_args(parse(["--skinny-gemm-max-batch", "65"]))


def test_kv_transfer_backend_flag_and_env(monkeypatch):
    from common.service_args import kv_backend_from_args as from_args
    from kvtransfer.endpoint import BACKENDS, backend_unavailable

    def kv_backend_from_args(a):
        return from_args(a, BACKENDS, backend_unavailable)

    assert kv_backend_from_args(prefill_args([])) == "auto"  # default
    monkeypatch.setenv("SPLITSERVE_KV_TRANSFER_BACKEND", "dist")
    assert kv_backend_from_args(prefill_args([])) == "dist"
    assert kv_backend_from_args(decode_args([])) == "dist"
    assert kv_backend_from_args(decode_args(["--kv-transfer-backend", "grpc"])) == "grpc"  # flag wins
    monkeypatch.setenv("SPLITSERVE_KV_TRANSFER_BACKEND", "rdma")
    with pytest.raises(ConfigError, match="SPLITSERVE_KV_TRANSFER_BACKEND"):
        kv_backend_from_args(prefill_args([]))
    with pytest.raises(ConfigError, match="kv-pair-timeout"):
        kv_backend_from_args(prefill_args(["--kv-transfer-backend", "dist", "--kv-pair-timeout-s", "0"]))


def test_async_scheduling_flag(monkeypatch):
    assert engine_config_from_args(prefill_args([])).scheduler.async_scheduling is None  # auto
    assert engine_config_from_args(decode_args(["--async-scheduling", "off"])).scheduler.async_scheduling is False
    monkeypatch.setenv("SPLITSERVE_ASYNC_SCHEDULING", "on")
    assert engine_config_from_args(decode_args([])).scheduler.async_scheduling is True
    monkeypatch.setenv("SPLITSERVE_ASYNC_SCHEDULING", "sometimes")
    with pytest.raises(ConfigError, match="async scheduling must be one of"):
        engine_config_from_args(decode_args([]))


def test_gil_switch_interval(monkeypatch):
    from common.service_args import apply_switch_interval

    before = sys.getswitchinterval()
    try:
        monkeypatch.setenv("SPLITSERVE_GIL_SWITCH_INTERVAL_MS", "0.5")
        a = decode_args([])
        assert a.gil_switch_interval_ms == 0.5
        apply_switch_interval(a.gil_switch_interval_ms)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        apply_switch_interval(None)  # unset keeps what is there
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        for bad in (0.0, -1.0, 5000.0):
            with pytest.raises(ConfigError, match="gil-switch-interval-ms"):
                apply_switch_interval(bad)
    finally:
        sys.setswitchinterval(before)
