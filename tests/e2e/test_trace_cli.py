"""`splitserve trace serve`: a real receiver process takes spans an OTLP exporter sends it,
writes them as OTLP/JSON lines that read back with ids, parents, attributes and times intact,
and `trace show` draws the request from that file; a busy port is one line naming it."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from common.trace_otlp import read_spans
from splitserve_cli.main import main
from tests import harness

pytestmark = [pytest.mark.timeout(120)]


def _serve(out: str, port: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "splitserve_cli", "trace", "serve", "--port", str(port),
                             "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=harness.ROOT, env=harness.child_env())


def test_receiver_writes_what_show_reads(capsys):
    out = os.path.join(tempfile.mkdtemp(prefix="trace-cli-"), "spans.jsonl")
    p = _serve(out)
    try:
        line = p.stdout.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "splitserve-gateway"}))
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True)))
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("chat m", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.response.id": "r-1",
                "gen_ai.usage.output_tokens": 3, "gen_ai.response.finish_reasons": ["stop"],
                "gen_ai.response.time_to_first_chunk": 0.002}) as root:
            with tracer.start_as_current_span("gateway.admission"):
                pass
            with tracer.start_as_current_span("decode"):
                pass
        provider.shutdown()
        p.send_signal(signal.SIGTERM)
        rest, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        assert "3 spans written" in rest
    finally:
        if p.poll() is None:
            p.kill()
    spans = {s.name: s for s in read_spans([out])}
    assert set(spans) == {"chat m", "gateway.admission", "decode"}
    want_tid = f"{root.get_span_context().trace_id:032x}"
    assert {s.trace_id for s in spans.values()} == {want_tid}
    root_id = f"{root.get_span_context().span_id:016x}"
    assert spans["decode"].parent_span_id == spans["chat m"].span_id == root_id
    assert spans["chat m"].attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert spans["chat m"].attributes["gen_ai.usage.output_tokens"] == 3
    chat = spans["chat m"]
    assert chat.service == "splitserve-gateway" and chat.end_ns > chat.start_ns
    capsys.readouterr()
    assert main(["trace", "show", out]) == 0
    shown = capsys.readouterr().out
    assert "request r-1" in shown and "ttft=2.00 ms" in shown
    assert [ln.split()[0] for ln in shown.split("\nphase")[1].splitlines()[1:]] == \
        ["gateway", "admission", "decode"]


def test_busy_port_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        capsys.readouterr()
        rc = main(["trace", "serve", "--port", str(port), "--out", os.devnull])
    err = capsys.readouterr().err
    assert rc == 1 and f"port {port}" in err and len(err.strip().splitlines()) == 1, err
