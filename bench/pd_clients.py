"""Load generation for bench/pd_system.py: the same cases driven through the engine in-process
and through the running gateway (gRPC Generate, or REST SSE), all recorded as Traces.

A Trace is one request seen by its client: when it was sent and when each message with new
tokens arrived (time, how many tokens). Everything else (TTFT, TPOT, inter-token gaps, tokens/s)
is computed from traces by the same functions for both sides.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field


@dataclass
class Trace:
    t_send: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, new tokens)
    timings: dict | None = None  # the gateway's own account (gRPC API): queue, prefill, transfer

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.events)

    def token_times(self) -> list[float]:
        """One time per token; a message carrying n tokens spreads its gap over them evenly
        (as the gateway's own ITL metric does)."""
        out, prev = [], None
        for t, n in self.events:
            if prev is None:  # the first message: its first token is the TTFT, the rest follow
                out += [t] * n
            else:
                out += [prev + (t - prev) * (k + 1) / n for k in range(n)]
            prev = t
        return out


def percentile(xs, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no data."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def trace_stats(traces: list[Trace]) -> dict:
    """tok_s: all output tokens / (last token - first send); tpot_ms: median over requests of
    (last - first token) / (n - 1); itl_*: gaps between consecutive tokens of one request over
    the whole run, and only those starting after every request had its first token (no prompt
    being prefilled / its KV arriving any more)."""
    done = [t for t in traces if t.events]
    if not done:
        raise RuntimeError("no request produced a token")
    times = [t.token_times() for t in done]
    all_first = max(ts[0] for ts in times)
    gaps, late = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            gaps.append(b - a)
            if a >= all_first:
                late.append(b - a)
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times if len(ts) > 1]
    t0, t1 = min(t.t_send for t in done), max(ts[-1] for ts in times)
    n = sum(len(ts) for ts in times)
    return {**gateway_medians(done), "requests": len(traces), "completed": len(done), "tokens": n,
            "messages": sum(len(t.events) for t in done),  # < tokens: some came several at once
            "wall_s": t1 - t0, "tok_s": n / (t1 - t0) if t1 > t0 else float("nan"),
            "ttft_ms_median": percentile([ts[0] - t.t_send for t, ts in zip(done, times)], 50) * 1e3,
            "tpot_ms": percentile(tpots, 50) * 1e3,
            "itl_ms_median": percentile(gaps, 50) * 1e3, "itl_ms_p99": percentile(gaps, 99) * 1e3,
            "itl_ms_mean": sum(gaps) / len(gaps) * 1e3 if gaps else float("nan"),
            "itl_after_first_ms_median": percentile(late, 50) * 1e3,
            "itl_after_first_ms_p99": percentile(late, 99) * 1e3, "itl_after_first_gaps": len(late)}


def gateway_medians(traces: list[Trace]) -> dict[str, float]:
    """The gateway's account of the first tokens (gRPC API: ttft, queue, prefill, transfer ms),
    {'gateway_<part>_median': median over the traces that carry it}."""
    parts = [t.timings for t in traces if t.timings]
    return {f"gateway_{k}_median": percentile([p[k] for p in parts if k in p], 50)
            for k in (parts[0] if parts else {})}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids clear of the low (byte / control) and high (llama-3 special) ids."""
    rng = random.Random(seed)
    lo, hi = min(100, vocab // 4), min(vocab, 128000)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


# ---- the engine alone, in-process ----------------------------------------------------------

def run_engine(eng, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None,
               tag: str = "r") -> list[Trace]:
    """All prompts added at once (a closed loop of len(prompts) clients, one request each),
    then Engine.step() until they finish; token arrival = when step() returned it."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=logprobs)
    traces = {}
    stamp = time.monotonic_ns()
    try:
        for i, p in enumerate(prompts):
            rid = f"{tag}-{stamp}-{i}"
            traces[rid] = Trace(time.perf_counter())
            eng.add_request(rid, p, params)
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.new_token_ids and o.request_id in traces:
                    traces[o.request_id].events.append((now, len(o.new_token_ids)))
    except BaseException:
        for rid in traces:  # nothing of a failed case runs on into the next one
            eng.abort(rid)
        raise
    return list(traces.values())


# ---- the whole system, through the gateway -------------------------------------------------

async def grpc_one(stub, prompt: list[int], max_tokens: int, logprobs: int | None,
                   timeout_s: float) -> Trace:
    """One streaming Generate call, token ids in and out (skip_text: exact per-token times)."""
    from protos import generate_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.0)
    if logprobs is not None:
        sampling.logprobs = logprobs
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling,
                             max_tokens=max_tokens, ignore_eos=True, skip_text=True)
    tr = Trace(time.perf_counter())
    async for m in stub.Generate(req, timeout=timeout_s):
        if m.token_ids:
            tr.events.append((time.perf_counter(), len(m.token_ids)))
        if m.HasField("timings"):
            t = m.timings
            tr.timings = {"ttft_ms": t.ttft_ms, "queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms,
                          "transfer_ms": t.transfer_ms}
    return tr


