"""Text views of request traces (`splitserve trace`): one request's waterfall and the slowest
requests of a run, from spans read by common/trace_otlp.py.

A request is a trace holding the gateway's GenAI span (the one with gen_ai.operation.name).
Our own spans name the phases; the gRPC instrumentation's rpc spans are shown with --all
(the KV handoff's rpc spans always: with a pool backend they are the handoff).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from common.trace_genai import GenAI
from common.trace_otlp import Span

# span name -> phase, in the order a request goes through them
PHASES = {"gateway.admission": "admission", "decode.reserve": "reserve", "prefill": "prefill",
          "kv.send": "kv handoff", "kv.receive": "kv handoff", "decode": "decode"}
PHASE_ORDER = ("gateway", "admission", "reserve", "prefill", "kv handoff", "decode", "prefill+decode")
_KV_RPC_METHODS = ("PushKV", "PoolHandoff", "PairSession")


def phase_of(s: Span) -> str | None:
    if GenAI.OPERATION in s.attributes:
        return "gateway"
    if s.name == "decode" and s.attributes.get("splitserve.prefill_here"):
        return "prefill+decode"  # prefilled on the decode replica (--prefill-on-decode)
    if s.name in PHASES:
        return PHASES[s.name]
    if s.attributes.get("rpc.method") in _KV_RPC_METHODS:
        return "kv handoff"
    return None


@dataclass
class Request:
    root: Span  # the GenAI span
    spans: list[Span]  # the whole trace

    @property
    def request_id(self) -> str:
        a = self.root.attributes
        return str(a.get(GenAI.REQUEST_ID) or a.get(GenAI.RESPONSE_ID) or "")

    def phases(self) -> dict[str, tuple[int, int]]:
        """phase -> (first start, last end) in ns over its spans."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.spans:
            p = phase_of(s)
            if p is None:
                continue
            a, b = out.get(p, (s.start_ns, s.end_ns))
            out[p] = (min(a, s.start_ns), max(b, s.end_ns))
        return out


def requests(spans: list[Span]) -> list[Request]:
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    out = []
    for tr in by_trace.values():
        for s in tr:
            if GenAI.OPERATION in s.attributes:
                out.append(Request(s, tr))
    return out


def find(reqs: list[Request], request_id: str | None = None, trace_id: str | None = None) -> Request:
    """The request named by id or trace id; else the slowest. Raises LookupError."""
    if request_id:
        got = [r for r in reqs if r.request_id == request_id]
    elif trace_id:
        got = [r for r in reqs if r.root.trace_id == trace_id.lower()]
    else:
        got = sorted(reqs, key=lambda r: -r.root.duration_ms)
    if not got:
        what = (f"request id {request_id!r}" if request_id
                else f"trace id {trace_id!r}" if trace_id else "a request")
        raise LookupError(f"no trace with {what} among {len(reqs)} requests")
    return got[0]


def _label(s: Span) -> str:
    """rpc spans by service and method (`rpc Decode/Reserve`), others by name."""
    svc, method = s.attributes.get("rpc.service"), s.attributes.get("rpc.method")
    if svc and method:
        return f"rpc {str(svc).rsplit('.', 1)[-1]}/{method}"
    return s.name


def _children(spans: list[Span]) -> tuple[list[Span], dict[str, list[Span]]]:
    ids = {s.span_id for s in spans}
    kids: dict[str, list[Span]] = defaultdict(list)
    roots = []
    for s in sorted(spans, key=lambda s: s.start_ns):
        (kids[s.parent_span_id] if s.parent_span_id in ids else roots).append(s)
    return roots, kids


