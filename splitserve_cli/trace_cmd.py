"""`splitserve trace`: look at request traces without a tracing backend.

    splitserve trace serve [--port 4317] [--out spans.jsonl]   an OTLP/gRPC receiver writing
                                                              OTLP/JSON lines
    splitserve trace show FILE... [--request-id ID | --trace-id T] [--all]
                                                              one request's waterfall
                                                              (default: the slowest)
    splitserve trace top FILE... [-n 10]                      the slowest requests, by phase

Spans come from that receiver (point the services at it: OTEL_TRACES_EXPORTER=otlp
OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317) or straight from the services
(SPLITSERVE_TRACE_FILE=spans.jsonl), or from a Collector's file exporter.
"""
from __future__ import annotations

import argparse
import sys
import threading


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_cmd", required=True)
    s = sub.add_parser("serve", help="run an OTLP/gRPC receiver that appends spans to a file")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=4317, help="OTLP/gRPC port (default 4317; 0 = free)")
    s.add_argument("--out", default="spans.jsonl", help="OTLP/JSON lines file (appended)")
    w = sub.add_parser("show", help="one request's waterfall (default: the slowest request)")
    w.add_argument("files", nargs="+", help="OTLP/JSON files")
    w.add_argument("--request-id", default=None, help="gen_ai.response.id / splitserve.request_id")
    w.add_argument("--trace-id", default=None)
    w.add_argument("--all", action="store_true", help="also the rpc.* spans of every gRPC call")
    w.add_argument("--width", type=int, default=50, help="bar chart width in characters")
    t = sub.add_parser("top", help="the slowest requests with their phase durations")
    t.add_argument("files", nargs="+", help="OTLP/JSON files")
    t.add_argument("-n", type=int, default=10, help="how many (default 10)")


def run(a: argparse.Namespace) -> int:
    if a.trace_cmd == "serve":
        return _serve(a)
    from common import trace_view
    from common.trace_otlp import read_spans

    try:
        reqs = trace_view.requests(read_spans(a.files))
    except (OSError, ValueError) as e:
        print(f"splitserve trace: cannot read spans: {e}", file=sys.stderr)
        return 2
    if a.trace_cmd == "top":
        if a.n < 1:
            print("splitserve trace top: -n must be >= 1", file=sys.stderr)
            return 2
        print(trace_view.slowest(reqs, a.n))
        return 0
    if a.width < 10:
        print("splitserve trace show: --width must be >= 10", file=sys.stderr)
        return 2
    try:
        req = trace_view.find(reqs, a.request_id, a.trace_id)
    except LookupError as e:
        print(f"splitserve trace show: {e}", file=sys.stderr)
        return 1
    print(trace_view.waterfall(req, a.width, a.all))
    return 0


def _serve(a: argparse.Namespace) -> int:
    from common.trace_otlp import JsonLinesWriter, request_to_json, serve_receiver

    from common.grpc_util import PortInUseError, check_ports_free

    try:
        check_ports_free(a.host, [("OTLP receiver", a.port)])
    except PortInUseError as e:
        print(f"splitserve trace serve: {e}", file=sys.stderr)
        return 1
    writer = JsonLinesWriter(a.out)
    count = [0]

    def on_request(req) -> None:
        writer.write(request_to_json(req))
        count[0] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)

    try:
        server, port = serve_receiver(on_request, a.host, a.port)
    except (OSError, RuntimeError) as e:
        print(f"splitserve trace serve: port {a.port} on {a.host}: {e}", file=sys.stderr)
        return 1
    print(f"OTLP/gRPC receiver on {a.host}:{port}, writing {a.out}; point the services at it:\n"
          f"  OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT=http://{a.host}:{port} "
          f"splitserve up", flush=True)
    stop = threading.Event()
    try:
        import signal

        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(None)
        writer.close()
        print(f"{count[0]} spans written to {a.out}", flush=True)
    return 0
