"""In-process fake prefill / decode gRPC services for gateway tests.

The fake "model": the first token is (last prompt token + 1) % vocab and every next token is
the previous + 1, so outputs are predictable. Both fakes record what they saw (reservations
held, aborts, cancels) so tests can check that nothing stays allocated.
"""
from __future__ import annotations

import asyncio
import itertools

import grpc

from decode_svc.many import ManyMixin
from protos import common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2, prefill_pb2, prefill_pb2_grpc

VOCAB = 512


class FakeDecode(ManyMixin, decode_pb2_grpc.DecodeServicer):
    """DecodeMany comes from the real service's mixin, on top of this Decode."""

    def __init__(self, step_s: float = 0.0, eos: int | None = None):
        self.step_s = step_s
        self.eos = eos
        self.reserved: dict[str, str] = {}  # transfer_id -> request_id
        self.running: set[str] = set()
        self.released: list[str] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.load = common_pb2.LoadStats(num_total_blocks=100, num_free_blocks=100)
        self._ids = itertools.count()
        self.address = ""
        self.full = False  # Reserve answers RESOURCE_EXHAUSTED while set

    async def Reserve(self, request, context):  # noqa: N802
        if self.full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
        tid = f"t{next(self._ids)}"
        self.reserved[tid] = request.request_id
        return decode_pb2.ReserveResponse(ticket=common_pb2.TransferTicket(
            transfer_id=tid, decode_address=self.address, num_tokens=request.num_prompt_tokens,
            block_size=16))

    async def Decode(self, request, context):  # noqa: N802
        tid = request.transfer_id
        if tid not in self.reserved:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown transfer {tid}")
        self.running.add(tid)
        tok = request.first_token_id
        n = 1
        try:
            while True:
                await asyncio.sleep(self.step_s)
                tok = (tok + 1) % VOCAB
                n += 1
                fin = generate_pb2.FINISH_REASON_UNSPECIFIED
                if self.eos is not None and tok == self.eos and not request.params.ignore_eos:
                    fin = generate_pb2.FINISH_REASON_STOP
                elif n >= request.params.max_tokens:
                    fin = generate_pb2.FINISH_REASON_LENGTH
                lps = []
                if request.params.sampling.HasField("logprobs"):
                    lps = [generate_pb2.TokenLogprob(token_id=tok, logprob=-0.5, top=[
                        generate_pb2.TopLogprob(token_id=tok, logprob=-0.5)])]
                yield decode_pb2.DecodeResponse(token_ids=[tok], finish_reason=fin, logprobs=lps,
                                                num_generated=n)
                if fin:
                    return
        except asyncio.CancelledError:
            self.cancelled.append(tid)
            raise
        finally:
            self.running.discard(tid)
            self.reserved.pop(tid, None)

    async def Release(self, request, context):  # noqa: N802
        self.released.append(request.transfer_id)
        found = self.reserved.pop(request.transfer_id, None) is not None
        return decode_pb2.ReleaseResponse(found=found)

    async def Abort(self, request, context):  # noqa: N802
        self.aborted.append(request.transfer_id)
        self.reserved.pop(request.transfer_id, None)
        return decode_pb2.ReleaseResponse(found=True)

    async def Load(self, request, context):  # noqa: N802
        return self.load


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, fail_with: grpc.StatusCode | None = None, delay_s: float = 0.0):
        self.fail_with = fail_with
        self.delay_s = delay_s
        self.calls = 0
        self.load = common_pb2.LoadStats()

    async def Prefill(self, request, context):  # noqa: N802
        self.calls += 1
        if self.fail_with is not None:
            await context.abort(self.fail_with, "fake prefill failure")
        await asyncio.sleep(self.delay_s)
        first = (request.prompt_token_ids[-1] + 1) % VOCAB
        resp = prefill_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=first,
            num_prompt_tokens=len(request.prompt_token_ids),
            timings=prefill_pb2.PrefillTimings(queue_ms=0.1, prefill_ms=1.0, transfer_ms=0.2))
        if request.params.sampling.HasField("logprobs"):
            resp.first_logprob.CopyFrom(generate_pb2.TokenLogprob(token_id=first, logprob=-0.25))
        return resp

    async def Load(self, request, context):  # noqa: N802
        return self.load


async def start_server(*servicers):
    server = grpc.aio.server()
    for s in servicers:
        if isinstance(s, FakeDecode):
            decode_pb2_grpc.add_DecodeServicer_to_server(s, server)
        else:
            prefill_pb2_grpc.add_PrefillServicer_to_server(s, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    addr = f"127.0.0.1:{port}"
    for s in servicers:
        s.address = addr
    return server, addr
