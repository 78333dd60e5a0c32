"""Clients and load loops for bench/serve.py: one request -> one `Outcome` (send time, the
arrival time and token count of every streamed message, status, admission details).

APIs: "completions" (POST /v1/completions, SSE; token ids as the prompt when the trace has
them), "chat" (POST /v1/chat/completions, SSE; text), "grpc" (splitserve.v1.Generation/Generate:
token ids in and out, skip_text, so every token's arrival is seen). The REST clients speak
plain OpenAI plus the gateway's extension fields (ttft_ms, tpot_ms, priority, ignore_eos), so
they drive any OpenAI-compatible server. A 429 / RESOURCE_EXHAUSTED is a rejection (its
Retry-After and, from the gateway's message, the predicted delay are kept), anything else that
fails is an error.
"""
from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import dataclass, field

from bench.pd_clients import add_unseen_tokens, sse_chunks, sse_tokens
from bench.serve_trace import Req

_PRED = re.compile(r"predicted (TTFT|TPOT) ([0-9.]+) ms")


@dataclass
class Outcome:
    idx: int
    t_send: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, new tokens)
    t_end: float = 0.0
    status: str = "ok"  # ok | rejected | error
    code: str = ""  # HTTP status or gRPC code name when not ok
    error: str = ""
    retry_after_s: float | None = None
    predicted_ms: float | None = None  # the rejection's predicted delay (gateway message)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    queue_ms: float | None = None  # gRPC: the gateway's own queue time
    # the gateway's admission estimates (calibrated, before headroom) and its TTFT measured
    # from the admit decision, which they predict (splitserve timings; None elsewhere)
    pred_ttft_ms: float | None = None
    pred_tpot_ms: float | None = None
    gw_ttft_ms: float | None = None
    parts: dict | None = None  # the gateway's TTFT parts and its model's (PARTS keys present)


# timings kept per request: where the TTFT went, what the admission model said of each part,
# and what its TTFT fit saw (the prefill steps ahead; lab/admission_replay.py replays it)
PARTS = ("queue_ms", "prefill_ms", "transfer_ms", "predicted_raw_ttft_ms",
         "predicted_idle_ttft_ms", "predicted_ttft_bucket", "predicted_fit_ttft_ms",
         "predicted_cached_tokens", "predicted_decode_batch", "ahead_running_tokens",
         "ahead_queued_tokens", "ahead_elapsed_ms", "ahead_tokens_per_s")


def _timings(o: Outcome, t: dict) -> None:
    """The gateway's final timings (REST "timings" beside usage, gRPC Timings) -> o."""
    if t.get("predicted_ttft_ms"):
        o.pred_ttft_ms, o.pred_tpot_ms = t["predicted_ttft_ms"], t.get("predicted_tpot_ms") or None
        if t.get("ttft_ms"):
            o.gw_ttft_ms = t["ttft_ms"] - t.get("admitted_ms", 0.0)
    parts = {k: t[k] for k in PARTS if isinstance(t.get(k), (int, float))}
    if parts:
        o.parts = parts


@dataclass
class ClientConfig:
    api: str = "completions"  # completions | chat | grpc
    url: str = "http://127.0.0.1:8000"  # REST base URL, or host:port for grpc
    model: str | None = None
    send_slo: bool = True
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    priority: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str | None = None
    logprobs: int | None = None  # completions: top logprobs a token (None: not asked)


def _rejection(o: Outcome, code: str, msg: str, retry: float | None) -> None:
    o.status, o.code, o.error, o.retry_after_s = "rejected", code, msg[:300], retry
    m = _PRED.search(msg)
    if m:
        o.predicted_ms = float(m.group(2))


