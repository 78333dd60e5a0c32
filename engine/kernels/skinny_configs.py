"""Tuned tile tables for the skinny decode GEMM, one JSON file per GPU model.

bench/skinny_gemm_sweep.py times every candidate config for the exact fused matmuls of real
model shapes and writes the winners to engine/kernels/configs/skinny_gemm-<gpu>.json:
    {"device": "NVIDIA H200", "max_m": 64, "fused_m": [1, 16, 32, 64],
     "entries": [{"n": 6144, "k": 4096, "silu": false, "m": 1,
                  "cfg": [block_n, block_k, num_warps, num_stages, use_dot(, split_k,
                          prefetch_x)]}, ...]}
Lookup: exact (n, k, silu) and the smallest tuned m >= the batch's m (else the largest).
fused_m: the tuned m where the fused kernels beat cuBLAS over a whole step; a batch takes
the fused path when its tuned bucket (the smallest tuned m >= its rows) is in fused_m (a
table without fused_m: every batch <= max_m).
Shapes or GPUs without a table fall back to skinny_gemm.default_config's heuristic.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re

log = logging.getLogger("splitserve.engine.kernels")

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


def table_path(device_name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    return os.path.join(CONFIG_DIR, f"skinny_gemm-{slug}.json")


@functools.lru_cache(maxsize=8)
def load_table(device_name: str) -> dict | None:
    path = table_path(device_name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
        table: dict[tuple, list[tuple[int, tuple]]] = {}
        for e in doc["entries"]:
            table.setdefault((int(e["n"]), int(e["k"]), bool(e["silu"])), []).append(
                (int(e["m"]), tuple(e["cfg"])))
        for v in table.values():
            v.sort()
        fused = doc.get("fused_m")
        return {"max_m": doc.get("max_m"), "table": table,
                "fused_m": None if fused is None else sorted(int(m) for m in fused)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable skinny-GEMM table %s: %r", path, e)
        return None


def lookup(device_name: str, m: int, n: int, k: int, silu: bool) -> tuple | None:
    """(block_n, block_k, num_warps, num_stages, use_dot) or None."""
    t = load_table(device_name)
    if t is None:
        return None
    rows = t["table"].get((n, k, bool(silu)))
    if not rows:
        return None
    for mm, cfg in rows:
        if mm >= m:
            return cfg
    return rows[-1][1]


def tuned_max_m(device_name: str) -> int | None:
    t = load_table(device_name)
    return None if t is None else t.get("max_m")


def fused_rows(device_name: str, limit: int = 64) -> frozenset[int] | None:
    """Batch row counts 1..limit that take the fused path per the table's fused_m, or None
    (no table, or a table without fused_m)."""
    t = load_table(device_name)
    if t is None or t.get("fused_m") is None:
        return None
    tuned = sorted({m for rows in t["table"].values() for m, _ in rows})
    fused = set(t["fused_m"])
    out = set()
    for rows in range(1, limit + 1):
        bucket = next((m for m in tuned if m >= rows), None)
        if bucket is not None and bucket in fused:
            out.add(rows)
    return frozenset(out)
