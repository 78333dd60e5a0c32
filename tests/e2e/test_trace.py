"""Traces and GenAI metrics of a real stack (prefill, decode, gateway on loopback) against the
OpenTelemetry conventions' names; `splitserve trace` on the file the services wrote.

The services export to an OTLP receiver (traces and, OTEL_METRICS_EXPORTER=otlp, the
gen_ai.server.* histograms) and, SPLITSERVE_TRACE_FILE, to one OTLP/JSON-lines file."""
from __future__ import annotations

import inspect
import os
import re
import tempfile
import time

import grpc
import httpx
import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes

from common.trace_otlp import read_spans
from protos import generate_pb2, generate_pb2_grpc
from tests import harness
from splitserve_cli.main import main
from tests.e2e.otlp_receiver import OTLPTraceReceiver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
MODEL = "dummy-tiny-llama"
SERVER, CLIENT = 2, 3  # OTLP SpanKind


def _conventions() -> tuple[set[str], set[str]]:
    """(gen_ai.* attribute names the semantic-conventions package defines, those it says are
    replaced or removed). Every GenAI name there reads "Deprecated: Moved to the GenAI
    conventions repository"; a replaced or removed one says so instead."""
    src = inspect.getsource(gen_ai_attributes)
    names, deprecated = set(), set()
    for name, doc in re.findall(r'^GEN_AI_\w+: Final = "([^"]+)"\n"""\n(.*)$', src, re.M):
        names.add(name)
        if doc.startswith(("Deprecated: Replaced", "Deprecated: Removed")):
            deprecated.add(name)
    return names, deprecated


@pytest.fixture(scope="module")
def stack():
    receiver = OTLPTraceReceiver().start()
    spans_file = os.path.join(tempfile.mkdtemp(prefix="trace-"), "spans.jsonl")
    env = {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_METRIC_EXPORT_INTERVAL": "300",
           "SPLITSERVE_TRACE_FILE": spans_file}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # NOTE: read by harness.child_env when the processes start
    try:
        s = harness.start_stack(harness.TINY_CPU, otlp_endpoint=receiver.endpoint)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    s.receiver, s.spans_file = receiver, spans_file
    yield s
    s.stop()
    receiver.stop()


def _trace_of(receiver, request_id: str, need=("splitserve-prefill", "splitserve-decode"),
              server_span: bool = False):
    """-> (the request's gen_ai span, its whole trace), once the services in `need` and the
    decode span arrived (server_span: and the trace's root, the HTTP server span, which ends
    after the response and may come in a later export batch)."""
    def root(sp):
        return [s for s in sp if s.attributes.get("gen_ai.response.id") == request_id]

    tid = root(receiver.wait_for(lambda sp: root(sp), timeout=15))[0].trace_id
    receiver.wait_for(lambda sp: set(need) <= {s.service for s in sp if s.trace_id == tid}
                      and any(s.name == "decode" and s.trace_id == tid for s in sp)
                      and (not server_span or any(s.trace_id == tid and not s.parent_span_id
                                                  for s in sp)), timeout=15)
    return root(receiver.trace(tid))[0], receiver.trace(tid)


async def test_rest_chat_span_follows_genai_conventions(stack):
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "seed": 7, "request_id": "conv-1"})
        assert r.status_code == 200, r.text
    gen, trace = _trace_of(stack.receiver, "conv-1", server_span=True)
    a = gen.attributes
    assert gen.name == f"chat {MODEL}" and gen.service == "splitserve-gateway"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "splitserve"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.seed"] == 7 and a["gen_ai.request.max_tokens"] == 5
    assert "gen_ai.request.top_k" not in a  # unset, not recorded as 0
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.usage.cache_read.input_tokens"] >= 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.response.time_to_first_chunk"] < gen.duration_ms / 1e3
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == stack.gateway.ports[1]
    names, deprecated = _conventions()
    assert {"gen_ai.system", "gen_ai.usage.prompt_tokens"} <= deprecated  # the check itself works
    used = {k for s in trace for k in s.attributes if k.startswith("gen_ai.")}
    assert used <= names, used - names
    assert not used & deprecated, used & deprecated
    # one trace; the internal calls are the gRPC instrumentation's rpc.* spans
    ids = {s.span_id for s in trace}
    (root,) = [s for s in trace if not s.parent_span_id]  # FastAPI's HTTP server span
    by_id = {s.span_id: s for s in trace}
    up = gen
    while up.parent_span_id:
        up = by_id[up.parent_span_id]
    assert root.kind == SERVER and up is root
    assert all(s.parent_span_id in ids for s in trace if s.parent_span_id)
    rpc = {(s.kind, s.attributes.get("rpc.service"), s.attributes.get("rpc.method")) for s in trace
           if s.attributes.get("rpc.system") == "grpc"}
    for svc, method in (("splitserve.internal.v1.Decode", "Reserve"),
                        ("splitserve.internal.v1.Prefill", "Prefill")):
        assert {(CLIENT, svc, method), (SERVER, svc, method)} <= rpc, rpc
    # the token stream rides the replica's long-lived DecodeMany call: the request's own CLIENT
    # span on the gateway, decode's SERVER span under it
    (dclient,) = [s for s in trace if s.name == "decode.Decode"]
    assert dclient.kind == CLIENT and dclient.attributes["rpc.method"] == "DecodeMany"
    (dserver,) = [s for s in trace if s.name == "decode"]
    assert dserver.kind == SERVER and dserver.parent_span_id == dclient.span_id
    reserve = next(s for s in trace if s.name == "decode.reserve")
    assert by_id[reserve.parent_span_id].attributes.get("rpc.method") == "Reserve"