class RestClient:
    def __init__(self, cfg: ClientConfig):
        import aiohttp

        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             headers=headers)

    async def model(self) -> str:
        async with self.session.get(self.cfg.url.rstrip("/") + "/v1/models") as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]

    def body(self, req: Req) -> tuple[str, dict]:
        c = self.cfg
        b = {"model": c.model, "max_tokens": req.max_tokens, "temperature": c.temperature,
             "stream": True, "stream_options": {"include_usage": True}}
        if c.ignore_eos:
            b["ignore_eos"] = True
        if c.send_slo:
            b.update({k: v for k, v in (("ttft_ms", c.ttft_ms), ("tpot_ms", c.tpot_ms)) if v})
        if c.priority is not None:
            b["priority"] = c.priority
        if c.api == "chat":
            b["messages"] = req.messages or [{"role": "user", "content": req.text or ""}]
            return "/v1/chat/completions", b
        b["prompt"] = req.prompt_ids if req.prompt_ids is not None else req.text
        if c.logprobs is not None:
            b["logprobs"] = c.logprobs
        return "/v1/completions", b

    async def send(self, req: Req) -> Outcome:
        import aiohttp

        path, body = self.body(req)
        o = Outcome(req.idx, time.perf_counter())
        usage = timings = None
        try:
            async with self.session.post(self.cfg.url.rstrip("/") + path, json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as r:
                if r.status != 200:
                    text = await r.text()
                    if r.status == 429:
                        ra = r.headers.get("Retry-After")
                        _rejection(o, "429", text, float(ra) if ra and ra.replace(".", "").isdigit()
                                   else None)
                    else:
                        o.status, o.code, o.error = "error", str(r.status), text[:300]
                    return o
                async for now, ev in sse_chunks(r):
                    usage = ev.get("usage") or usage
                    timings = ev.get("timings") or timings
                    n = sse_tokens(ev)
                    if n:
                        o.events.append((now, n))
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
            o.status, o.code, o.error = "error", type(e).__name__, str(e)[:300]
        finally:
            o.t_end = time.perf_counter()
        if usage:
            o.prompt_tokens, o.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
            o.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            add_unseen_tokens(o.events, o.completion_tokens)
        if isinstance(timings, dict):
            _timings(o, timings)
        if o.status == "ok" and not o.events:
            o.status, o.error = "error", "no tokens streamed"
        return o

    async def close(self):
        await self.session.close()


class GrpcClient:
    def __init__(self, cfg: ClientConfig):
        import grpc

        from protos import generate_pb2_grpc

        self.cfg = cfg
        self.channel = grpc.aio.insecure_channel(cfg.url)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    async def model(self) -> str:
        from protos import generate_pb2 as pb

        return (await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)).model

    def request(self, req: Req):
        from protos import generate_pb2 as pb

        c = self.cfg
        g = pb.GenerateRequest(max_tokens=req.max_tokens, ignore_eos=c.ignore_eos, skip_text=True,
                               sampling=pb.SamplingParams(temperature=c.temperature))
        if req.prompt_ids is not None:
            g.token_ids.CopyFrom(pb.TokenIds(ids=req.prompt_ids))
        elif req.messages:
            g.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in req.messages]))
        else:
            g.prompt = req.text or ""
        if c.send_slo:
            if c.ttft_ms:
                g.slo.ttft_ms = int(c.ttft_ms)
            if c.tpot_ms:
                g.slo.tpot_ms = int(c.tpot_ms)
        if c.priority is not None:
            g.priority = c.priority
        return g

    async def send(self, req: Req) -> Outcome:
        import grpc

        o = Outcome(req.idx, time.perf_counter())
        call = self.stub.Generate(self.request(req), timeout=self.cfg.timeout_s)
        try:
            async for m in call:
                if m.token_ids:
                    o.events.append((time.perf_counter(), len(m.token_ids)))
                if m.finish_reason:
                    o.prompt_tokens, o.completion_tokens = m.usage.prompt_tokens, m.usage.completion_tokens
                    o.cached_tokens, o.queue_ms = m.usage.cached_tokens, m.timings.queue_ms
                    t = m.timings
                    _timings(o, {"predicted_ttft_ms": t.predicted_ttft_ms, "ttft_ms": t.ttft_ms,
                                 "predicted_tpot_ms": t.predicted_tpot_ms,
                                 "admitted_ms": t.admitted_ms,
                                 **{k: getattr(t, k) for k in PARTS}})
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                md = dict(e.trailing_metadata() or ())
                ra = md.get("retry-after-ms")
                _rejection(o, e.code().name, e.details() or "", float(ra) / 1e3 if ra else None)
            else:
                o.status, o.code, o.error = "error", e.code().name, (e.details() or "")[:300]
        finally:
            o.t_end = time.perf_counter()
        if o.status == "ok" and not o.events:
            o.status, o.error = "error", "no tokens streamed"
        return o

    async def close(self):
        await self.channel.close()


def make_client(cfg: ClientConfig):
    if cfg.api not in ("completions", "chat", "grpc"):
        raise ValueError(f"api {cfg.api!r}: completions, chat or grpc")
    return GrpcClient(cfg) if cfg.api == "grpc" else RestClient(cfg)


async def run_load(cfg: ClientConfig, reqs: list[Req], times: list[float] | None, concurrency: int,
                   label: str = "") -> tuple[list[Outcome], float]:
    """One load on its own client: open loop at `times`, else `concurrency` closed-loop clients
    -> (outcomes, wall s)."""
    client = make_client(cfg)
    try:
        if times is not None:
            return await run_open(client, reqs, times, label)
        return await run_closed(client, reqs, concurrency, label)
    finally:
        await client.close()


class Progress:
    """One status line on stderr (rewritten in place on a terminal, every 5 s otherwise)."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.sent = self.ok = self.rejected = self.errors = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self.tty = sys.stderr.isatty()

    def done(self, o: Outcome) -> None:
        self.ok += o.status == "ok"
        self.rejected += o.status == "rejected"
        self.errors += o.status == "error"
        self.show()

    def show(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self._last < (0.25 if self.tty else 5.0):
            return
        self._last = now
        fin = self.ok + self.rejected + self.errors
        bar = "#" * int(20 * fin / max(self.total, 1))
        line = (f"{self.label} [{bar:<20}] {fin}/{self.total} sent {self.sent} ok {self.ok} "
                f"rejected {self.rejected} errors {self.errors} {now - self.t0:.1f}s")
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "",
              file=sys.stderr, flush=True)


async def run_open(client, reqs: list[Req], times: list[float], label: str = "") -> tuple[list[Outcome], float]:
    """Each request sent at its arrival offset whatever the others do -> (outcomes, wall s)."""
    prog = Progress(label, len(reqs))
    t0 = time.perf_counter()

    async def one(r: Req, at: float) -> Outcome:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        prog.sent += 1
        o = await client.send(r)
        prog.done(o)
        return o

    outs = await asyncio.gather(*(one(r, t) for r, t in zip(reqs, times)))
    prog.show(final=True)
    return list(outs), time.perf_counter() - t0


async def run_closed(client, reqs: list[Req], concurrency: int, label: str = ""
                     ) -> tuple[list[Outcome], float]:
    """`concurrency` clients, each sending its next request when the last one ended."""
    prog = Progress(label, len(reqs))
    it = iter(reqs)
    outs: list[Outcome] = []
    t0 = time.perf_counter()

    async def worker():
        for r in it:
            prog.sent += 1
            o = await client.send(r)
            outs.append(o)
            prog.done(o)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    prog.show(final=True)
    return sorted(outs, key=lambda o: o.idx), time.perf_counter() - t0
