"""Credentials of the internal plane (prefill, decode, KV transfer, pair setup).

Every internal RPC carries a shared secret in gRPC metadata; servers check it with a
constant-time compare (grpc.health.v1 stays open for supervisors and load balancers) and
answer UNAUTHENTICATED otherwise. Clients get channels that add it to every call's metadata
(MetadataChannel), with a per-process token decode binds requests to (caller_id). mTLS
(`--internal-tls-*`) may be added on top.

The secret also keys HMACs: decode signs its transfer tickets (prefill pushes KV only to the
decode that issued a ticket) and the dist backend's store key prefixes.

    auth = internal_auth_from_args(args)          # flags / SPLITSERVE_INTERNAL_SECRET[_FILE]
    server = grpc.aio.server(interceptors=auth.server_interceptors())
    ch = auth.channel("host:port", options)       # an internal client channel
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field

import grpc

from common.envs import env_bool, env_str
from common.grpc_util import handler_like

SECRET_KEY = "x-splitserve-internal-secret"
CLIENT_KEY = "x-splitserve-client"  # a per-process token: who owns a request on decode
ENV_SECRET = "SPLITSERVE_INTERNAL_SECRET"
ENV_SECRET_FILE = "SPLITSERVE_INTERNAL_SECRET_FILE"
ENV_INSECURE = "SPLITSERVE_INSECURE_INTERNAL"
MIN_SECRET_CHARS = 16
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # supervisors probe health without credentials


class AuthConfigError(ValueError):
    """Bad or missing internal credentials (the process exits 2 naming the flag)."""


def generate_secret() -> str:
    return secrets.token_hex(32)


def read_secret_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path) as f:
            secret = f.read().strip()
    except OSError as e:
        raise AuthConfigError(f"--internal-secret-file {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):  # NOTE: a readable secret is no secret
        raise AuthConfigError(f"--internal-secret-file {path} is readable by others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    return secret


def write_secret_file(path: str, secret: str) -> None:
    """Create `path` with mode 0600 (never briefly wider) holding the secret."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes  # peers' certificates must chain to it (both directions: mutual TLS)

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> "TlsFiles":
        out = []
        for flag, path in (("--internal-tls-cert", cert), ("--internal-tls-key", key),
                           ("--internal-tls-ca", ca)):
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as e:
                raise AuthConfigError(f"{flag} {path}: {e.strerror}") from None
        return cls(*out)


@dataclass(frozen=True)
class InternalAuth:
    """secret None: --insecure-internal, nothing is sent or checked (trusted network only)."""
    secret: str | None = None
    tls: TlsFiles | None = None
    client_id: str = field(default_factory=lambda: secrets.token_hex(12))

    def __post_init__(self):
        if self.secret is not None and len(self.secret) < MIN_SECRET_CHARS:
            raise AuthConfigError(f"the internal secret must have >= {MIN_SECRET_CHARS} characters")

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    # ---- servers ------------------------------------------------------------------------
    def server_interceptors(self) -> list:
        return [SecretInterceptor(self.secret)] if self.secret is not None else []

    def add_port(self, server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials([(self.tls.key, self.tls.cert)],
                                            root_certificates=self.tls.ca, require_client_auth=True)
        return server.add_secure_port(address, creds)

    # ---- clients ------------------------------------------------------------------------
    def metadata(self) -> tuple[tuple[str, str], ...]:
        if self.secret is None:
            return ()
        return ((SECRET_KEY, self.secret), (CLIENT_KEY, self.client_id))

    def channel(self, address: str, options=None) -> grpc.aio.Channel:
        if self.tls is None:
            ch = grpc.aio.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=self.tls.ca, private_key=self.tls.key,
                                                 certificate_chain=self.tls.cert)
            ch = grpc.aio.secure_channel(address, creds, options=options)
        md = self.metadata()
        return MetadataChannel(ch, md) if md else ch

    # ---- HMACs keyed by the secret --------------------------------------------------------
    def _key(self, purpose: str) -> bytes:
        return hmac.new(self.secret.encode(), f"splitserve/{purpose}/v1".encode(), hashlib.sha256).digest()

    def sign(self, purpose: str, *fields) -> bytes:
        """HMAC-SHA256 over the fields (joined unambiguously); b"" when insecure."""
        if self.secret is None:
            return b""
        msg = b"\x1f".join(repr(f).encode() for f in fields)
        return hmac.new(self._key(purpose), msg, hashlib.sha256).digest()

    def verify(self, purpose: str, signature: bytes, *fields) -> bool:
        if self.secret is None:
            return True
        return hmac.compare_digest(self.sign(purpose, *fields), bytes(signature))

    def store_prefix(self, pair_id: str) -> str:
        """A key prefix strangers on the dist store cannot guess (the pair id travels in clear)."""
        if self.secret is None:
            return pair_id
        return hmac.new(self._key("store"), pair_id.encode(), hashlib.sha256).hexdigest()


TICKET_CLOCK_SKEW_MS = 5000  # hosts' wall clocks may differ this much


def ticket_fields(ticket, request_id: str) -> tuple:
    """What decode signs in a TransferTicket: where the KV goes and what it may write."""
    lay, pair = ticket.layout, ticket.pair
    return (request_id, ticket.transfer_id, ticket.decode_address, tuple(ticket.block_ids),
            ticket.block_size, ticket.num_tokens, ticket.expires_unix_ms,
            (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype), tuple(ticket.kv_backends),
            (pair.store_address, pair.device, pair.device_uuid, pair.host_id),
            ticket.num_cached_blocks, bytes(ticket.prompt_digest))


