"""`splitserve up --topology`: how the engines share the machine.

- `split`: prefill and decode engines each run their own work (the disaggregated design); on
  CPU each gets half the cores (common/service_args.py), as two OpenMP pools on one small host
  spin against each other.
- `colocated`: every prompt runs in the decode engine's own batches (the gateway's
  `--prefill-on-decode always`), and decode gets every core; the prefill service still starts
  (1 thread, idle) so the gateway's routing and `--prefill-on-decode never` work unchanged.
- `auto` (default): colocated on a machine without a GPU, split with one. On 2 CPU cores
  (bench/peer_cpu.py, SmolLM2-135M, 39-token prompts) colocated served 30 / 109 / 253 tokens/s
  at 1 / 8 / 32 streams against split's 19.6 / 70 / 152: decode alone is the busy engine and
  needs the whole machine.

Explicit flags win: `--cpu-threads` (forwarded to both engines) and
`--gateway-arg=--prefill-on-decode=...` come after the ones chosen here.
"""
from __future__ import annotations

import os

TOPOLOGIES = ("auto", "colocated", "split")


def usable_cores() -> int:
    """Cores this process may run on (a container's or taskset's affinity, not the host's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _given(flag: str, args: list[str]) -> bool:
    return any(x == flag or x.startswith(flag + "=") for x in args)


def flag_value(flag: str, args: list[str]) -> str | None:
    """The value argparse would take for FLAG (its last occurrence), or None."""
    out = None
    for i, x in enumerate(args):
        if x.startswith(flag + "="):
            out = x.split("=", 1)[1]
        elif x == flag and i + 1 < len(args):
            out = args[i + 1]
    return out


def _device_flag(engine_args: list[str]) -> str | None:
    return flag_value("--device", engine_args) or os.environ.get("SPLITSERVE_DEVICE")


def resolve(topology: str, engine_args: list[str], gpu_flags: bool, cuda_count) -> str:
    """auto -> colocated when the engines run on CPU, else split. cuda_count: a callable giving
    the GPUs torch sees (asked only when the device is not given)."""
    if topology != "auto":
        return topology
    if gpu_flags:
        return "split"
    device = _device_flag(engine_args) or "auto"
    if device == "cpu":
        return "colocated"
    if device.startswith("cuda"):
        return "split"
    return "colocated" if cuda_count() == 0 else "split"


def colocated_flags(engine_args: list[str], gateway_args: list[str], cores: int
                    ) -> tuple[dict[str, list[str]], list[str]]:
    """-> (extra engine flags per service, gateway flags) that colocate: decode on every core,
    prefill on one (it idles), the gateway prefilling on decode. A thread count the user gave
    (flag or SPLITSERVE_CPU_THREADS) is left to them."""
    extra: dict[str, list[str]] = {"prefill": [], "decode": []}
    if not _given("--cpu-threads", engine_args) and not os.environ.get("SPLITSERVE_CPU_THREADS"):
        extra["prefill"] += ["--cpu-threads", "1"]
        extra["decode"] += ["--cpu-threads", str(max(1, cores))]
    gw = [] if _given("--prefill-on-decode", gateway_args) else ["--prefill-on-decode", "always"]
    return extra, gw
