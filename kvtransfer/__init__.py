"""KV-cache transfer between prefill and decode.

    KVSender / SendTransfer (base.py)   sender interface; send_layer() as layers become ready
    KVReceiver (receiver.py)            decode-side per-transfer state, expiry, release callback
    TransferState / KVLayout (state.py) BOOTSTRAPPING -> TRANSFERRING -> DONE | FAILED
    endpoint.py                         which backend a prefill/decode pair uses (+ grpc fallback)
    backends/                           the transports:
      grpc.py                           grpc: chunked bytes over a gRPC client stream (PushKV)
      pair_client.py / pair_sender.py   sender side of the direct backends (PairSession stream)
      pair_service.py                   receiver side: KVTransfer.PairSession (+ PushKV)
      dist.py / dist_group.py           dist: torch.distributed gloo/NCCL pair groups
      nixl.py / nixl_sender.py          nixl: NIXL READs (decode side / prefill side; the
                                        nixl-cu12 / -cu13 wheels); nixl_probe.py: which imports
    loopback.py                         a receiver in its own process, for tests and benchmarks
"""
from kvtransfer.base import KVSender, SendTransfer, send_blocks
from kvtransfer.receiver import KVReceiver, KVSink
from kvtransfer.state import KVLayout, Transfer, TransferError, TransferState

__all__ = ["KVSender", "SendTransfer", "send_blocks", "KVReceiver", "KVSink", "KVLayout",
           "Transfer", "TransferError", "TransferState"]