def prompt_digest(token_ids) -> bytes:
    """sha256 of a prompt's token ids (uint32 little endian): binds a ticket to one prompt."""
    return hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in token_ids)).digest()


def sign_ticket(auth: InternalAuth | None, ticket, request_id: str) -> None:
    if auth is not None and auth.enabled:
        ticket.signature = auth.sign("ticket", *ticket_fields(ticket, request_id))


def ticket_refusal(auth: InternalAuth | None, ticket, request_id: str, now_ms: float) -> str | None:
    """Why prefill must not act on this ticket (forged, altered, for another request, expired),
    or None."""
    if auth is None or not auth.enabled:
        return None
    if not ticket.signature or not auth.verify("ticket", ticket.signature,
                                               *ticket_fields(ticket, request_id)):
        return (f"transfer ticket for request {request_id!r} is not signed by a decode of this "
                "deployment (forged, altered or for another request)")
    if now_ms > ticket.expires_unix_ms + TICKET_CLOCK_SKEW_MS:
        return f"transfer ticket for request {request_id!r} expired"
    return None


def caller_id(context) -> str:
    """The authenticated caller's process token ('' without one): who owns its requests."""
    for k, v in context.invocation_metadata() or ():
        if k == CLIENT_KEY:
            return v
    return ""


# ---- server interceptor -------------------------------------------------------------------
class SecretInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, secret: str):
        self._want = secret.encode()

    def _ok(self, details) -> bool:
        for k, v in details.invocation_metadata or ():
            if k == SECRET_KEY:
                got = v.encode() if isinstance(v, str) else bytes(v)
                return hmac.compare_digest(got, self._want)
        return False

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_SERVICES) or self._ok(details):
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else _deny(handler, details.method)


def _deny(handler, method: str):
    msg = f"{method}: missing or wrong internal credentials (see --internal-secret-file)"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    return handler_like(handler, unary)


# ---- client side ----------------------------------------------------------------------------
class MetadataChannel:
    """A grpc.aio channel whose calls all carry `md` too. NOTE: not a client interceptor: those
    wrap every call in extra tasks (~150 us per unary call measured on 2 loaded cores)."""

    def __init__(self, channel: grpc.aio.Channel, md: tuple):
        self._ch, self._md = channel, md

    def __getattr__(self, name):
        return getattr(self._ch, name)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self._ch.close()

    def _wrap(self, kind: str, method: str, *a, **kw):
        return _WithMetadata(getattr(self._ch, kind)(method, *a, **kw), self._md)

    def unary_unary(self, method, *a, **kw):
        return self._wrap("unary_unary", method, *a, **kw)

    def unary_stream(self, method, *a, **kw):
        return self._wrap("unary_stream", method, *a, **kw)

    def stream_unary(self, method, *a, **kw):
        return self._wrap("stream_unary", method, *a, **kw)

    def stream_stream(self, method, *a, **kw):
        return self._wrap("stream_stream", method, *a, **kw)


class _WithMetadata:
    def __init__(self, multicallable, md: tuple):
        self._call, self._md = multicallable, md

    def __call__(self, request=None, *, metadata=None, **kw):
        md = (*metadata, *self._md) if metadata else self._md
        if request is None:  # a stream-request call may take its messages by write()
            return self._call(metadata=md, **kw)
        return self._call(request, metadata=md, **kw)


# ---- flags ------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("internal plane credentials")
    g.add_argument("--internal-secret-file", default=env_str(ENV_SECRET_FILE),
                   help="file (mode 0600) holding the shared secret of the internal RPCs "
                        f"(also {ENV_SECRET_FILE}; `splitserve up` generates one and passes it "
                        f"in {ENV_SECRET})")
    g.add_argument("--insecure-internal", action="store_true", default=env_bool(ENV_INSECURE, False),
                   help="internal RPCs without credentials (a trusted network only)")
    g.add_argument("--internal-tls-cert", default=None, help="mTLS: this process's certificate (PEM)")
    g.add_argument("--internal-tls-key", default=None, help="mTLS: its private key (PEM)")
    g.add_argument("--internal-tls-ca", default=None, help="mTLS: CA the peers' certificates chain to")


def internal_auth_from_args(a: argparse.Namespace) -> InternalAuth:
    """The secret comes from --internal-secret-file, else SPLITSERVE_INTERNAL_SECRET; without
    one the process refuses to start unless --insecure-internal (raises AuthConfigError)."""
    secret = read_secret_file(a.internal_secret_file) if a.internal_secret_file else None
    if secret is None:
        secret = os.environ.get(ENV_SECRET) or None
    if secret is None and not a.insecure_internal:
        raise AuthConfigError("no internal secret: give --internal-secret-file (the same file on "
                              f"every service), set {ENV_SECRET}, or --insecure-internal on a "
                              "trusted network")
    tls_flags = (a.internal_tls_cert, a.internal_tls_key, a.internal_tls_ca)
    tls = None
    if any(tls_flags):
        if not all(tls_flags):
            raise AuthConfigError("--internal-tls-cert, --internal-tls-key and --internal-tls-ca go together")
        tls = TlsFiles.load(*tls_flags)
    return InternalAuth(secret=secret, tls=tls)