def parse_sse(buf: bytes) -> tuple[list, bytes]:
    """Complete SSE events in buf -> (list of parsed `data:` payloads, the incomplete rest).
    '[DONE]' stays a string; other payloads are JSON."""
    out = []
    buf = buf.replace(b"\r\n", b"\n")
    while b"\n\n" in buf:
        raw, buf = buf.split(b"\n\n", 1)
        data = [ln[5:].lstrip() for ln in raw.split(b"\n") if ln.startswith(b"data:")]
        if not data:
            continue  # comments / keep-alives
        text = b"\n".join(data).decode()
        out.append(text if text == "[DONE]" else json.loads(text))
    return out, buf


def sse_tokens(ev: dict) -> int:
    """Tokens a /v1/completions stream chunk carries as far as the client can tell: its
    logprobs entries when asked, else one per chunk with a choice (a token whose text is empty
    is not sent at all; the REST client puts the tokens the usage counts but no chunk showed
    on the last one: add_unseen_tokens)."""
    ch = (ev.get("choices") or [None])[0]
    if ch is None:
        return 0
    lp = ch.get("logprobs")
    return len(lp["tokens"]) if lp and lp.get("tokens") is not None else 1


async def sse_chunks(resp):
    """The chunks of an OpenAI SSE stream (an aiohttp response) as they arrive: (arrival time,
    parsed chunk), '[DONE]' left out; an error chunk raises RuntimeError."""
    buf = b""
    async for part in resp.content.iter_any():
        now = time.perf_counter()
        evs, buf = parse_sse(buf + part)
        for ev in evs:
            if ev == "[DONE]":
                continue
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error'].get('message')}")
            yield now, ev


def add_unseen_tokens(events: list[tuple[float, int]], completion_tokens: int | None) -> None:
    """Tokens the usage counts but no chunk showed (a token whose text is empty is not sent)
    arrived with the last chunk."""
    seen = sum(n for _, n in events)
    if events and completion_tokens and completion_tokens > seen:
        t, n = events[-1]
        events[-1] = (t, n + completion_tokens - seen)


async def run_system(api: str, addr: str, model: str, prompts: list[list[int]], max_tokens: int,
                     logprobs: int | None = None, timeout_s: float = 600.0,
                     channels: int = 1) -> list[Trace]:
    """len(prompts) concurrent streaming clients, one request each; raises the first error.
    channels (gRPC): connections opened, the clients dealt round-robin over them."""
    import asyncio

    if api == "grpc":
        import grpc

        from protos import generate_pb2_grpc

        # NOTE: a local subchannel pool each: channels to one address would share a connection
        chs = [grpc.aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(max(1, min(channels, len(prompts))))]
        try:  # a client's connection is open before it asks: time the request only
            await asyncio.gather(*(ch.channel_ready() for ch in chs))
            stubs = [generate_pb2_grpc.GenerationStub(ch) for ch in chs]
            return list(await asyncio.gather(*(grpc_one(stubs[i % len(stubs)], p, max_tokens, logprobs,
                                                        timeout_s) for i, p in enumerate(prompts))))
        finally:
            await asyncio.gather(*(ch.close() for ch in chs))
    from bench.serve_client import ClientConfig, RestClient
    from bench.serve_trace import Req

    client = RestClient(ClientConfig(url=addr, model=model, send_slo=False, timeout_s=timeout_s,
                                     logprobs=logprobs))
    try:
        outs = await asyncio.gather(*(client.send(Req(i, p, None, max_tokens))
                                      for i, p in enumerate(prompts)))
    finally:
        await client.close()
    for o in outs:
        if o.status != "ok":
            raise RuntimeError(f"HTTP {o.code}: {o.error[:200]}" if o.code.isdigit()
                               else f"{o.code}: {o.error[:200]}")
    return [Trace(o.t_send, o.events) for o in outs]
