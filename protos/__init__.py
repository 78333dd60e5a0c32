"""splitserve protobuf contracts.

Importing this package generates the python stubs into protos/gen/ when they are missing or
older than the .proto files (so a fresh clone needs no build step), then exposes them:

    from protos import generate_pb2, generate_pb2_grpc            # public splitserve.v1
    from protos import common_pb2, prefill_pb2, prefill_pb2_grpc  # splitserve.internal.v1
    from protos import decode_pb2, decode_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc

Sources: protos/splitserve/v1/generate.proto, protos/splitserve/internal/v1/{common,prefill,
decode,kvtransfer}.proto.
"""
from __future__ import annotations

import sys

from protos import build as _build

_gen = str(_build.build())
if _gen not in sys.path:
    # NOTE: generated modules import each other as top-level `splitserve.*`.
    sys.path.insert(0, _gen)

from splitserve.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402
from splitserve.internal.v1 import (  # noqa: E402
    common_pb2,
    common_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

__all__ = [
    "generate_pb2", "generate_pb2_grpc", "common_pb2", "common_pb2_grpc",
    "prefill_pb2", "prefill_pb2_grpc", "decode_pb2", "decode_pb2_grpc",
    "kvtransfer_pb2", "kvtransfer_pb2_grpc",
]
