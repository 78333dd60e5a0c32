"""The contracts: a fresh checkout (no protos/gen) generates its stubs on first import, stale
stubs are rebuilt, and the messages have the documented shape."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from protos import common_pb2, decode_pb2, generate_pb2, kvtransfer_pb2, prefill_pb2

ROOT = Path(__file__).resolve().parents[2]


def _copy_protos(dst: Path) -> Path:
    shutil.copytree(ROOT / "protos", dst / "protos", ignore=shutil.ignore_patterns("gen", "__pycache__"))
    return dst / "protos"


def _import(cwd: Path) -> str:
    code = "import protos; print(protos.decode_pb2.DecodeRequest.DESCRIPTOR.full_name)"
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [str(cwd), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_fresh_checkout_generates_and_stale_rebuilds(tmp_path):
    p = _copy_protos(tmp_path)
    assert not (p / "gen").exists()
    assert _import(tmp_path) == "splitserve.internal.v1.DecodeRequest"
    stamp = (p / "gen" / ".stamp").stat().st_mtime
    assert (p / "gen" / "splitserve" / "v1" / "generate_pb2_grpc.py").exists()
    _import(tmp_path)  # fresh: no rebuild
    assert (p / "gen" / ".stamp").stat().st_mtime == stamp
    time.sleep(0.01)
    proto = p / "splitserve" / "internal" / "v1" / "decode.proto"
    os.utime(proto, (time.time() + 5, time.time() + 5))  # edited after the build
    _import(tmp_path)
    assert (p / "gen" / ".stamp").stat().st_mtime > stamp


def test_message_shapes():
    r = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2]), max_tokens=5)
    assert r.WhichOneof("input") == "token_ids"
    r.prompt = "hi"
    assert r.WhichOneof("input") == "prompt"
    assert not r.sampling.HasField("temperature")  # optional: unset != 0
    assert generate_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert [generate_pb2.FinishReason.Name(i) for i in range(1, 5)] == [
        "FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_ABORT", "FINISH_REASON_ERROR"]
    t = common_pb2.TransferTicket(transfer_id="x", block_ids=[3, 4], layout=common_pb2.KVLayout(dtype="bf16"))
    assert prefill_pb2.PrefillRequest(ticket=t).ticket.block_ids == [3, 4]
    assert decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["Decode"].server_streaming
    push = kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].methods_by_name["PushKV"]
    assert push.client_streaming and not push.server_streaming
    ch = kvtransfer_pb2.KVChunk()
    assert not ch.HasField("k_scale")
