"""`splitserve generate "prompt"` and `splitserve chat`: terminal clients over the public gRPC
API, printing tokens as they stream."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys


def add_args(p: argparse.ArgumentParser, chat: bool) -> None:
    if not chat:
        p.add_argument("prompt", help="prompt text")
    p.add_argument("--server", default="127.0.0.1:50051", help="gateway gRPC host:port")
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"),
                   help="sent as 'authorization: Bearer <key>' (a gateway run with --api-key)")
    p.add_argument("--tls-ca", default=None,
                   help="connect over TLS, trusting this CA / self-signed certificate (PEM)")
    p.add_argument("--max-tokens", type=int, default=256 if chat else 64)
    p.add_argument("--temperature", type=float, default=0.7 if chat else 0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ttft-ms", type=int, default=None, help="TTFT SLO for admission control")
    if chat:
        p.add_argument("--system", default=None, help="system prompt")
    else:
        p.add_argument("--chat-template", action="store_true",
                       help="send the prompt as one user chat message")
    p.add_argument("--stats", action="store_true", help="print usage and timings at the end")


def _request(a, prompt=None, messages=None):
    from protos import generate_pb2

    sp = generate_pb2.SamplingParams(temperature=a.temperature)
    if a.top_p is not None:
        sp.top_p = a.top_p
    if a.seed is not None:
        sp.seed = a.seed
    kw = {"sampling": sp, "max_tokens": a.max_tokens, "stop": a.stop}
    if a.ttft_ms is not None:
        kw["slo"] = generate_pb2.SLO(ttft_ms=a.ttft_ms)
    if messages is not None:
        chat = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in messages])
        return generate_pb2.GenerateRequest(messages=chat, **kw)
    return generate_pb2.GenerateRequest(prompt=prompt, **kw)


async def stream_one(stub, req, out=sys.stdout, stats: bool = False) -> str:
    text, last = "", None
    async for r in stub.Generate(req):
        out.write(r.text)
        out.flush()
        text += r.text
        last = r
    out.write("\n")
    if stats and last is not None:
        u, t = last.usage, last.timings
        print(f"-- {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens "
              f"({u.cached_tokens} cached); ttft {t.ttft_ms:.0f} ms, total {t.total_ms:.0f} ms",
              file=sys.stderr)
    return text


def _channel(a):
    import grpc

    from common.auth import MetadataChannel

    if a.tls_ca:
        with open(a.tls_ca, "rb") as f:
            ch = grpc.aio.secure_channel(a.server, grpc.ssl_channel_credentials(f.read()))
    else:
        ch = grpc.aio.insecure_channel(a.server)
    return MetadataChannel(ch, (("authorization", f"Bearer {a.api_key}"),)) if a.api_key else ch


async def _run(a, chat: bool) -> int:
    import grpc

    from protos import generate_pb2_grpc

    async with _channel(a) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        try:
            if not chat:
                if a.chat_template:
                    req = _request(a, messages=[{"role": "user", "content": a.prompt}])
                else:
                    req = _request(a, prompt=a.prompt)
                await stream_one(stub, req, stats=a.stats)
                return 0
            history = [{"role": "system", "content": a.system}] if a.system else []
            print("chat with the model; empty line or Ctrl-D quits", file=sys.stderr)
            while True:
                try:
                    line = await asyncio.to_thread(input, "> ")
                except EOFError:
                    return 0
                if not line.strip():
                    return 0
                history.append({"role": "user", "content": line})
                reply = await stream_one(stub, _request(a, messages=history), stats=a.stats)
                history.append({"role": "assistant", "content": reply})
        except grpc.aio.AioRpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def run_client(a: argparse.Namespace, chat: bool) -> int:
    try:
        return asyncio.run(_run(a, chat))
    except KeyboardInterrupt:
        return 130
