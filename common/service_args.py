"""Argparse flags shared by prefill_svc and decode_svc, and the EngineConfig built from them.

Defaults come from SPLITSERVE_* variables (common/envs.py); an explicit flag wins. The
config is built once in main() and validated by the engine's frozen dataclasses.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Callable, Sequence

from common.auth import add_args as add_auth_args
from common.envs import env_bool, env_float, env_int, env_str
from engine.config import (ASYNC_SCHEDULING, CacheConfig, ConfigError, DeviceConfig, EngineConfig,
                           ModelConfig, SchedulerConfig)

DEFAULT_PREFILL_GRAPH_TOKENS = DeviceConfig.cuda_graph_max_prefill_tokens


def add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default=env_str("SPLITSERVE_HOST", "127.0.0.1"),
                   help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=default_port, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0 picks a free one; default off)")
    p.add_argument("--log-level", default=None, help="DEBUG/INFO/WARNING (SPLITSERVE_LOG_LEVEL)")
    p.add_argument("--ready-file", default=None,
                   help="write 'grpc_port metrics_port' here once serving (tests, supervisors)")
    p.add_argument("--profile-dir", default=None,
                   help="allow `splitserve profile`: torch.profiler traces of N engine steps are "
                        "written here as Chrome trace JSON (default off)")
    p.add_argument("--drain-timeout-s", type=float, default=env_float("SPLITSERVE_DRAIN_TIMEOUT_S", 30.0),
                   help="on SIGTERM / SIGINT: refuse new work, let requests in flight finish for "
                        "up to this long, then exit")
    p.add_argument("--gil-switch-interval-ms", type=float,
                   default=env_float("SPLITSERVE_GIL_SWITCH_INTERVAL_MS", None),
                   help="sys.setswitchinterval for this process: how long the engine thread "
                        "or the gRPC event loop may hold the GIL while the other waits "
                        "(Python's default 5 ms; unset keeps it)")
    add_auth_args(p)


def apply_switch_interval(ms: float | None) -> None:
    """--gil-switch-interval-ms: None keeps Python's default; ConfigError outside (0, 1000]."""
    if ms is None:
        return
    if not 0 < ms <= 1000:
        raise ConfigError(f"--gil-switch-interval-ms / SPLITSERVE_GIL_SWITCH_INTERVAL_MS={ms}: "
                          "want 0 < ms <= 1000")
    sys.setswitchinterval(ms / 1000)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=env_str("SPLITSERVE_MODEL", "default"),
                   help="'default', a HF dir, a .gguf file or dummy:<shape>")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default=env_str("SPLITSERVE_DTYPE", "auto"))
    g.add_argument("--device", default=env_str("SPLITSERVE_DEVICE", "auto"))
    g.add_argument("--seed", type=int, default=env_int("SPLITSERVE_SEED", 0))
    g.add_argument("--block-size", type=int, default=env_int("SPLITSERVE_BLOCK_SIZE", 16))
    g.add_argument("--kv-cache-dtype", default=env_str("SPLITSERVE_KV_CACHE_DTYPE", "auto"))
    g.add_argument("--num-blocks", type=int, default=env_int("SPLITSERVE_NUM_BLOCKS"))
    g.add_argument("--kv-cache-bytes", type=int, default=env_int("SPLITSERVE_KV_CACHE_BYTES"))
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=env_int("SPLITSERVE_MAX_NUM_SEQS", 128))
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=env_int("SPLITSERVE_MAX_NUM_BATCHED_TOKENS"),
                   help="tokens a step may schedule (prompt chunks + decode rows); default "
                        f"{BATCHED_TOKENS['cuda']} on a GPU, {BATCHED_TOKENS['cpu']} on CPU")
    g.add_argument("--max-model-len", type=int, default=env_int("SPLITSERVE_MAX_MODEL_LEN"))
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true",
                   default=env_bool("SPLITSERVE_ENFORCE_EAGER", False))
    g.add_argument("--cuda-graph-max-batch", type=int,
                   default=env_int("SPLITSERVE_CUDA_GRAPH_MAX_BATCH"),
                   help="largest decode batch replayed through a CUDA graph (default max-num-seqs)")
    g.add_argument("--cuda-graph-max-prefill-tokens", type=int,
                   default=env_int("SPLITSERVE_CUDA_GRAPH_MAX_PREFILL_TOKENS"),
                   help="largest prefill/mixed step (tokens) replayed through a CUDA graph, capped "
                        "by max-num-batched-tokens; larger steps run eager; 0 disables (default "
                        f"{DEFAULT_PREFILL_GRAPH_TOKENS}; 0 on decode, which prefills only to "
                        "recompute preempted requests)")
    g.add_argument("--skinny-gemm-max-batch", type=int,
                   default=env_int("SPLITSERVE_SKINNY_GEMM_MAX_BATCH"),
                   help="decode batches up to this size use the fused skinny-GEMM Triton kernels "
                        "(CUDA); larger ones cuBLAS; 0 disables (default: the tuned table of "
                        "the GPU, engine/kernels/configs)")
    g.add_argument("--async-scheduling", choices=tuple(ASYNC_SCHEDULING),
                   default=env_str("SPLITSERVE_ASYNC_SCHEDULING", "auto"),
                   help="overlapped decode: launch the next decode step before the current "
                        "step's tokens reach the host, hiding the host's per-step work "
                        "(engine/overlap.py); auto: on for CUDA, off on CPU")
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--cpu-threads", type=int, default=env_int("SPLITSERVE_CPU_THREADS"),
                   help="CPU intra-op threads for this engine (default on CPU: half the cores, "
                        "since prefill and decode usually share the host)")
    g.add_argument("--cpu-one-row-matmul", choices=("auto", "torch"),
                   default=env_str("SPLITSERVE_CPU_ONE_ROW_MATMUL", "auto"),
                   help="CPU fp32, one decode row: auto = per weight shape the faster of F.linear "
                        "and oneDNN's packed copy, timed at load; torch = F.linear")
    g.add_argument("--cpu-kernels", choices=("auto", "native", "torch"),
                   default=env_str("SPLITSERVE_CPU_KERNELS", "auto"),
                   help="CPU C kernels (paged attention, fp32 add+RMSNorm, SiLU-and-mul, rotary), "
                        "compiled here at first use: native = required (needs a C compiler); "
                        "auto = when they build, else torch ops; torch = torch ops only")


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kv transfer")
    g.add_argument("--kv-transfer-backend", default=env_str("SPLITSERVE_KV_TRANSFER_BACKEND", "auto"),
                   help="auto (default: vmm / shm when prefill and decode share a host, else "
                        "grpc) | vmm (decode maps prefill's CUDA KV pool and copies device to "
                        "device) | shm (the same in CPU shared memory) | grpc (any host, KV "
                        "staged through host memory) | dist (torch.distributed point-to-point "
                        "per pair: NCCL between GPUs, gloo between CPU caches) | nixl (needs the "
                        "nixl package). Decode always accepts grpc too; prefill falls back to "
                        "grpc when a pair cannot use the selected backend")
    g.add_argument("--kv-pair-timeout-s", type=float,
                   default=env_float("SPLITSERVE_KV_PAIR_TIMEOUT_S", 30.0),
                   help="dist / nixl: pair setup timeout and per-layer transfer timeout")


