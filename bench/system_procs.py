"""Reaching a running `splitserve up` from a benchmark: free ports, its banner's URLs and
/health (wait_up), its metrics scraped (KV transfer deltas), a clean stop, ModelInfo."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MODEL_LABEL = re.compile(r'model_name="(?:[^"\\]|\\.)*",?')


def strip_model_name(text: str) -> str:
    """Prometheus text without the model_name label every series carries (one model served)."""
    return _MODEL_LABEL.sub("", text).replace(",}", "}").replace("{}", "")


def scrape_metrics(url: str, name: str) -> dict[str, float]:
    """The Prometheus text at url/metrics -> {'name{labels}': value} for the series whose name
    starts with a match of the regex `name` (model_name label left out)."""
    text = strip_model_name(urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5).read().decode())
    out = {}
    for ln in text.splitlines():
        m = re.match(rf"^((?:{name})\S*)\s+(\S+)$", ln)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def scrape(port: int) -> dict[str, float]:
    """A service's KV transfer series."""
    return scrape_metrics(f"http://127.0.0.1:{port}", "splitserve_kv_transfer")


def kv_delta(before: dict, after: dict, requests: int) -> dict:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    sent = d.get('splitserve_kv_transfer_bytes_total{direction="send"}', 0.0)
    backends = {re.search(r'backend="([^"]*)"', k).group(1): int(v) for k, v in d.items()
                if k.startswith("splitserve_kv_transfers_total{") and v > 0}
    n = sum(backends.values()) or requests
    out = {"bytes_per_request": sent / n, "bytes_total": sent, "transfers_by_backend": backends,
           "backend": ",".join(sorted(backends))}
    for side in ("send", "recv"):  # prefill: first token -> decode's ack; decode: bytes -> done
        cnt = d.get(f'splitserve_kv_transfer_seconds_count{{direction="{side}"}}', 0.0)
        if cnt > 0:
            out[f"{side}_ms_mean"] = d[f'splitserve_kv_transfer_seconds_sum{{direction="{side}"}}'] / cnt * 1e3
    return out


def log_reason(text: str) -> str:
    """The line of `up`'s log that says why it failed: the last exception, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)]
    return (errs or lines or ["(no output)"])[-1][:300]


def wait_up(up, log_path: str, timeout_s: float, ssl_context=None) -> tuple[str, str]:
    """-> (REST base URL, gRPC address) once `up` printed them and /health answers 200
    (ssl_context: how to trust an https front)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = open(log_path).read()
        if "is up" in text:
            break
        if up.poll() is not None:
            raise RuntimeError(f"`up` exited with {up.returncode}: {log_reason(text)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"`up` not up after {timeout_s:.0f} s: {log_reason(text)}")
        time.sleep(0.25)
    rest = re.search(r"REST \(OpenAI\)\s+(https?://\S+)/v1", text).group(1)
    grpc_addr = re.search(r"gRPC\s+(\S+:\d+)", text).group(1)
    while True:  # the gateway answers 503 until it has seen both services healthy
        try:
            if urllib.request.urlopen(rest + "/health", timeout=5, context=ssl_context).status == 200:
                return rest, grpc_addr
        except OSError as ex:  # HTTPError (503) and connection errors
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway {rest}/health: {ex}") from None
        time.sleep(0.25)


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (as Ctrl-C stops `up`: each child gets its turn), SIGKILL after grace_s; nothing
    if it has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def model_info(grpc_addr: str):
    import grpc

    from protos import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(grpc_addr) as ch:
        return generate_pb2_grpc.GenerationStub(ch).ModelInfo(generate_pb2.ModelInfoRequest(),
                                                              timeout=30)
