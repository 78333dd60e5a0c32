"""Tile configs for the skinny decode GEMM (engine/kernels/skinny_gemm.py): the config
type, the tuned tables (one JSON file per GPU model) and the heuristic for everything else.

lab/skinny_gemm_sweep.py times every candidate config for the exact fused matmuls of real
model shapes and writes the winners to engine/kernels/configs/skinny_gemm-<gpu>.json:
    {"device": "NVIDIA H200", "max_m": 64, "fused_m": [1, 16, 32, 64],
     "entries": [{"n": 6144, "k": 4096, "silu": false, "m": 1,
                  "cfg": [block_n, block_k, num_warps, num_stages, use_dot(, split_k,
                          prefetch_x, norm_separate(, slab))]}, ...]}
Lookup: exact (n, k, silu) and the smallest tuned m >= the batch's m (else the largest).
fused_m: the tuned m where the fused kernels beat cuBLAS over a whole step; a batch takes
the fused path when its tuned bucket (the smallest tuned m >= its rows) is in fused_m (a
table without fused_m: every batch <= max_m).
Shapes or GPUs without a table fall back to default_config's heuristic.
KernelOptions.skinny_table names another table file to use instead (a candidate under test).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass

import torch
import triton

from engine.kernels.common import num_sms

log = logging.getLogger("splitserve.engine.kernels")

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")

# Where the GPU has no tuned table only one-row steps take the fused path (the heuristic's
# FMA tiles read the weights at the memory rate); at 2-16 rows the heuristic's tiles lose to
# cuBLAS by up to 2x in whole steps (an H100: python -m bench.engine_costs --device cuda
# --batches 1,4,8,32). A tuned table (lab.skinny_gemm_sweep --write-table) replaces this;
# DeviceConfig.skinny_gemm_max_batch overrides it.
DEFAULT_MAX_M = 1


def table_path(device_name: str, table: str | None = None) -> str:
    """The tuned table file of a GPU model; table (KernelOptions.skinny_table) replaces it."""
    if table:
        return table
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    return os.path.join(CONFIG_DIR, f"skinny_gemm-{slug}.json")


@functools.lru_cache(maxsize=8)
def load_table(device_name: str, table: str | None = None) -> dict | None:
    path = table_path(device_name, table)
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


def lookup(device_name: str, m: int, n: int, k: int, silu: bool, table: str | None = None
           ) -> tuple | None:
    """The table's cfg for this shape (a tile tuple, or ("cublas",)) or None."""
    t = load_table(device_name, table)
    if t is None:
        return None
    rows = t["table"].get((n, k, bool(silu)))
    if not rows:
        return None
    for mm, cfg in rows:
        if mm >= m:
            return cfg
    return rows[-1][1]


def table_max_m(device_name: str, table: str | None = None) -> int | None:
    t = load_table(device_name, table)
    return None if t is None else t.get("max_m")