def waterfall(req: Request, width: int = 50, all_spans: bool = False) -> str:
    """One request: every span in tree order with its offset, duration and a bar; then the
    phases with the gap before each (time no phase of the request was running)."""
    t0 = min(s.start_ns for s in req.spans)
    t1 = max(s.end_ns for s in req.spans)
    total = max(t1 - t0, 1)
    roots, kids = _children(req.spans)
    rows = []

    def walk(s: Span, depth: int) -> None:
        shown = all_spans or phase_of(s) is not None
        if shown:
            a = int((s.start_ns - t0) / total * width)
            n = max(1, round((s.end_ns - s.start_ns) / total * width))
            bar = " " * a + "#" * min(n, width - a)
            label = ("  " * depth + _label(s))[:44]
            err = "  ERROR" if s.status_code == 2 else ""
            rows.append(f"{label:<44} {s.service.removeprefix('splitserve-'):<9} "
                        f"{(s.start_ns - t0) / 1e6:>9.2f} {s.duration_ms:>9.2f} |{bar:<{width}}|{err}")
        for c in kids.get(s.span_id, ()):
            walk(c, depth + 1 if shown else depth)

    for r in roots:
        walk(r, 0)
    a = req.root.attributes
    head = (f"request {req.request_id}  trace {req.root.trace_id}  {req.root.name}  "
            f"{req.root.duration_ms:.2f} ms")
    facts = [f"{k.split('.')[-1] if k != GenAI.USAGE_CACHE_READ else 'cached'}={a[k]}"
             for k in (GenAI.USAGE_INPUT_TOKENS, GenAI.USAGE_OUTPUT_TOKENS, GenAI.USAGE_CACHE_READ,
                       GenAI.RESPONSE_FINISH_REASONS, GenAI.ERROR_TYPE) if k in a]
    if GenAI.TIME_TO_FIRST_CHUNK in a:
        facts.insert(0, f"ttft={a[GenAI.TIME_TO_FIRST_CHUNK] * 1e3:.2f} ms")
    out = [head, "  " + "  ".join(facts),
           f"{'span':<44} {'service':<9} {'start ms':>9} {'dur ms':>9} |{'':<{width}}|", *rows, "",
           f"{'phase':<14} {'start ms':>9} {'dur ms':>9} {'gap before':>11}"]
    ends, ph = t0, req.phases()
    for p in PHASE_ORDER:
        if p not in ph:
            continue
        a_ns, b_ns = ph[p]
        gap = (a_ns - ends) / 1e6 if p != "gateway" else 0.0
        out.append(f"{p:<14} {(a_ns - t0) / 1e6:>9.2f} {(b_ns - a_ns) / 1e6:>9.2f} "
                   f"{max(gap, 0.0):>11.2f}")
        ends = a_ns if p == "gateway" else max(ends, b_ns)
    return "\n".join(out)


def slowest(reqs: list[Request], n: int = 10) -> str:
    """The n slowest requests with their phase durations (ms)."""
    cols = ("admission", "reserve", "prefill", "kv handoff", "decode")
    head = (f"{'request':<24} {'total ms':>9} {'ttft ms':>8} {'in':>5} {'out':>5} "
            + " ".join(f"{c.split()[0]:>9}" for c in cols) + "  error")
    rows = [head]
    for r in sorted(reqs, key=lambda r: -r.root.duration_ms)[:n]:
        a, ph = r.root.attributes, r.phases()
        if "prefill+decode" in ph:
            ph.setdefault("decode", ph["prefill+decode"])
        ttft = a.get(GenAI.TIME_TO_FIRST_CHUNK)
        rows.append(f"{r.request_id[:24]:<24} {r.root.duration_ms:>9.2f} "
                    f"{(f'{ttft * 1e3:.2f}' if ttft is not None else '-'):>8} "
                    f"{a.get(GenAI.USAGE_INPUT_TOKENS, '-'):>5} {a.get(GenAI.USAGE_OUTPUT_TOKENS, '-'):>5} "
                    + " ".join(f"{(ph[c][1] - ph[c][0]) / 1e6:>9.2f}" if c in ph else f"{'-':>9}"
                               for c in cols)
                    + f"  {a.get(GenAI.ERROR_TYPE, '')}")
    rows.append(f"{len(reqs)} requests")
    return "\n".join(rows)
