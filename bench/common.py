"""Shared benchmark helpers: environment record, JSON result writing, kernel option specs."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess


def git_commit() -> str:
    if os.environ.get("SPLITSERVE_COMMIT"):  # set where the tree travels without .git
        return os.environ["SPLITSERVE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        return "unknown"


def machine() -> dict:
    import torch

    d = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
         "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name(0)
    return d


def write_result(name: str, config: dict, results: dict) -> str:
    out_dir = os.environ.get("SPLITSERVE_BENCH_DIR") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    doc = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "commit": git_commit(),
           "machine": machine(), "config": config, "results": results}
    path = os.path.join(out_dir, f"{name}-{now.strftime('%Y%m%dT%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return path


def median(xs):
    return statistics.median(xs)


def print_table(rows: list[dict], cols: list[str], float_fmt: str | None = None) -> None:
    """Aligned columns; float_fmt (e.g. ".4g") formats float cells."""
    if float_fmt:
        rows = [{k: (format(v, float_fmt) if isinstance(v, float) else v) for k, v in r.items()}
                for r in rows]
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def kernel_options(spec: str, base=None):
    """'NAME=VALUE,...' -> `base` (default: KernelOptions()) with those fields replaced, e.g.
    'batch_tile=False,pdl_rmsnorm=True' or "tile_16bit={'block_n': 64, 'num_warps': 4}".
    VALUE is a Python literal; tile_16bit also takes a dict of the DecodeTile fields to change
    or a whole (block_n, num_warps, num_stages, prefetch, programs_per_sm, min_tiles_per_split)
    tuple. Raises ValueError naming the problem (an unknown NAME lists the known ones)."""
    import ast

    from engine.kernels.options import DecodeTile, KernelOptions

    base = KernelOptions() if base is None else base
    if not spec.strip():
        return base
    try:
        call = ast.parse(f"_({spec})", mode="eval").body
    except SyntaxError:
        raise ValueError(f"kernel options {spec!r}: want NAME=VALUE[,NAME=VALUE...]") from None
    if call.args or any(kw.arg is None for kw in call.keywords):
        raise ValueError(f"kernel options {spec!r}: every item must be NAME=VALUE")
    known = {f.name for f in dataclasses.fields(KernelOptions)}
    changes = {}
    for kw in call.keywords:
        if kw.arg not in known:
            raise ValueError(f"kernel options: unknown option {kw.arg!r} "
                             f"(known: {', '.join(sorted(known))})")
        if kw.arg in changes:
            raise ValueError(f"kernel options {spec!r}: {kw.arg} given twice")
        try:
            value = ast.literal_eval(kw.value)
        except ValueError:
            raise ValueError(f"kernel options: {kw.arg}={ast.unparse(kw.value)} "
                             "is not a Python literal") from None
        if kw.arg == "tile_16bit" and isinstance(value, (dict, tuple, list)):
            try:
                value = (dataclasses.replace(base.tile_16bit, **value) if isinstance(value, dict)
                         else DecodeTile(*value))
            except (TypeError, ValueError) as e:
                raise ValueError(f"kernel options: tile_16bit={value!r}: {e}") from None
        changes[kw.arg] = value
    try:
        return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"kernel options {spec!r}: {e}") from None


def with_kernels(eng, kernels):
    """`eng` itself when it runs `kernels`, else a new engine of eng's config with them (the A/B
    tools build one engine per side; the caller drops eng when it no longer needs it)."""
    if eng.cfg.kernels == kernels:
        return eng
    from engine.engine import Engine

    return Engine(dataclasses.replace(eng.cfg, kernels=kernels))
