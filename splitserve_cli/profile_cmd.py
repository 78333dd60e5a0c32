"""`splitserve profile --service decode --steps N`: a torch.profiler trace of the next N engine
steps of a running prefill or decode service (started with --profile-dir DIR; `splitserve up
--profile-dir DIR` passes it to both; give `up --internal-secret-file F` and pass the same F
here, as every internal RPC needs the secret). The service writes the Chrome trace into its DIR and
this prints the path; open it in chrome://tracing or https://ui.perfetto.dev.

For nsys: services on CUDA mark every engine step with an NVTX range (`engine.step N`):
`nsys profile -t cuda,nvtx python -m decode_svc ...`.
"""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_ADDRESS = {"prefill": "127.0.0.1:50061", "decode": "127.0.0.1:50071"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--service", choices=sorted(DEFAULT_ADDRESS), default="decode",
                   help="which service to profile (default decode)")
    p.add_argument("--address", default=None,
                   help="its gRPC address (default: prefill 127.0.0.1:50061, decode 127.0.0.1:50071)")
    p.add_argument("--steps", type=int, default=10, help="engine steps to record (default 10)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="stop after this many seconds with the steps recorded so far (default 60)")
    p.add_argument("--internal-secret-file", default=os.environ.get("SPLITSERVE_INTERNAL_SECRET_FILE"),
                   help="the services' internal secret (the file given to `up --internal-secret-file`; "
                        "else SPLITSERVE_INTERNAL_SECRET; none: sent without)")


def run(a: argparse.Namespace) -> int:
    import grpc

    from common.trace_profile import call_profile

    if not 1 <= a.steps <= 10000:
        print(f"splitserve profile: --steps must be in [1, 10000], got {a.steps}", file=sys.stderr)
        return 2
    if not 0 < a.timeout <= 3600:
        print(f"splitserve profile: --timeout must be in (0, 3600], got {a.timeout}", file=sys.stderr)
        return 2
    from common.auth import ENV_SECRET, AuthConfigError, InternalAuth, read_secret_file

    try:
        secret = (read_secret_file(a.internal_secret_file) if a.internal_secret_file
                  else os.environ.get(ENV_SECRET) or None)
        metadata = InternalAuth(secret=secret).metadata()
    except AuthConfigError as e:
        print(f"splitserve profile: {e}", file=sys.stderr)
        return 2
    address = a.address or DEFAULT_ADDRESS[a.service]
    try:
        got = call_profile(address, a.steps, a.timeout, metadata)
    except grpc.RpcError as e:
        print(f"splitserve profile: {a.service} at {address}: {e.code().name}: {e.details()}",
              file=sys.stderr)
        return 1
    print(f"{got['path']}  ({got['steps']} steps in {got['wall_s']:.3f} s)")
    return 0
