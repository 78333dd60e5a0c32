"""Internal plane with mutual TLS on top of the shared secret, and the dist backend's store,
on real prefill + decode processes: a request's KV moves over a gloo pair whose rendezvous
store listens on the service's host only; a client without a certificate of the deployment's
CA (even with the right secret) is not served."""
from __future__ import annotations


import grpc
import psutil
import pytest

from common.auth import InternalAuth, TlsFiles, write_secret_file
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2_grpc
from tests import harness
from tests.services.client import Client
from tests.tls_util import self_signed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(120)]

SECRET = "mtls-" + "q" * 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtls")
    cert, key = self_signed(d, "deployment")  # self-signed: its own CA
    secret = str(d / "secret")
    write_secret_file(secret, SECRET)
    flags = ["--internal-secret-file", secret, "--internal-tls-cert", cert, "--internal-tls-key", key,
             "--internal-tls-ca", cert, "--kv-transfer-backend", "dist"]
    with harness.service_pair(flags, flags) as pair:
        yield pair, d, (cert, key)


async def test_mtls_and_a_dist_pair_on_the_secret(setup):
    (pre, dec), d, (cert, key) = setup
    auth = InternalAuth(secret=SECRET, tls=TlsFiles.load(cert, key, cert))
    c = Client(pre.address, dec.address, auth)
    try:
        ticket, pre_resp, call = await c.start("mtls-1", list(range(3, 30)),
                                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert pre_resp.kv_backend == "dist"  # the pair met on the store under the secret's prefix
        assert sum([len(m.token_ids) async for m in call]) == 3
        port = int(ticket.pair.store_address.rpartition(":")[2])
        listening = [x.laddr.ip for x in psutil.net_connections("tcp")
                     if x.status == psutil.CONN_LISTEN and x.laddr.port == port]
        assert listening == ["127.0.0.1"], listening  # not every interface
    finally:
        await c.close()
    stranger = self_signed(d, "stranger")
    for creds in (InternalAuth(secret=SECRET),  # no TLS at all
                  InternalAuth(secret=SECRET, tls=TlsFiles.load(*stranger, cert))):  # foreign cert
        async with creds.channel(dec.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await decode_pb2_grpc.DecodeStub(ch).Load(common_pb2.LoadRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