def kv_backend_from_args(a: argparse.Namespace, backends: Sequence[str],
                         unavailable: Callable[[str], str | None]) -> str:
    """-> the validated --kv-transfer-backend; ConfigError names the problem (exit 2).
    backends: the known names; unavailable(name): why it cannot run here, or None (the
    services pass kvtransfer.endpoint's BACKENDS and backend_unavailable)."""
    b = a.kv_transfer_backend
    if b not in backends:
        raise ConfigError(f"--kv-transfer-backend / SPLITSERVE_KV_TRANSFER_BACKEND={b!r}: "
                          f"use one of {', '.join(backends)}")
    why = unavailable(b)
    if why is not None:
        raise ConfigError(why)
    if a.kv_pair_timeout_s <= 0:
        raise ConfigError(f"--kv-pair-timeout-s must be > 0, got {a.kv_pair_timeout_s}")
    return b


def pair_host(host: str) -> str:
    """An address peers can reach this process on (a wildcard bind is not one)."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]", "") else host


def _device(device: str) -> str:
    """'cuda' / 'auto' (with a GPU) -> 'cuda:0'. NOTE: torch.cuda.set_device rejects an
    index-less torch.device('cuda') on torch 2.11, which Engine calls with the resolved name."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if device == "cuda" else device


# Default step token budget per device. CPU: a burst of prompts is prefilled in 256-token
# chunks, so the first prompts answer while later ones wait (a 32-prompt burst's median TTFT is
# about half of one 2048-token step's; measure: python -m bench.peer_cpu --streams 32
# --variant b2048:--max-num-batched-tokens=2048 --variant b256:--max-num-batched-tokens=256)
BATCHED_TOKENS = {"cuda": 2048, "cpu": 256}


