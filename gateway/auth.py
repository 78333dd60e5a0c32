"""The gateway's public front: optional API keys, TLS, a per-key concurrency limit.

REST: `Authorization: Bearer <key>`, else 401 with an OpenAI-style error body; more running
requests of one key than --max-concurrency-per-key -> 429. gRPC: metadata `authorization:
Bearer <key>`, else UNAUTHENTICATED; over the limit RESOURCE_EXHAUSTED. /health, /metrics and
grpc.health.v1 stay open (load balancers, scrapers). Without keys every caller shares one
anonymous key (the limit then bounds all callers together).

    front = PublicAuth.create(keys, tls_cert, tls_key, max_per_key)
    app = front.wrap_asgi(app); server = grpc.aio.server(interceptors=front.grpc_interceptors())
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field

import grpc

from common.grpc_util import handler_like

ENV_API_KEY = "SPLITSERVE_API_KEY"
OPEN_PATHS = ("/health", "/metrics")
OPEN_GRPC = ("/grpc.health.v1.Health/",)
ANONYMOUS = "-"


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and '#' comments skipped."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def collect_keys(flag_keys: list[str] | None, key_file: str | None) -> tuple[str, ...]:
    """--api-key (repeat), --api-key-file and SPLITSERVE_API_KEY (comma-separated), together."""
    keys = list(flag_keys or [])
    if key_file:
        keys += read_key_file(key_file)
    keys += [k.strip() for k in os.environ.get(ENV_API_KEY, "").split(",") if k.strip()]
    for k in keys:
        if len(k) < 8 or any(c.isspace() for c in k):
            raise ValueError("an API key must have >= 8 characters and no whitespace")
    return tuple(dict.fromkeys(keys))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyLimiter:
    """Running requests per key (one event loop: no lock needed)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.running: dict[str, int] = {}

    def acquire(self, key_id: str) -> bool:
        n = self.running.get(key_id, 0)
        if self.limit is not None and n >= self.limit:
            return False
        self.running[key_id] = n + 1
        return True

    def release(self, key_id: str) -> None:
        n = self.running.get(key_id, 0) - 1
        if n > 0:
            self.running[key_id] = n
        else:
            self.running.pop(key_id, None)


@dataclass
class PublicAuth:
    digests: dict[bytes, str] = field(default_factory=dict)  # sha256(key) -> key id (for limits)
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    limiter: KeyLimiter = field(default_factory=lambda: KeyLimiter(None))

    @classmethod
    def create(cls, keys=(), tls_cert: str | None = None, tls_key: str | None = None,
               max_per_key: int | None = None) -> "PublicAuth":
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if max_per_key is not None and max_per_key < 1:
            raise ValueError(f"--max-concurrency-per-key must be >= 1, got {max_per_key}")
        cert = key = None
        if tls_cert:
            try:
                with open(tls_cert, "rb") as f:
                    cert = f.read()
                with open(tls_key, "rb") as f:
                    key = f.read()
            except OSError as e:
                raise ValueError(f"--tls-cert / --tls-key {e.filename}: {e.strerror}") from None
        return cls({_digest(k): _digest(k).hex()[:12] for k in keys}, cert, key, tls_cert, tls_key,
                   KeyLimiter(max_per_key))

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def key_id(self, authorization: str | None) -> str | None:
        """The caller's key id, ANONYMOUS when no keys are configured, None when refused."""
        if not self.digests:
            return ANONYMOUS
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        got = _digest(token.strip())
        found = None
        for d, kid in self.digests.items():  # NOTE: every digest compared: no early exit
            if hmac.compare_digest(d, got):
                found = kid
        return found

    # ---- REST -----------------------------------------------------------------------------
    def wrap_asgi(self, app):
        if not self.digests and self.limiter.limit is None:
            return app

        async def guarded(scope, receive, send):
            if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
                return await app(scope, receive, send)
            auth = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                         if k == b"authorization"), None)
            kid = self.key_id(auth)
            if kid is None:
                msg = ("Missing API key: send 'Authorization: Bearer <key>'" if not auth
                       else "Incorrect API key provided")
                return await _json(send, 401, msg, "invalid_request_error", "invalid_api_key",
                                   [(b"www-authenticate", b"Bearer")])
            if not self.limiter.acquire(kid):
                return await _json(send, 429, f"Too many concurrent requests for this API key "
                                   f"(limit {self.limiter.limit})", "rate_limit_error",
                                   "rate_limit_exceeded", [(b"retry-after", b"1")])
            try:
                await app(scope, receive, send)
            finally:  # NOTE: a streamed response is over only when the app returns
                self.limiter.release(kid)
        return guarded

    # ---- gRPC -----------------------------------------------------------------------------
    def grpc_interceptors(self) -> list:
        if not self.digests and self.limiter.limit is None:
            return []
        return [_GrpcFront(self)]

    def add_port(self, server, address: str) -> int:
        if self.tls_cert is None:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])
        return server.add_secure_port(address, creds)

    def uvicorn_ssl(self) -> dict:
        if self.tls_cert_file is None:
            return {}
        return {"ssl_certfile": self.tls_cert_file, "ssl_keyfile": self.tls_key_file}


async def _json(send, status: int, message: str, etype: str, code: str, headers=()) -> None:
    body = json.dumps({"error": {"message": message, "type": etype, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class _GrpcFront(grpc.aio.ServerInterceptor):
    def __init__(self, front: PublicAuth):
        self.front = front

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC):
            return handler
        auth = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        kid = self.front.key_id(auth if isinstance(auth, str) else None)
        return _wrap(handler, self.front.limiter, kid)


def _wrap(handler, limiter: KeyLimiter, kid: str | None):
    """The handler behind a key check and the per-key limit."""
    async def check(context) -> None:
        if kid is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or incorrect API key: send metadata 'authorization: Bearer <key>'")
        if not limiter.acquire(kid):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many concurrent requests for this API key (limit {limiter.limit})")

    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request, context):
            await check(context)
            try:
                return await inner(request, context)
            finally:
                limiter.release(kid)
        return handler_like(handler, unary)
    inner = handler.unary_stream or handler.stream_stream

    async def streaming(request, context):
        await check(context)
        try:
            async for msg in inner(request, context):
                yield msg
        finally:
            limiter.release(kid)
    return handler_like(handler, streaming)
