"""KV-cache transfer between prefill and decode.

    KVSender / SendTransfer (base.py)   sender interface; send_layer() as layers become ready
    KVReceiver (receiver.py)            decode-side per-transfer state, expiry, release callback
    TransferState / KVLayout (state.py) BOOTSTRAPPING -> TRANSFERRING -> DONE | FAILED
    grpc_backend.py                     first backend: chunked bytes over a gRPC client stream
"""
from kvtransfer.base import KVSender, SendTransfer, send_blocks
from kvtransfer.receiver import KVReceiver, KVSink
from kvtransfer.state import KVLayout, Transfer, TransferError, TransferState

__all__ = ["KVSender", "SendTransfer", "send_blocks", "KVReceiver", "KVSink", "KVLayout",
           "Transfer", "TransferError", "TransferState"]
