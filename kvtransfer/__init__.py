"""KV-cache transfer between prefill and decode.

    KVSender / SendTransfer (base.py)   sender interface; send_layer() as layers become ready
    KVReceiver (receiver.py)            decode-side per-transfer state, expiry, release callback
    TransferState / KVLayout (state.py) BOOTSTRAPPING -> TRANSFERRING -> DONE | FAILED
    grpc_backend.py                     grpc backend: chunked bytes over a gRPC client stream
    endpoint.py                         which backend a prefill/decode pair uses (+ grpc fallback)
    pair_client.py / pair_sender.py     sender side of the direct backends (PairSession stream)
    pair_service.py                     receiver side: KVTransfer.PairSession (+ PushKV)
    dist_group.py / dist_backend.py     dist backend: torch.distributed gloo/NCCL pair groups
    nixl_backend.py                     nixl backend (NIXL READs; never run, see its docstring)
    loopback.py                         a receiver in its own process, for tests and benchmarks
"""
from kvtransfer.base import KVSender, SendTransfer, send_blocks
from kvtransfer.receiver import KVReceiver, KVSink
from kvtransfer.state import KVLayout, Transfer, TransferError, TransferState

__all__ = ["KVSender", "SendTransfer", "send_blocks", "KVReceiver", "KVSink", "KVLayout",
           "Transfer", "TransferError", "TransferState"]
