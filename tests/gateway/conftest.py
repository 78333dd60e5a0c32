"""A GatewayCore wired to in-process fake prefill/decode services (tests/gateway/fakes.py)."""
from __future__ import annotations

import pytest

from common.metrics import ServiceMetrics
from engine.tokenizer import Tokenizer
from gateway.admission import AdmissionConfig
from gateway.core import GatewayCore
from gateway.routing import ReplicaPool
from tests.gateway.fakes import VOCAB, FakeDecode, FakePrefill, start_server

EOS = 257


def byte_tokenizer() -> Tokenizer:
    return Tokenizer.byte_level(VOCAB, bos_token_id=256, eos_token_ids=(EOS,))


def make_core(prefill_addrs, decode_addrs, admission: AdmissionConfig | None = None,
              max_model_len: int = 256) -> GatewayCore:
    from protos import decode_pb2_grpc, prefill_pb2_grpc

    return GatewayCore(
        model_name="fake-model", tokenizer=byte_tokenizer(), max_model_len=max_model_len,
        vocab_size=VOCAB, eos_token_ids=(EOS,),
        prefill=ReplicaPool("prefill", prefill_addrs, prefill_pb2_grpc.PrefillStub) if prefill_addrs else None,
        decode=ReplicaPool("decode", decode_addrs, decode_pb2_grpc.DecodeStub) if decode_addrs else None,
        admission=admission or AdmissionConfig(), metrics=ServiceMetrics("gateway-test"))


class Stack:
    """Fake services + a core pointing at them."""

    def __init__(self, core, prefills, decodes, servers):
        self.core, self.prefills, self.decodes, self.servers = core, prefills, decodes, servers

    async def close(self):
        await self.core.prefill.close()
        await self.core.decode.close()
        for s in self.servers:
            await s.stop(None)


async def make_stack(n_prefill=1, prefill_fail=(), decode_step_s=0.0, admission=None,
                     dead_prefill_first=False) -> Stack:
    servers, prefills, paddrs = [], [], []
    if dead_prefill_first:
        paddrs.append("127.0.0.1:1")  # nothing listens there: UNAVAILABLE
    for i in range(n_prefill):
        fp = FakePrefill(fail_with=prefill_fail[i] if i < len(prefill_fail) else None)
        srv, addr = await start_server(fp)
        servers.append(srv)
        prefills.append(fp)
        paddrs.append(addr)
    fd = FakeDecode(step_s=decode_step_s, eos=None)
    srv, daddr = await start_server(fd)
    servers.append(srv)
    core = make_core(paddrs, [daddr], admission)
    return Stack(core, prefills, [fd], servers)


@pytest.fixture
async def stack():
    s = await make_stack()
    yield s
    await s.close()


@pytest.fixture
async def rest_stack():
    """Fake replicas behind a core whose admission assumes 1000 prompt tokens/s."""
    s = await make_stack(admission=AdmissionConfig(prefill_tokens_per_s=1000.0))
    yield s
    await s.close()


def asgi_client(stack, **kw):
    """An httpx client calling the REST app in-process (no socket)."""
    import httpx

    from gateway.rest import build_app

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(stack.core, **kw)),
                             base_url="http://test")


async def generate_status(stub, req, timeout: float = 10):
    """Run a Generate stream to its end: (status code, details); OK when it ends cleanly."""
    import grpc

    try:
        async for _ in stub.Generate(req, timeout=timeout):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""
