"""The one place environment variables are read. Every variable is prefixed `SPLITSERVE_`
(standard `OTEL_*` variables keep their meaning and are read by common/telemetry.py).

Variables act as defaults for the services' argparse flags; an explicit flag wins:

    SPLITSERVE_MODEL, SPLITSERVE_DEVICE, SPLITSERVE_HOST, SPLITSERVE_LOG_LEVEL,
    SPLITSERVE_BLOCK_SIZE, SPLITSERVE_KV_CACHE_DTYPE, SPLITSERVE_NUM_BLOCKS,
    SPLITSERVE_KV_CACHE_BYTES, SPLITSERVE_MAX_NUM_SEQS, SPLITSERVE_MAX_NUM_BATCHED_TOKENS,
    SPLITSERVE_MAX_MODEL_LEN, SPLITSERVE_ENFORCE_EAGER, SPLITSERVE_SEED, SPLITSERVE_DTYPE,
    SPLITSERVE_GRPC_MAX_MESSAGE_MB, SPLITSERVE_KV_CHUNK_BYTES, SPLITSERVE_RESERVATION_TIMEOUT_S,
    SPLITSERVE_TRANSFER_TIMEOUT_S, SPLITSERVE_CPU_THREADS, SPLITSERVE_CUDA_GRAPH_MAX_BATCH,
    SPLITSERVE_CUDA_GRAPH_MAX_PREFILL_TOKENS, SPLITSERVE_SKINNY_GEMM_MAX_BATCH,
    SPLITSERVE_KV_TRANSFER_BACKEND, SPLITSERVE_KV_PAIR_TIMEOUT_S, SPLITSERVE_KV_STORE_PORT
"""
from __future__ import annotations

import os

PREFIX = "SPLITSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class EnvError(ValueError):
    """An environment variable holds a value of the wrong type."""


def _raw(name: str) -> str | None:
    assert name.startswith(PREFIX), f"env var {name} must start with {PREFIX}"
    v = os.environ.get(name)
    return None if v is None else v.strip()


def env_str(name: str, default: str | None = None) -> str | None:
    v = _raw(name)
    return default if v is None or v == "" else v


def env_int(name: str, default: int | None = None) -> int | None:
    v = _raw(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise EnvError(f"{name}={v!r} is not an integer") from None


def env_float(name: str, default: float | None = None) -> float | None:
    v = _raw(name)
    if v is None or v == "":
        return default
    try:
        return float(v)
    except ValueError:
        raise EnvError(f"{name}={v!r} is not a number") from None


def env_bool(name: str, default: bool = False) -> bool:
    v = _raw(name)
    if v is None:
        return default
    if v.lower() in _TRUE:
        return True
    if v.lower() in _FALSE:
        return False
    raise EnvError(f"{name}={v!r} is not a boolean (use 1/0, true/false)")
