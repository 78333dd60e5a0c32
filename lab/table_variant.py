"""Candidate skinny-GEMM tables for step-level A/Bs (lab.decode_ab --table-ab): the shipped
table of a GPU with some entries' configs changed, written to a new file.

    python -m lab.table_variant OUT.json --set N,K[,silu]@M=FIELD:VALUE[;FIELD:VALUE...] ...
                                  [--device "NVIDIA H200"]

FIELD is a SkinnyConfig field (block_n, block_k, num_warps, num_stages, use_dot, split_k,
prefetch_x, norm_separate, slab) or `cfg` with a whole table cfg as JSON, e.g.
    --set "4096,4096@1=num_stages:1;prefetch_x:true" --set "14336,4096,silu@64=cfg:[128,64,8,4,true,2]"
Only existing entries change (a typo in N, K, silu or M is an error, not a silent no-op).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields, replace

from engine.kernels.skinny_configs import SkinnyConfig, table_path

_FIELDS = {f.name: f.type for f in fields(SkinnyConfig)}


def parse_value(field: str, text: str):
    if field == "cfg":
        return json.loads(text)
    if field not in _FIELDS:
        raise SystemExit(f"unknown SkinnyConfig field {field!r} (one of {sorted(_FIELDS)} or cfg)")
    if _FIELDS[field] in (bool, "bool"):
        if text.lower() not in ("true", "false", "1", "0"):
            raise SystemExit(f"{field} takes true/false, got {text!r}")
        return text.lower() in ("true", "1")
    return int(text)


def apply(doc: dict, spec: str) -> None:
    """One --set spec applied to the table document in place."""
    try:
        key, changes = spec.split("=", 1)
        shape, m = key.split("@")
        parts = shape.split(",")
        if len(parts) not in (2, 3) or parts[2:] not in ([], ["silu"]):
            raise ValueError(shape)
        n, k, silu, m = int(parts[0]), int(parts[1]), len(parts) == 3, int(m)
    except ValueError:
        raise SystemExit(f"bad --set {spec!r}: want N,K[,silu]@M=FIELD:VALUE[;...]") from None
    hits = [e for e in doc["entries"] if (e["n"], e["k"], bool(e["silu"]), e["m"]) == (n, k, silu, m)]
    if not hits:
        raise SystemExit(f"--set {spec!r}: the table has no entry n={n} k={k} silu={silu} m={m}")
    for e in hits:
        for change in changes.split(";"):
            field, _, text = change.partition(":")
            value = parse_value(field, text)
            if field == "cfg":
                e["cfg"] = SkinnyConfig.from_table(value).to_table()
            else:
                cfg = SkinnyConfig.from_table(e["cfg"])
                if cfg.cublas:
                    raise SystemExit(f"--set {spec!r}: that entry runs on cuBLAS; give a whole cfg")
                e["cfg"] = replace(cfg, **{field: value}).to_table()
        e.pop("us", None)  # the timings belonged to the old config
        e.pop("best_tile_us", None)
        e["variant"] = spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--device", default=None, help="GPU name of the source table (default: this GPU)")
    a = ap.parse_args()
    if a.device is None:
        import torch

        a.device = torch.cuda.get_device_name()
    with open(table_path(a.device)) as f:
        doc = json.load(f)
    for spec in a.sets:
        apply(doc, spec)
    doc["note"] = f"variant of the shipped table: {'; '.join(a.sets)}"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)  # e.g. a CONFIG_DIR
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", a.out, "|", doc["note"])


if __name__ == "__main__":
    main()