def fused_rows(device_name: str, limit: int = 64, table: str | None = None) -> frozenset[int] | None:
    """Batch row counts 1..limit that take the fused path per the table's fused_m, or None
    (no table, or a table without fused_m)."""
    t = load_table(device_name, table)
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


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    split_k: int = 1  # programs per N tile along K (deterministic last-arriver reduction)
    prefetch_x: bool = False  # register double buffering of the next K chunk
    # NORM as a separate rmsnorm kernel before the GEMM: at 32+ rows the fused prologue's
    # per-chunk register work (x^2 sums, * g, the x tile through registers into the dot)
    # costs more than one extra launch
    norm_separate: bool = False
    # > 0: at one row, the slab GEMV (engine/kernels/slab_gemv.py) with this many programs
    # per SM, block_n rows a step and num_warps warps (whole rows: block_k is only used by
    # the tile kernel, which runs the entry for more rows or K > slab_gemv.MAX_K)
    slab: int = 0
    # this op runs on cuBLAS inside the fused path (rmsnorm kernel, F.linear, torch epilogues):
    # where the tuned table found cuBLAS faster for one op of a batch size the others win
    # (table cfg ["cublas"]); the tile fields are unused
    cublas: bool = False

    @classmethod
    def from_table(cls, cfg) -> "SkinnyConfig":
        """A tuned table's cfg list: tile fields, or ["cublas"]."""
        return CUBLAS if list(cfg) == ["cublas"] else cls(*cfg)

    def to_table(self) -> list:
        if self.cublas:
            return ["cublas"]
        cfg = [self.block_n, self.block_k, self.num_warps, self.num_stages, self.use_dot,
               self.split_k, self.prefetch_x, self.norm_separate]
        return cfg + [self.slab] if self.slab else cfg

    def k_split(self, k: int) -> tuple[int, int]:
        """(splits, K per split): K per split is a multiple of block_k and no split is empty."""
        chunks = triton.cdiv(k, self.block_k)
        s = max(1, min(self.split_k, chunks))
        per = triton.cdiv(chunks, s) * self.block_k
        return triton.cdiv(k, per), per

    def block_m(self, m: int) -> int:
        p = triton.next_power_of_2(m)
        return max(16, p) if self.use_dot else p

    def smem_bytes(self, m: int, silu: bool, elem: int = 2) -> int:
        """Shared memory the dot path's pipeline needs (x and weight tiles per stage)."""
        if not self.use_dot:
            return 0
        return self.num_stages * self.block_k * elem * (self.block_m(m) + self.block_n * (2 if silu else 1))


CUBLAS = SkinnyConfig(0, 0, 0, 0, False, cublas=True)


@functools.lru_cache(maxsize=4096)  # called per matmul launch on the eager path
def default_config(m: int, n: int, k: int, device: torch.device, silu: bool = False,
                   table: str | None = None) -> SkinnyConfig:
    """The tuned table's config for this GPU and shape (table: KernelOptions.skinny_table),
    else a heuristic: memory-bound, so aim for several programs per SM (each SM must keep
    enough loads in flight) with 4-16 KiB weight tiles per pipeline stage."""
    device = torch.device(device)
    if device.type == "cuda":
        hit = lookup(_device_name(device), m, n, k, silu, table)
        if hit is not None:
            return SkinnyConfig.from_table(hit)
    sms = num_sms(device)
    use_dot = m > 4
    if use_dot:
        block_k = min(128, max(16, triton.next_power_of_2(k)))
        block_n = 64
        while block_n > 16 and triton.cdiv(n, block_n) < 4 * sms:
            block_n //= 2
        split = 1  # too few N tiles to fill the GPU: split K (>= 2 chunks per split)
        while triton.cdiv(n, block_n) * split < sms and triton.cdiv(k, block_k) >= 4 * split:
            split *= 2
        return SkinnyConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=4, use_dot=True,
                            split_k=split)
    # FMA: accumulator registers ~ BLOCK_M * BLOCK_N * BLOCK_K / threads (x2 with silu)
    block_k = min(1024 // triton.next_power_of_2(m), max(16, triton.next_power_of_2(k)))
    block_n = 8
    while block_n > 2 and triton.cdiv(n, block_n) < 8 * sms:
        block_n //= 2
    if silu:
        block_n = max(2, block_n // 2)
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_warps=8, num_stages=1, use_dot=False)


def forget_cached() -> None:
    """Drop the cached tables and per-shape configs, so a table file rewritten in place takes
    effect at the next lookup."""
    load_table.cache_clear()
    default_config.cache_clear()


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def tuned_max_m(device: torch.device, table: str | None = None) -> int:
    """Largest decode batch for which the fused kernels beat cuBLAS on this GPU (tuned
    table, or `table`), else DEFAULT_MAX_M."""
    device = torch.device(device)
    m = table_max_m(_device_name(device), table) if device.type == "cuda" else None
    return DEFAULT_MAX_M if m is None else int(m)


def tuned_rows(device: torch.device, table: str | None = None) -> frozenset[int] | None:
    """Batch row counts (<= tuned_max_m) where the tuned table (or `table`) says the fused
    kernels win over a whole step; None: every batch up to tuned_max_m."""
    device = torch.device(device)
    return fused_rows(_device_name(device), table=table) if device.type == "cuda" else None
