"""One Decode stream's state, output by output: its metrics, incremental detokenization and
stop strings, and the DecodeResponse of each engine output. Synchronous, so a stream can be
driven by its own task (StreamingMixin._stream) or from the step's one loop wake-up
(StreamingMixin._stream_batched: no task per request a step)."""
from __future__ import annotations

import time

import grpc

from common.convert import FINISH_REASONS, logprob_to_pb
from protos import decode_pb2, generate_pb2


class StreamAbort(Exception):
    """The stream ends with this gRPC status (raised to the Decode handler)."""

    def __init__(self, code: grpc.StatusCode, msg: str):
        super().__init__(msg)
        self.code = code


def is_plain(fields: tuple) -> bool:
    """fields (as `response` takes them) carry only tokens and the count: most steps."""
    _ids, text, lps, reason, stop, wait_ms, _n = fields
    return not (text or lps or reason or stop or wait_ms)


def response(ids, text, lps, reason, stop, wait_ms, n_gen) -> decode_pb2.DecodeResponse:
    if not (text or lps or reason or stop or wait_ms):  # a plain step: half the build cost
        return decode_pb2.DecodeResponse(token_ids=ids, num_generated=n_gen)
    return decode_pb2.DecodeResponse(
        token_ids=ids, text=text, logprobs=[x for x in lps if x is not None],
        finish_reason=FINISH_REASONS.get(reason, generate_pb2.FINISH_REASON_UNSPECIFIED),
        stop_reason=str(stop or ""), transfer_wait_ms=wait_ms, num_generated=n_gen)


class StreamState:
    """here: the prompt runs in this engine (prefill_here); else its KV is in place and
    request.first_token_id was sampled by prefill. `outcome` ends as the finish reason,
    "error", or "abort" (the stream ended before its request did)."""

    def __init__(self, svc, request, params, wait_ms: float, here: bool):
        self.svc, self.metrics, self.tally = svc, svc.metrics, svc.step_tally
        self.prompt = [int(x) for x in request.prompt_token_ids]
        self.first = None if here else int(request.first_token_id)
        tok = svc.engine.tokenizer
        self.detok = (tok.detokenizer(self.prompt, params)
                      if tok is not None and (request.detokenize or params.stop) else None)
        self.pending_text, self.first_stop = (self.detok.step([self.first])
                                              if self.detok is not None and self.first is not None
                                              else ("", None))
        self.text_out = bool(request.detokenize)
        self.wait_ms = wait_ms
        self.n_gen, self.t_last, self.first_msg, self.outcome = int(not here), time.perf_counter(), True, "abort"
        self.t_first = None if here else self.t_last  # decode time starts at the first token

    def stop_at_first(self) -> decode_pb2.DecodeResponse | None:
        """The whole answer if prefill's first token already completed a stop string."""
        if self.first_stop is None:
            return None
        self.outcome = "stop"
        return response([], self.pending_text if self.text_out else "", [], "stop", self.first_stop,
                        self.wait_ms, self.n_gen)

    def aborted(self) -> decode_pb2.DecodeResponse:
        return response([], "", [], "abort", "", 0.0, self.n_gen)

    def on_output(self, out) -> tuple[decode_pb2.DecodeResponse, bool]:
        """An engine output -> (its message, whether the stream ends with it). Raises
        RuntimeError for an engine error."""
        fields, done = self.fields(out)
        return response(*fields), done

    def fields(self, out) -> tuple[tuple, bool]:
        """As on_output, the message as `response`'s arguments (a batch builds it in place)."""
        if out.finish_reason == "error":
            self.outcome = "error"
            raise RuntimeError(out.error or "engine error")
        m = self.metrics
        now = time.perf_counter()
        if out.queue_s is not None:  # prefill_here: this engine queued and prefilled it
            m.queue_time.observe(out.queue_s)
            m.prefill_time.observe(out.prefill_s)
        n = len(out.new_token_ids)
        gap = None
        if self.t_first is None:
            self.t_first = now
        elif n:
            gap = now - self.t_last
        self.t_last = now
        self.n_gen += n
        self.svc._generated += n
        self.tally.add(gap, n)
        text, self.pending_text = self.pending_text, ""
        reason = out.finish_reason if out.finished else None
        stop = None
        if self.detok is not None:
            delta, stop = self.detok.step(out.new_token_ids) if n else ("", None)
            text += delta
            if stop is not None:
                reason = "stop"
            elif out.finished:
                text += self.detok.flush()
        lps = [logprob_to_pb(lp, t) for lp, t in zip(out.logprobs, out.new_token_ids)
               if lp is not None] if out.logprobs else []
        if reason is not None:
            # NOTE: counted before the message goes out: a caller that closes the stream on
            # reading the last message never resumes its reader, and this request did finish
            self.outcome = reason
            m.decode_time.observe(now - self.t_first)
        fields = (out.new_token_ids, text if self.text_out else "", lps, reason, stop or "",
                  self.wait_ms if self.first_msg else 0.0, self.n_gen)
        self.first_msg = False
        return fields, reason is not None

    def close(self) -> None:
        self.tally.flush()  # a finished request's per-token metrics are in before its outcome
        self.metrics.requests.labels(outcome=self.outcome).inc()
        if self.outcome != "error":
            self.metrics.request_generation_tokens.observe(self.n_gen)
