"""The `splitserve` command (also `python -m splitserve_cli`).

    splitserve up [engine flags...]          prefill + decode + gateway, embedded default model
    splitserve gateway|prefill|decode ...    one service (same flags as python -m <service>)
    splitserve generate "prompt"             stream a completion over gRPC
    splitserve chat                          interactive chat over gRPC
    splitserve bench [--rate R ...]          serving benchmark against a running server
    splitserve tokenizer export [DIR]        the served model's tokenizer as a HF tokenizer dir
    splitserve trace serve|show|top          request traces: receiver, waterfall, slowest
    splitserve profile --service decode      torch.profiler trace of a running service's steps
    splitserve plan --rate R --ttft-ms X --tpot-ms Y   prefill / decode replicas a load needs
"""
from __future__ import annotations

import argparse
import os
import sys

SERVICES = {"gateway": "gateway", "prefill": "prefill_svc", "decode": "decode_svc"}


def _exec_service(module: str, args: list[str]) -> int:
    """Replace this process with `python -m <module> args` (signals go straight to it)."""
    argv = [sys.executable, "-m", module, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover - execv does not return


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICES:
        return _exec_service(SERVICES[argv[0]], argv[1:])
    if argv and argv[0] == "bench":
        from splitserve_cli import bench

        return bench.run(argv[1:])
    p = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    from splitserve_cli import client, plan, profile_cmd, tokenizer_cmd, trace_cmd, up

    up.add_args(sub.add_parser("up", help="run prefill, decode and gateway together "
                               "(unknown flags are forwarded to prefill and decode)"))
    for name in SERVICES:
        sub.add_parser(name, help=f"run the {name} service alone")
    client.add_args(sub.add_parser("generate", help="stream one completion over gRPC"), chat=False)
    client.add_args(sub.add_parser("chat", help="interactive chat over gRPC"), chat=True)
    sub.add_parser("bench", help="serving benchmark (bench/serve.py; `splitserve bench --help`)")
    tokenizer_cmd.add_args(sub.add_parser("tokenizer", help="export the served model's tokenizer "
                                          "(HF tokenizer directory for tools)"))
    trace_cmd.add_args(sub.add_parser("trace", help="request traces: OTLP receiver, waterfall, "
                                      "slowest requests"))
    profile_cmd.add_args(sub.add_parser("profile", help="record a torch.profiler trace of the next "
                                        "N engine steps of a running service"))
    plan.add_args(sub.add_parser("plan", help="prefill / decode replicas a load needs for its SLOs "
                                 "(queueing model on measured step times)"))
    a, extra = p.parse_known_args(argv)
    if a.cmd == "up":
        return up.run_up(a, extra)
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.cmd == "tokenizer":
        return tokenizer_cmd.run(a)
    if a.cmd == "plan":
        return plan.run(a)
    if a.cmd == "trace":
        return trace_cmd.run(a)
    if a.cmd == "profile":
        return profile_cmd.run(a)
    return client.run_client(a, chat=a.cmd == "chat")


if __name__ == "__main__":
    sys.exit(main())
