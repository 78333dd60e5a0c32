"""Credential configuration without processes: where the internal secret comes from, `up`'s
secret for its children, ticket signatures, API keys and the per-key limiter."""
from __future__ import annotations

import argparse
import os

import pytest

from common.auth import (ENV_SECRET, ENV_SECRET_FILE, AuthConfigError, InternalAuth, add_args,
                         internal_auth_from_args, sign_ticket, ticket_refusal, write_secret_file)
from gateway.auth import ANONYMOUS, KeyLimiter, PublicAuth, collect_keys
from protos import common_pb2
from splitserve_cli.up import internal_secret_env

SECRET = "0123456789abcdef-secret"


def _args(argv, monkeypatch, env=None):
    for k in (ENV_SECRET, ENV_SECRET_FILE, "SPLITSERVE_INSECURE_INTERNAL"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    add_args(p)
    return internal_auth_from_args(p.parse_args(argv))


def test_secret_sources(monkeypatch, tmp_path):
    with pytest.raises(AuthConfigError, match="no internal secret"):
        _args([], monkeypatch)
    assert not _args(["--insecure-internal"], monkeypatch).enabled
    assert _args([], monkeypatch, {ENV_SECRET: SECRET}).secret == SECRET
    f = str(tmp_path / "s")
    write_secret_file(f, SECRET)
    assert oct(os.stat(f).st_mode & 0o777) == "0o600"
    # the file wins over the environment, and over --insecure-internal
    assert _args(["--internal-secret-file", f, "--insecure-internal"], monkeypatch,
                 {ENV_SECRET: "x" * 20}).secret == SECRET
    with pytest.raises(AuthConfigError, match=">= 16"):
        _args([], monkeypatch, {ENV_SECRET: "short"})
    with pytest.raises(AuthConfigError, match="go together"):
        _args(["--insecure-internal", "--internal-tls-cert", f], monkeypatch)


def test_up_secret_for_its_children(tmp_path):
    a, b = internal_secret_env(None), internal_secret_env(None)
    assert a[ENV_SECRET] != b[ENV_SECRET] and len(a[ENV_SECRET]) == 64  # fresh per run
    f = tmp_path / "s"
    write_secret_file(str(f), SECRET)
    assert internal_secret_env(str(f)) == {ENV_SECRET_FILE: str(f)}
    os.chmod(f, 0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        internal_secret_env(str(f))


def test_ticket_signature_covers_every_field():
    auth = InternalAuth(secret=SECRET)
    t = common_pb2.TransferTicket(transfer_id="t1", decode_address="10.0.0.1:50071", block_ids=[1, 2],
                                  block_size=16, num_tokens=20, expires_unix_ms=10_000,
                                  kv_backends=["grpc"])
    sign_ticket(auth, t, "r1")
    assert ticket_refusal(auth, t, "r1", 9_000) is None
    assert "expired" in ticket_refusal(auth, t, "r1", 20_000)
    assert ticket_refusal(auth, t, "r2", 9_000) is not None
    assert ticket_refusal(InternalAuth(secret="another-" + SECRET), t, "r1", 9_000) is not None
    for change in (lambda x: setattr(x, "decode_address", "evil:1"), lambda x: x.block_ids.append(3),
                   lambda x: setattr(x.pair, "store_address", "evil:2"),
                   lambda x: setattr(x, "expires_unix_ms", 10**12)):
        u = common_pb2.TransferTicket()
        u.CopyFrom(t)
        change(u)
        assert ticket_refusal(auth, u, "r1", 9_000) is not None
    assert ticket_refusal(None, common_pb2.TransferTicket(), "r1", 0) is None  # insecure plane


def test_api_keys_and_limiter(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_API_KEY", "env-key-123456, env-key-654321")
    f = tmp_path / "keys"
    f.write_text("# comment\n\nfile-key-123456\n")
    keys = collect_keys(["flag-key-123456"], str(f))
    assert keys == ("flag-key-123456", "file-key-123456", "env-key-123456", "env-key-654321")
    with pytest.raises(ValueError, match=">= 8"):
        collect_keys(["short"], None)
    front = PublicAuth.create(keys)
    assert front.key_id("Bearer file-key-123456") == front.key_id("bearer  file-key-123456 ")
    for bad in (None, "", "Bearer", "Bearer nope", "Basic file-key-123456", "file-key-123456"):
        assert front.key_id(bad) is None
    assert PublicAuth.create().key_id(None) == ANONYMOUS  # no keys: everyone is anonymous
    lim = KeyLimiter(2)
    assert lim.acquire("a") and lim.acquire("a") and not lim.acquire("a") and lim.acquire("b")
    lim.release("a")
    assert lim.acquire("a")
    with pytest.raises(ValueError, match="go together"):
        PublicAuth.create(keys, tls_cert="c.pem")
