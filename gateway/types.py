"""The gateway's internal request/response types, shared by the gRPC and REST fronts.
Protobuf / JSON are converted to these at the edges (grpc_server.py, openai_api.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from engine.sampling_params import SamplingParams

FINISH_NAMES = {1: "stop", 2: "length", 3: "abort", 4: "error"}  # splitserve.v1.FinishReason


class GatewayError(Exception):
    """An error with a gRPC status; the REST bridge maps it to HTTP (HTTP_STATUS)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param  # the offending request field, when known

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
}


@dataclass
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    priority: int = 0
    want_text: bool = True
    operation: str = "text_completion"  # or "chat" (span attribute only)
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class GenChunk:
    """One step of a response stream: new tokens (one or more) and their text delta.
    The last chunk has finish_reason, usage and timings."""
    token_ids: list[int]
    text: str = ""
    logprobs: list = field(default_factory=list)  # splitserve.v1.TokenLogprob per token, if asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str = ""
    usage: dict | None = None  # prompt_tokens, completion_tokens, cached_tokens
    timings: dict | None = None  # ttft_ms, queue_ms, prefill_ms, transfer_ms, total_ms (+ prediction_timings)


def merge_chunks(items: list) -> list:
    """A stream's queued items with each run of chunks folded into as few as carry the same
    content: a plain chunk (tokens and text only) merges into the chunk after it, which keeps
    its own end, usage and timings; a chunk with timings (the first token's) or an end stays
    whole, and anything that is not a GenChunk (an error, the end marker) is passed as is."""
    out: list = []
    for it in items:
        prev = out[-1] if out else None
        if (type(it) is GenChunk and type(prev) is GenChunk and prev.finish_reason is None
                and prev.usage is None and prev.timings is None):
            out[-1] = GenChunk(prev.token_ids + it.token_ids, prev.text + it.text,
                               prev.logprobs + it.logprobs, it.finish_reason, it.stop_reason,
                               it.usage, it.timings)
        else:
            out.append(it)
    return out


def prediction_timings(pred, admitted_s: float) -> dict:
    """Admission's calibrated estimates (before headroom) for a request's timings: compare
    predicted_ttft_ms with ttft_ms - admitted_ms (both from the admit decision)."""
    t = pred.est_ttft_ms if pred.est_ttft_ms is not None else pred.ttft_ms
    p = pred.est_tpot_ms if pred.est_tpot_ms is not None else pred.tpot_ms
    raw = pred.raw_ttft_ms if pred.raw_ttft_ms is not None else pred.ttft_ms
    # the model's parts (queue = raw - idle) let a benchmark say which one missed; the steps
    # ahead and the fit's estimate let lab/admission_replay.py replay the TTFT fit
    out = {"predicted_ttft_ms": t, "predicted_tpot_ms": p, "admitted_ms": admitted_s * 1e3,
           "predicted_raw_ttft_ms": raw, "predicted_idle_ttft_ms": pred.idle_ttft_ms,
           "predicted_ttft_bucket": pred.ttft_bucket,
           "predicted_fit_ttft_ms": pred.fit_ttft_ms or 0.0,
           "predicted_cached_tokens": pred.cached_tokens,
           "predicted_decode_batch": pred.decode_batch}
    a = pred.ahead
    if a is not None:
        out.update(ahead_running_tokens=a.running_tokens, ahead_queued_tokens=a.queued_tokens,
                   ahead_elapsed_ms=a.elapsed_ms, ahead_tokens_per_s=a.tokens_per_ms * 1e3)
    return out
