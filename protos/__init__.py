"""splitserve protobuf contracts.

Importing this package finds fresh python stubs (see protos/build.py: in the wheel, generated
in a checkout on first import, or in the user cache) and exposes them:

    from protos import generate_pb2, generate_pb2_grpc            # public splitserve.v1
    from protos import common_pb2, prefill_pb2, prefill_pb2_grpc  # splitserve.internal.v1
    from protos import decode_pb2, decode_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc

Sources: protos/splitserve/v1/generate.proto, protos/splitserve/internal/v1/{common,prefill,
decode,kvtransfer}.proto.
"""
from __future__ import annotations

import importlib
import sys

from protos import build as _build

_MODULES = {
    "generate_pb2": "splitserve.v1.generate_pb2",
    "generate_pb2_grpc": "splitserve.v1.generate_pb2_grpc",
    **{f"{n}{s}": f"splitserve.internal.v1.{n}{s}"
       for n in ("common", "prefill", "decode", "kvtransfer") for s in ("_pb2", "_pb2_grpc")},
}


def _load(gen: str) -> dict:
    if gen not in sys.path:
        # NOTE: generated modules import each other as top-level `splitserve.*`.
        sys.path.insert(0, gen)
    return {k: importlib.import_module(m) for k, m in _MODULES.items()}


def _forget(gen: str) -> None:
    for name in [m for m in sys.modules if m == "splitserve" or m.startswith("splitserve.")]:
        del sys.modules[name]
    if gen in sys.path:
        sys.path.remove(gen)


_gen = str(_build.build())
try:
    _mods = _load(_gen)
except Exception:  # noqa: BLE001 - stubs built by a grpcio-tools newer than this grpcio/protobuf
    _forget(_gen)
    _mods = _load(str(_build.rebuild_in_cache()))
globals().update(_mods)

__all__ = list(_MODULES)