async def test_grpc_generate_and_an_error(stack):
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(range(3, 12))),
                                           max_tokens=3, request_id="conv-2", ignore_eos=True)
        assert [r async for r in stub.Generate(req)][-1].finish_reason
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": list(range(3, 200)),
                                                  "max_tokens": 3, "ttft_ms": 0.01, "request_id": "conv-3"})
        assert r.status_code == 429, r.text
    gen, trace = _trace_of(stack.receiver, "conv-2", server_span=True)
    assert gen.name == f"text_completion {MODEL}"
    root = next(s for s in trace if not s.parent_span_id)
    assert root.attributes["rpc.method"] == "Generate" and gen.parent_span_id == root.span_id
    spans = stack.receiver.wait_for(
        lambda sp: any(s.attributes.get("gen_ai.response.id") == "conv-3" for s in sp), timeout=15)
    bad = next(s for s in spans if s.attributes.get("gen_ai.response.id") == "conv-3")
    assert bad.attributes["error.type"] == "RESOURCE_EXHAUSTED" and bad.status_code == 2
    # gen_ai.server.* histograms, with the conventions' attributes
    want = {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
            "gen_ai.server.time_per_output_token"}
    def failed(m):
        return [p for p in m if p.name == "gen_ai.server.request.duration"
                and p.attributes.get("error.type") == "RESOURCE_EXHAUSTED"]

    pts = stack.receiver.wait_for(lambda m: want <= {p.name for p in m} and failed(m), timeout=15,
                                  metrics=True)
    for p in pts:
        if p.name in want:
            assert p.unit == "s" and p.attributes["gen_ai.request.model"] == MODEL
            assert p.attributes["gen_ai.provider.name"] == "splitserve" and p.count >= 1


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """`splitserve trace ARGS` in this process -> (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main(["trace", *args])
    out, err = capsys.readouterr()
    return rc, out, err


async def test_waterfall_from_the_services_file(stack, capsys):
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": list(range(3, 30)),
                                                  "max_tokens": 6, "ignore_eos": True,
                                                  "request_id": "wf-1"})
        assert r.status_code == 200, r.text
    _trace_of(stack.receiver, "wf-1")
    want = {"gateway", "admission", "reserve", "prefill", "kv handoff", "decode"}

    def phases(out: str) -> set[str]:
        table = out.split("\nphase")[1].splitlines()[1:]
        return {line.rsplit(None, 3)[0] for line in table}

    for _ in range(50):  # the file exporters flush on their own batch schedule
        rc, out, err = _cli(capsys, "show", stack.spans_file, "--request-id", "wf-1")
        if rc == 0 and phases(out) >= want:
            break
        time.sleep(0.2)
    assert rc == 0, err
    assert phases(out) == want, out
    assert f"text_completion {MODEL}" in out and "#" in out
    rc, out, _ = _cli(capsys, "top", stack.spans_file, "-n", "2")
    assert rc == 0 and len(out.strip().splitlines()) == 4, out
    assert any(s.name == "prefill" for s in read_spans([stack.spans_file]))
    rc, _, err = _cli(capsys, "show", stack.spans_file, "--request-id", "no-such")
    assert rc == 1 and "no-such" in err
