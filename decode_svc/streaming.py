"""The Decode stream of one request: the engine's stream read directly (outputs that queued
up while the reader was busy come merged into one message; Abort, another RPC, ends it at once
through AsyncEngine.interrupt), text detokenized incrementally, metrics observed.
DecodeServicer (decode_svc/servicer.py) inherits it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from common.convert import FINISH_REASONS, logprob_to_pb
from engine.sampling_params import InvalidRequestError
from protos import decode_pb2, generate_pb2

log = logging.getLogger("splitserve.decode")


class StreamingMixin:
    """Needs engine (AsyncEngine), metrics, _running, _callers and _generated (DecodeServicer)."""

    async def _stream(self, rid, request, params, wait_ms, here: bool = False):
        """Yield DecodeResponses, reading the engine's stream of the request directly (outputs
        that queued while this reader was busy come merged); Abort, another RPC, ends it at
        once through AsyncEngine.interrupt.
        here: the prompt runs in this engine (prefill_here); else its KV is in place and
        request.first_token_id was sampled by prefill."""
        prompt = [int(x) for x in request.prompt_token_ids]
        first = None if here else int(request.first_token_id)
        tok = self.engine.tokenizer
        detok = tok.detokenizer(prompt, params) if tok is not None and (request.detokenize or params.stop) else None
        pending_text, stop = detok.step([first]) if detok is not None and first is not None else ("", None)
        text_out = bool(request.detokenize)
        n_gen, t_last, first_msg, outcome = int(not here), time.perf_counter(), True, "abort"
        t_first = None if here else t_last  # the first token's time: decode time starts there
        outs, ended = None, False  # ended: the engine stream finished on its own
        try:
            if stop is not None:  # the first token already completed a stop string
                await self.engine.release(rid)
                outcome = "stop"
                yield self._msg([], pending_text if text_out else "", [], "stop", stop, wait_ms, n_gen)
                return
            # NOTE: blocks are ours since claim(); a join that fails frees them
            outs = (self.engine.generate(rid, prompt, params, merge=True) if here
                    else self.engine.stream_prefilled(rid, prompt, first, params, merge=True))
            self._running[rid] = (asyncio.current_task(), outs)
            pacer = getattr(self.engine, "pacer", None)  # decode_svc.pacing.StepPacer
            if pacer is not None:
                pacer.add_budget(rid, request.tpot_ms)
            while True:
                try:
                    out = await outs.__anext__()
                    ended = out is not _ABORTED and out.finished
                except StopAsyncIteration:
                    ended = True
                    raise RuntimeError("engine stream ended without a finished output") from None
                except InvalidRequestError as e:
                    ended, outcome = True, "error"
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                except Exception as e:  # noqa: BLE001 - the engine's failure, this request's error
                    ended, outcome = True, "error"
                    raise RuntimeError(str(e)) from e
                if out is _ABORTED:
                    yield self._msg([], "", [], "abort", "", 0.0, n_gen)
                    return
                if out.finish_reason == "error":
                    outcome = "error"
                    raise RuntimeError(out.error or "engine error")
                now = time.perf_counter()
                if out.queue_s is not None:  # prefill_here: this engine queued and prefilled it
                    self.metrics.queue_time.observe(out.queue_s)
                    self.metrics.prefill_time.observe(out.prefill_s)
                if t_first is None:
                    t_first = now
                elif out.new_token_ids:
                    self.metrics.itl.observe(now - t_last)
                t_last = now
                n_gen += len(out.new_token_ids)
                self._generated += len(out.new_token_ids)
                self.metrics.generation_tokens.inc(len(out.new_token_ids))
                text, pending_text = pending_text, ""
                reason = out.finish_reason if out.finished else None
                if detok is not None:
                    delta, stop = detok.step(out.new_token_ids) if out.new_token_ids else ("", None)
                    text += delta
                    if stop is not None:
                        reason = "stop"
                    elif out.finished:
                        text += detok.flush()
                lps = [logprob_to_pb(lp, t) for lp, t in zip(out.logprobs, out.new_token_ids)
                       if lp is not None] if out.logprobs else []
                if reason is not None:
                    # NOTE: before the yield: a caller that closes the stream on reading the
                    # last message never resumes us, and this request did finish
                    outcome = reason
                    self.metrics.decode_time.observe(now - t_first)
                yield self._msg(out.new_token_ids, text if text_out else "", lps, reason, stop or "",
                                wait_ms if first_msg else 0.0, n_gen)
                first_msg = False
                if reason is not None:
                    return
        finally:
            if outs is not None and self._running.get(rid, (None, None))[1] is outs:
                self._running.pop(rid, None)
                self._callers.pop(rid, None)
                if getattr(self.engine, "pacer", None) is not None:
                    self.engine.pacer.drop_budget(rid)
            if outs is not None and not ended:
                # NOTE: closing an engine stream that has not finished aborts the request (a
                # stop string, an Abort, a cancel); its abort runs after its start (FIFO)
                with contextlib.suppress(Exception):
                    await outs.aclose()
                asyncio.get_running_loop().create_task(_abort_quietly(self.engine, rid))
            self.metrics.requests.labels(outcome=outcome).inc()
            if outcome != "error":
                self.metrics.request_generation_tokens.observe(n_gen)

    @staticmethod
    def _msg(ids, text, lps, reason, stop, wait_ms, n_gen):
        if not (text or lps or reason or stop or wait_ms):  # a plain step: half the build cost
            return decode_pb2.DecodeResponse(token_ids=ids, num_generated=n_gen)
        return decode_pb2.DecodeResponse(
            token_ids=ids, text=text, logprobs=[x for x in lps if x is not None],
            finish_reason=FINISH_REASONS.get(reason, generate_pb2.FINISH_REASON_UNSPECIFIED),
            stop_reason=str(stop or ""), transfer_wait_ms=wait_ms, num_generated=n_gen)


_ABORTED = object()


async def _abort_quietly(engine, rid: str) -> None:
    try:
        await engine.abort(rid)
    except Exception:  # noqa: BLE001 - engine gone: nothing left to free
        log.debug("abort of %s failed", rid, exc_info=True)


class _Abort(Exception):
    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code
