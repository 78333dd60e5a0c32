"""The public front with API keys, TLS and a per-key concurrency limit, on the three real
processes (their internal plane on a shared secret): REST without / with a wrong key -> 401
with an OpenAI-style error, gRPC -> UNAUTHENTICATED; /health, /metrics and gRPC health open;
TLS on both ports with a self-signed certificate made here; a key over its limit -> 429 /
RESOURCE_EXHAUSTED while another key is served; `splitserve up` with a key and TLS prints the
served model name and an https URL in its banner."""
from __future__ import annotations

import asyncio
import re
import ssl
import subprocess
import sys

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import write_secret_file
from protos import generate_pb2, generate_pb2_grpc
from tests import harness
from tests.tls_util import self_signed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
KEYS = ("key-alpha-0123456789", "key-beta-0123456789")
MODEL = "dummy-tiny-llama"


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    d = tmp_path_factory.mktemp("front")
    cert, key = self_signed(d)
    secret = str(d / "secret")
    write_secret_file(secret, "internal-" + "z" * 40)
    keyfile = d / "keys"
    keyfile.write_text(f"# one per line\n{KEYS[1]}\n")
    internal = ["--internal-secret-file", secret]
    s = harness.start_stack([*harness.TINY_CPU, *internal], gateway_args=[
        *internal, "--api-key", KEYS[0], "--api-key-file", str(keyfile), "--tls-cert", cert,
        "--tls-key", key, "--max-concurrency-per-key", "1"])
    yield s, cert
    s.stop()


def _trust(cert: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert)


def _url(s) -> str:
    return s.http_url.replace("http://", "https://")


def _body(n=4) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": n, "temperature": 0}


async def test_rest_needs_a_key_over_tls(front):
    s, cert = front
    async with httpx.AsyncClient(base_url=_url(s), verify=_trust(cert), timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong-key-0000"}, {"Authorization": KEYS[0]}):
            r = await c.post("/v1/completions", json=_body(), headers=headers)
            assert r.status_code == 401, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/health")).status_code == 200  # load balancers / scrapers: open
        assert (await c.get("/metrics")).status_code == 200
        for k in KEYS:  # a --api-key and a key from --api-key-file
            r = await c.post("/v1/completions", json=_body(), headers={"Authorization": f"Bearer {k}"})
            assert r.status_code == 200, r.text
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is not served
        httpx.get(s.http_url + "/health", timeout=5)
    async with httpx.AsyncClient(verify=_trust(cert)) as http:
        oc = openai.AsyncOpenAI(base_url=_url(s) + "/v1", api_key=KEYS[0], http_client=http)
        out = await oc.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            await oc.with_options(api_key="wrong-key-0000").completions.create(
                model=MODEL, prompt="hi", max_tokens=3)


async def test_grpc_needs_a_key_over_tls(front):
    s, cert = front
    creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
    async with grpc.aio.secure_channel(s.grpc_address, creds) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[3, 4, 5]), max_tokens=3,
                                           ignore_eos=True)
        for md in ((), (("authorization", "Bearer wrong-key-0000"),)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ModelInfo(generate_pb2.ModelInfoRequest(), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(req, metadata=md, timeout=10):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        md = (("authorization", f"Bearer {KEYS[1]}"),)
        info = await stub.ModelInfo(generate_pb2.ModelInfoRequest(), metadata=md, timeout=10)
        assert info.model == MODEL
        n = sum([len(m.token_ids) async for m in stub.Generate(req, metadata=md, timeout=30)])
        assert n == 3

        async def generate(n_tokens: int) -> grpc.StatusCode:
            long = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[3, 4, 5]),
                                                max_tokens=n_tokens, ignore_eos=True)
            try:
                async for _ in stub.Generate(long, metadata=md, timeout=60):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK
        codes = set(await asyncio.gather(*(generate(200) for _ in range(6))))
        assert codes == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes


def test_cli_client_with_a_key_over_tls(front):
    s, cert = front
    r = subprocess.run([sys.executable, "-m", "splitserve_cli", "generate", "hello", "--server",
                        s.grpc_address, "--tls-ca", cert, "--api-key", KEYS[0], "--max-tokens", "3",
                        "--stats"], cwd=harness.ROOT, env=harness.child_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "3 completion tokens" in r.stderr, r.stderr


async def test_concurrency_per_key(front):
    s, cert = front
    auth = [{"Authorization": f"Bearer {k}"} for k in KEYS]
    async with httpx.AsyncClient(base_url=_url(s), verify=_trust(cert), timeout=60) as c:
        await c.post("/v1/completions", json=_body(), headers=auth[0])  # a warm connection
        long = {**_body(200), "ignore_eos": True}
        many = [c.post("/v1/completions", json=long, headers=auth[0]) for _ in range(6)]
        other = c.post("/v1/completions", json=long, headers=auth[1])
        *rs, r_other = await asyncio.gather(*many, other)
        codes = sorted(r.status_code for r in rs)
        assert codes[0] == 200 and codes[-1] == 429, codes  # one runs, the key's others wait out
        busy = next(r for r in rs if r.status_code == 429)
        assert busy.json()["error"]["code"] == "rate_limit_exceeded" and busy.headers["retry-after"]
        assert r_other.status_code == 200, r_other.text  # another key is not limited by it
        r = await c.post("/v1/completions", json=_body(), headers=auth[0])
        assert r.status_code == 200, r.text  # the slot is given back once a request is over


def test_up_banner_with_a_key_and_tls(tmp_path):
    cert, key = self_signed(tmp_path)
    env = {**harness.child_env(), "SPLITSERVE_API_KEY": KEYS[0]}
    with harness.splitserve_up([*harness.UP_PORTS, *harness.TINY_CPU, f"--gateway-arg=--tls-cert={cert}",
                                f"--gateway-arg=--tls-key={key}"], env=env,
                               ssl_context=_trust(cert)) as up:
        text = up.log()
        assert re.search(rf"model name\s+{MODEL}\s", text), text  # asked with the key over TLS
        assert re.search(r"REST \(OpenAI\)\s+https://127\.0\.0\.1:\d+/v1", text), text
        r = httpx.get(up.rest + "/v1/models", verify=_trust(cert), timeout=10,
                      headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, r.text