def _cpu_threads(device: str, threads: int | None) -> int | None:
    # NOTE: two engines each running torch's default (all cores) on one small host spin
    # against each other in OpenMP and run ~10x slower; split the cores between them.
    if threads is not None or device != "cpu":
        return threads
    return max(1, (os.cpu_count() or 2) // 2)


def engine_config_from_args(a: argparse.Namespace, *, prefix_caching: bool = True,
                            role: str | None = None) -> EngineConfig:
    """-> validated EngineConfig; raises ConfigError with the offending value named.
    role "decode": prefill CUDA graphs default to off (that service prefills only to recompute
    preempted requests, mostly mixed with more decode rows than a prefill graph holds, and its
    GPU memory is better spent on KV blocks)."""
    device = _device(a.device)
    async_scheduling = getattr(a, "async_scheduling", "auto")
    if async_scheduling not in ASYNC_SCHEDULING:  # an environment default skips argparse's check
        raise ConfigError(f"async scheduling must be one of {tuple(ASYNC_SCHEDULING)}, "
                          f"got {async_scheduling!r}")
    prefill_graph_tokens = a.cuda_graph_max_prefill_tokens
    if prefill_graph_tokens is None:
        prefill_graph_tokens = 0 if role == "decode" else DEFAULT_PREFILL_GRAPH_TOKENS
    try:
        return EngineConfig(
            model=ModelConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                              seed=a.seed, served_model_name=a.served_model_name),
            cache=CacheConfig(block_size=a.block_size, kv_cache_dtype=a.kv_cache_dtype,
                              gpu_memory_utilization=a.gpu_memory_utilization,
                              kv_cache_bytes=a.kv_cache_bytes, num_blocks=a.num_blocks,
                              enable_prefix_caching=prefix_caching and not a.no_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs,
                                      max_num_batched_tokens=a.max_num_batched_tokens or BATCHED_TOKENS[
                                          "cpu" if device == "cpu" else "cuda"],
                                      async_scheduling=ASYNC_SCHEDULING[async_scheduling]),
            device=DeviceConfig(device=device, enforce_eager=a.enforce_eager,
                                attention_backend=a.attention_backend,
                                cuda_graph_max_batch=a.cuda_graph_max_batch,
                                cuda_graph_max_prefill_tokens=prefill_graph_tokens,
                                skinny_gemm_max_batch=getattr(a, "skinny_gemm_max_batch", None),
                                cpu_threads=_cpu_threads(device, getattr(a, "cpu_threads", None)),
                                cpu_one_row_matmul=getattr(a, "cpu_one_row_matmul", "auto"),
                                cpu_kernels=getattr(a, "cpu_kernels", "auto")),
        )
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def write_ready_file(path: str | None, grpc_port: int, metrics_port: int | None) -> None:
    if not path:
        return
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{grpc_port} {metrics_port if metrics_port is not None else -1}\n")
    os.replace(tmp, path)  # atomic: readers never see a half-written file
