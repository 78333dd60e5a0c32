"""Public gRPC Generation front over fake backends: stream, errors with status + metadata."""
import grpc
import pytest

from gateway.admission import AdmissionConfig
from gateway.grpc_server import add_to_server
from protos import generate_pb2, generate_pb2_grpc
from tests.gateway.conftest import make_stack


@pytest.fixture
async def stub():
    s = await make_stack(admission=AdmissionConfig(prefill_tokens_per_s=1000.0))
    server = grpc.aio.server()
    add_to_server(server, s.core, 16)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield generate_pb2_grpc.GenerationStub(ch)
    await ch.close()
    await server.stop(None)
    await s.close()


async def test_generate_stream(stub):
    resps = [r async for r in stub.Generate(generate_pb2.GenerateRequest(
        prompt="abc", max_tokens=4, sampling=generate_pb2.SamplingParams(temperature=0.0)))]
    assert [t for r in resps for t in r.token_ids] == [100, 101, 102, 103]
    assert "".join(r.text for r in resps) == "defg"
    assert resps[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert resps[-1].usage.completion_tokens == 4 and resps[0].timings.ttft_ms > 0
    assert resps[0].request_id.startswith("req-")


async def test_generate_invalid_argument(stub):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in stub.Generate(generate_pb2.GenerateRequest(
                prompt="abc", sampling=generate_pb2.SamplingParams(top_p=5.0))):
            pass
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in ei.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in stub.Generate(generate_pb2.GenerateRequest()):
            pass
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_generate_resource_exhausted_has_retry_after(stub):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in stub.Generate(generate_pb2.GenerateRequest(
                prompt="abc" * 30, slo=generate_pb2.SLO(ttft_ms=1))):
            pass
    e = ei.value
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "predicted TTFT" in e.details()
    md = dict(e.trailing_metadata() or ())
    assert int(md["retry-after-ms"]) >= 1000


async def test_tokenize_and_model_info(stub):
    r = await stub.Tokenize(generate_pb2.TokenizeRequest(text="ab"))
    assert list(r.token_ids) == [97, 98] and list(r.tokens) == ["a", "b"]
    info = await stub.ModelInfo(generate_pb2.ModelInfoRequest())
    assert info.model == "fake-model" and info.vocab_size == 512
