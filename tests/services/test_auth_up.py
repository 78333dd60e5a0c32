"""`splitserve up` runs its three services on a random internal secret it passes in their
environment, never on a command line (`ps` shows those): its decode refuses an
unauthenticated Reserve while requests through the gateway are served. Its --prefill-arg /
--decode-arg flags reach that service only."""
from __future__ import annotations

import json
import re
import urllib.request

import grpc
import psutil
import pytest

from common.auth import ENV_SECRET
from protos import decode_pb2, decode_pb2_grpc
from tests import harness

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


async def test_up_passes_a_secret_not_on_the_command_line():
    own = {"prefill": "--kv-chunk-bytes=1048576", "decode": "--prefill-yield-ratio=0.5"}
    with harness.splitserve_up([*harness.UP_PORTS, *harness.TINY_CPU, f"--prefill-arg={own['prefill']}",
                                f"--decode-arg={own['decode']}"]) as up:
        kids = psutil.Process(up.popen.pid).children()
        assert len(kids) == 3
        for k in kids:
            line = k.cmdline()
            for svc, flag in own.items():
                assert (flag in line) == (f"{svc}_svc" in line), (svc, line)
        secrets = {k.environ().get(ENV_SECRET) for k in kids}
        assert len(secrets) == 1 and len(next(iter(secrets)) or "") >= 32, "one secret for all three"
        secret = secrets.pop()
        for k in kids:
            assert not any(secret in a for a in k.cmdline()), k.cmdline()
        decode = re.search(r"decode\s+(\S+:\d+)", up.log()).group(1)
        async with grpc.aio.insecure_channel(decode) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await decode_pb2_grpc.DecodeStub(ch).Reserve(
                    decode_pb2.ReserveRequest(request_id="stranger", num_prompt_tokens=4), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        body = {"model": "dummy-tiny-llama", "prompt": "hi", "max_tokens": 3}
        req = urllib.request.Request(up.rest + "/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 3
