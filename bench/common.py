"""Shared benchmark helpers: environment record, JSON result writing, module switches."""
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


def parse_attrs(spec: str) -> list[tuple[object, str, object]]:
    """'pkg.mod[.Class].NAME=VALUE&...' -> [(module or class, NAME, value)]. VALUE is a Python
    literal; a dict for a dataclass attribute replaces those fields of its current value. NAME
    must already exist (a typo is an error, not a silent new attribute)."""
    import ast
    import importlib

    out = []
    for part in spec.split("&"):
        target, _, text = part.partition("=")
        names = target.strip().split(".")
        if len(names) < 2 or not text:
            raise SystemExit(f"switch {part!r}: want module[.Class].NAME=VALUE")
        obj, i = None, len(names) - 1
        while i > 0 and obj is None:  # the longest importable module prefix
            try:
                obj = importlib.import_module(".".join(names[:i]))
            except ImportError:
                i -= 1
        if obj is None:
            raise SystemExit(f"switch {part!r}: no importable module in {target!r}")
        for name in names[i:-1]:
            obj = getattr(obj, name, None)
        if obj is None or not hasattr(obj, names[-1]):
            raise SystemExit(f"switch {part!r}: {target!r} does not exist")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise SystemExit(f"switch {part!r}: {text!r} is not a Python literal") from None
        current = getattr(obj, names[-1])
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            # a frozen config (e.g. decode_tiles.TILE_16BIT): the given fields replaced
            try:
                value = dataclasses.replace(current, **value)
            except TypeError as e:
                raise SystemExit(f"switch {part!r}: {e}") from None
        out.append((obj, names[-1], value))
    return out
