"""The fake prefill and decode services (tests/gateway/fakes.py) as one process of their own:
`python -m tests.gateway.fake_backends --ready-file F` writes "prefill_port decode_port" to F
once both serve. Its decode's Load reports the reservations and streams it holds (reserved,
running), so a test of a real gateway in front of it can check that nothing stays held."""
from __future__ import annotations

import argparse
import asyncio
import os

from protos import common_pb2
from tests.gateway.fakes import FakeDecode, FakePrefill, start_server


class CountingDecode(FakeDecode):
    async def Load(self, request, context):  # noqa: N802
        return common_pb2.LoadStats(running=len(self.running), reserved=len(self.reserved),
                                    num_total_blocks=100, num_free_blocks=100)


async def main(ready_file: str, step_s: float = 0.0) -> None:
    servers = []
    ports = []
    for s in (FakePrefill(), CountingDecode(step_s=step_s, eos=None)):
        srv, addr = await start_server(s)
        servers.append(srv)
        ports.append(addr.rsplit(":", 1)[1])
    with open(ready_file + ".tmp", "w") as f:
        f.write(" ".join(ports) + "\n")
    os.replace(ready_file + ".tmp", ready_file)
    await asyncio.Event().wait()  # until terminated


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ready-file", required=True)
    p.add_argument("--step-s", type=float, default=0.0, help="decode: seconds per token")
    a = p.parse_args()
    asyncio.run(main(a.ready_file, a.step_s))
