"""GatewayConfig: one frozen config built once in main() from flags (SPLITSERVE_* env defaults)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from common.auth import InternalAuth
from common.auth import add_args as add_internal_auth_args
from common.auth import internal_auth_from_args
from common.envs import env_float, env_int, env_str
from gateway.admission import TTFT_MODELS, AdmissionConfig

DEFAULT_PREFILL = "127.0.0.1:50061"
DEFAULT_DECODE = "127.0.0.1:50071"


PREFILL_ON_DECODE = ("never", "auto", "always")
DECODE_STREAMS = ("many", "per-request")
RESERVE_OVERLAP = ("auto", "off")
MAX_TOKENS_OVER_CONTEXT = ("error", "cap")


@dataclass(frozen=True)
class GatewayConfig:
    model: str = "default"  # only the tokenizer / shape is loaded here, never the weights
    served_model_name: str | None = None
    max_model_len: int | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000  # -1 disables the REST bridge
    prefill: tuple[str, ...] = (DEFAULT_PREFILL,)
    decode: tuple[str, ...] = (DEFAULT_DECODE,)
    poll_interval_s: float = 0.5
    default_max_tokens: int | None = None  # None: until an end token or the end of the context
    max_body_bytes: int = 1 << 20  # REST body; also gRPC prompt / chat / Tokenize text
    grpc_max_streams_per_connection: int = 1024  # public gRPC: calls at once on one connection
    max_tokens_over_context: str = "error"  # max_tokens beyond the context: error (400) | cap
    transfer_timeout_ms: int = 30000
    prefill_on_decode: str = "never"  # never | auto (decode and prefill share a GPU) | always
    decode_streams: str = "many"  # many: one DecodeMany call per decode replica | per-request
    reserve_overlap: str = "auto"  # auto: decode.Reserve during the prompt on pool pairs | off
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    log_level: str | None = None
    ready_file: str | None = None
    # credentials of the internal plane (channels to prefill / decode); None: insecure
    internal_auth: InternalAuth | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: the public front is open
    tls_cert: str | None = None  # REST and public gRPC over TLS (with tls_key)
    tls_key: str | None = None
    max_concurrency_per_key: int | None = None
    drain_timeout_s: float = 30.0  # SIGTERM: running requests may finish for this long
    # bind both public ports with SO_REUSEPORT: several gateway workers share them and the
    # kernel spreads new connections across them (`splitserve up --gateway-workers N`)
    reuse_port: bool = False
    # gateway workers: this one's index among `workers`, and the file where each publishes its
    # in-flight prompts per replica for the others' TTFT model (gateway/clock_board.py)
    workers: int = 1
    worker_index: int = 0
    worker_board: str | None = None

    def __post_init__(self):
        if self.prefill_on_decode not in PREFILL_ON_DECODE:
            raise ValueError(f"prefill_on_decode must be one of {PREFILL_ON_DECODE}, "
                             f"got {self.prefill_on_decode!r}")
        if self.decode_streams not in DECODE_STREAMS:
            raise ValueError(f"decode_streams must be one of {DECODE_STREAMS}, got {self.decode_streams!r}")
        if self.reserve_overlap not in RESERVE_OVERLAP:
            raise ValueError(f"reserve_overlap must be one of {RESERVE_OVERLAP}, got {self.reserve_overlap!r}")
        if not 0 <= self.worker_index < self.workers:
            raise ValueError(f"--worker-index {self.worker_index} outside 0..{self.workers - 1} "
                             f"(--workers {self.workers})")
        if not self.prefill or not self.decode:
            raise ValueError("need at least one prefill and one decode address")
        for a in (*self.prefill, *self.decode):
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"replica address {a!r} must be host:port")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.grpc_max_streams_per_connection < 1:
            raise ValueError("--grpc-max-streams-per-connection must be >= 1, got "
                             f"{self.grpc_max_streams_per_connection}")
        if self.max_tokens_over_context not in MAX_TOKENS_OVER_CONTEXT:
            raise ValueError(f"max_tokens_over_context must be one of {MAX_TOKENS_OVER_CONTEXT}")
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be > 0")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")


def _addrs(v: list[str] | None, default: str) -> tuple[str, ...]:
    out = []
    for item in v or [default]:
        out += [x.strip() for x in item.split(",") if x.strip()]
    return tuple(out)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env_str("SPLITSERVE_MODEL", "default"),
                   help="same model spec as the services (only its tokenizer is loaded here)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send as \"model\" (default: the model's own name: "
                        "SmolLM2-135M-Instruct for 'default', the HF directory's or .gguf file's "
                        "name, dummy-<shape>)")
    p.add_argument("--max-model-len", type=int, default=env_int("SPLITSERVE_MAX_MODEL_LEN"))
    p.add_argument("--host", default=env_str("SPLITSERVE_HOST", "127.0.0.1"))
    p.add_argument("--port", "--grpc-port", dest="grpc_port", type=int, default=50051,
                   help="public gRPC port (0 picks a free one)")
    p.add_argument("--http-port", type=int, default=8000, help="REST port (0 free one, -1 off)")
    p.add_argument("--prefill", action="append", default=None,
                   help=f"prefill replica host:port (repeat or comma-separate; default {DEFAULT_PREFILL})")
    p.add_argument("--decode", action="append", default=None,
                   help=f"decode replica host:port (repeat or comma-separate; default {DEFAULT_DECODE})")
    p.add_argument("--poll-interval", type=float, default=0.5, help="Load poll period, seconds")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of requests that give none (default: until an end token or "
                        "the end of the context, as vLLM)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest REST body, and largest gRPC prompt / chat / Tokenize text")
    p.add_argument("--max-tokens-over-context", choices=MAX_TOKENS_OVER_CONTEXT, default="error",
                   help="a request whose prompt + max_tokens exceeds the context: error (400 / "
                        "INVALID_ARGUMENT, as vLLM; default) or cap max_tokens to what fits")
    p.add_argument("--default-ttft-ms", type=float, default=env_float("SPLITSERVE_DEFAULT_TTFT_MS"),
                   help="TTFT SLO for requests that give none (default: none)")
    p.add_argument("--default-tpot-ms", type=float, default=env_float("SPLITSERVE_DEFAULT_TPOT_MS"))
    p.add_argument("--max-queue-ms", type=float, default=30000.0,
                   help="longest a request may wait in admission")
    p.add_argument("--prefill-tokens-per-s", type=float, default=2000.0,
                   help="prefill rate prior until measured")
    p.add_argument("--slo-attainment", type=float, default=0.95,
                   help="share of admitted requests admission budgets to meet their SLO: the "
                   "quantile of recent observed / predicted ratios added as headroom")
    p.add_argument("--admission-guard", choices=("on", "off", "auto"),
                   default=env_str("SPLITSERVE_ADMISSION_GUARD", "auto"),
                   help="closed loop on the admitted requests' measured SLO misses: scales "
                        "admission's loaded predictions until the miss rate is what "
                        "--slo-attainment allows (off: models, calibration and headroom alone; "
                        "auto: on for decode replicas on a GPU, where it held attainment above "
                        "the target at 2x overload; on CPU it cost goodput)")
    p.add_argument("--admission-ttft-model", choices=TTFT_MODELS,
                   default=env_str("SPLITSERVE_ADMISSION_TTFT_MODEL", "fit"),
                   help="admission's TTFT estimate: fit (a fit of observed TTFT against the "
                        "prefill steps ahead, once it has outcomes; the queue model until then) "
                        "or queue (prompt tokens ahead / prefill rate, corrected per load bucket)")
    p.add_argument("--log-level", default=None)
    p.add_argument("--prefill-on-decode", choices=PREFILL_ON_DECODE,
                   default=env_str("SPLITSERVE_PREFILL_ON_DECODE", "never"),
                   help="prefill on the decode replica itself: never (default: always split), "
                        "auto (when the prefill replica shares its GPU), always. Measured on one "
                        "H200 (bench.pd_system): auto gains ~6%% tokens/s at 64 clients but loses "
                        "short-prompt TTFT and ITL p99")
    p.add_argument("--decode-streams", choices=DECODE_STREAMS,
                   default=env_str("SPLITSERVE_DECODE_STREAMS", "many"),
                   help="how token streams come from decode: many (default: one DecodeMany call "
                        "per decode replica, one message a step for all its requests) or "
                        "per-request (one Decode call each; a decode replica without DecodeMany gets "
                        "that by itself)")
    p.add_argument("--reserve-overlap", choices=RESERVE_OVERLAP,
                   default=env_str("SPLITSERVE_RESERVE_OVERLAP", "auto"),
                   help="auto (default): once a prefill replica has handed KV to a decode replica "
                        "through a shared pool (vmm / shm), its prompts start before decode's "
                        "reservation, which follows by Prefill.Ticket: the Reserve round trip "
                        "(a decode step under load) leaves the TTFT; off: reserve, then prefill")
    p.add_argument("--drain-timeout-s", type=float, default=env_float("SPLITSERVE_DRAIN_TIMEOUT_S", 30.0),
                   help="on SIGTERM / SIGINT: refuse new requests, let running ones finish for up "
                        "to this long, then exit")
    p.add_argument("--ready-file", default=None,
                   help="write 'grpc_port http_port' here once serving")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind the gRPC and REST ports with SO_REUSEPORT so that several gateway "
                        "processes share them (the kernel spreads connections; `splitserve up "
                        "--gateway-workers N` sets it); the ports are not bind-tested first")
    p.add_argument("--workers", type=int, default=1,
                   help="gateway workers sharing the ports (set by `splitserve up`; with "
                        "--worker-board)")
    p.add_argument("--worker-index", type=int, default=0, help="this worker's index (0..workers-1)")
    p.add_argument("--worker-board", default=None,
                   help="file the workers share their in-flight prompts through (each its own "
                        "slot), so each admission's TTFT model sees every worker's prompts")
    g = p.add_argument_group("public front")
    g.add_argument("--api-key", action="append", default=None,
                   help="accept this API key (repeat; also --api-key-file and SPLITSERVE_API_KEY, "
                        "comma-separated): REST needs 'Authorization: Bearer <key>', gRPC the "
                        "same as 'authorization' metadata; /health and /metrics stay open. NOTE: "
                        "a flag shows in `ps`; prefer the file or the variable")
    g.add_argument("--api-key-file", default=env_str("SPLITSERVE_API_KEY_FILE"),
                   help="file with one API key per line")
    g.add_argument("--tls-cert", default=env_str("SPLITSERVE_TLS_CERT"),
                   help="serve REST and gRPC over TLS with this certificate (PEM, with --tls-key)")
    g.add_argument("--tls-key", default=env_str("SPLITSERVE_TLS_KEY"))
    g.add_argument("--grpc-max-streams-per-connection", type=int,
                   default=env_int("SPLITSERVE_GRPC_MAX_STREAMS_PER_CONNECTION", 1024),
                   help="public gRPC: calls one connection may run at once (HTTP/2 "
                        "max_concurrent_streams, default 1024). A call over it may be refused "
                        "(UNAVAILABLE, safe to retry) rather than queued; raise it behind a proxy "
                        "that multiplexes many clients onto few connections")
    g.add_argument("--max-concurrency-per-key", type=int,
                   default=env_int("SPLITSERVE_MAX_CONCURRENCY_PER_KEY"),
                   help="running requests per API key (all callers together without keys); "
                        "more: 429 / RESOURCE_EXHAUSTED. Counted in this process: gateway workers "
                        "each count their own")
    add_internal_auth_args(p)


def config_from_args(a: argparse.Namespace) -> GatewayConfig:
    """The config of the gateway process; its ports are bind-tested here, before the tokenizer
    loads (raises common.grpc_util.PortInUseError, a ValueError, naming a busy one)."""
    from common.grpc_util import check_ports_free

    from gateway.auth import collect_keys

    if not a.reuse_port:  # NOTE: a worker joining its siblings finds its ports held by them
        check_ports_free(a.host, [("gateway gRPC", a.grpc_port), ("gateway REST", a.http_port)])
    return GatewayConfig(
        internal_auth=internal_auth_from_args(a), api_keys=collect_keys(a.api_key, a.api_key_file),
        tls_cert=a.tls_cert, tls_key=a.tls_key, max_concurrency_per_key=a.max_concurrency_per_key,
        model=a.model, served_model_name=a.served_model_name, max_model_len=a.max_model_len,
        host=a.host, grpc_port=a.grpc_port, http_port=a.http_port,
        prefill=_addrs(a.prefill, DEFAULT_PREFILL), decode=_addrs(a.decode, DEFAULT_DECODE),
        poll_interval_s=a.poll_interval, default_max_tokens=a.default_max_tokens,
        max_body_bytes=a.max_body_bytes, max_tokens_over_context=a.max_tokens_over_context,
        grpc_max_streams_per_connection=a.grpc_max_streams_per_connection,
        admission=AdmissionConfig(default_ttft_ms=a.default_ttft_ms, default_tpot_ms=a.default_tpot_ms,
                                  max_queue_ms=a.max_queue_ms,
                                  prefill_tokens_per_s=a.prefill_tokens_per_s,
                                  headroom_quantile=a.slo_attainment,
                                  guard=a.admission_guard, ttft_model=a.admission_ttft_model),
        prefill_on_decode=a.prefill_on_decode, decode_streams=a.decode_streams,
        reserve_overlap=a.reserve_overlap, log_level=a.log_level, ready_file=a.ready_file, drain_timeout_s=a.drain_timeout_s,
        reuse_port=a.reuse_port, workers=a.workers, worker_index=a.worker_index,
        worker_board=a.worker_board)
