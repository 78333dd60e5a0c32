"""OpenAI-compatible request parsing (-> GenRequest) and response shaping.

Bodies are validated by the pydantic models of gateway/schemas.py (the rules the gRPC front
shares); every error is a 400 whose message names the field and what was wrong with it (OpenAI
error shape: {"error": {"message", "type", "param"}}); a model that is not served is a 404 with
code "model_not_found", as OpenAI answers.
Extensions accepted in the body: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, priority, request_id, ttft_ms, tpot_ms (per-request SLOs; also as "slo": {...}).
A request without max_tokens generates until an end token or the end of the context (as vLLM),
unless the gateway was given --default-max-tokens; one beyond the context is a 400 (or capped:
--max-tokens-over-context). response_format json_object / json_schema is constrained decoding
in the engine (SamplingParams.guided). Fields whose meaning this server cannot honour (n > 1,
logit_bias, tools, vLLM's guided_*) are a 400 naming the field, never silently ignored.

/tokenize and /detokenize take vLLM's bodies: {"prompt"} or {"messages"} (+ add_special_tokens,
add_generation_prompt, return_token_strs) -> {"count", "max_model_len", "tokens", "token_strs"};
{"tokens"} -> {"prompt"}.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import grpc

from engine.sampling_params import GuidedJSON
from gateway.schemas import (ChatBody, CompletionBody, DetokenizeBody, Message, TokenizeBody,
                             json_type)
from gateway.types import GatewayError, GenChunk, GenRequest, invalid
from gateway.validate import Limits, encode, parse, sampling_params

# field -> the one value that means "not used" (empty values are accepted as well)
_UNSUPPORTED = {"suffix": None, "echo": False, "best_of": 1, "tools": None, "functions": None,
                "logit_bias": None, "guided_json": None, "guided_regex": None,
                "guided_choice": None, "guided_grammar": None, "structured_outputs": None}


class ModelNotFound(GatewayError):
    """404 with OpenAI's error type and code for a model that is not served."""
    openai_type = "invalid_request_error"
    openai_code = "model_not_found"

    def __init__(self, model: str, served: list[str]):
        super().__init__(grpc.StatusCode.NOT_FOUND,
                         f"The model `{model}` does not exist. Served here: {', '.join(served)}",
                         param="model")


@dataclass
class ParsedRequest:
    gen: GenRequest
    stream: bool
    include_usage: bool
    kind: str  # "completion" | "chat"
    logprobs: int | None  # top-N asked (None: no logprobs)


def check_body(body, served: list[str], model_required: bool = True) -> None:
    """The request body must be a JSON object whose 'model' is served (or, where not required,
    absent)."""
    if not isinstance(body, dict):
        raise invalid(f"request body must be a JSON object, got {json_type(body)}")
    model = body.get("model")
    if model is None:
        if model_required:
            raise invalid("'model' is required", param="model")
        return
    if not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {json_type(model)}", param="model")
    if model not in served:
        raise ModelNotFound(model, served)


def _tokenizer(core, hint: str = "", param: str | None = None):
    if core.tokenizer is None:
        raise invalid("this model has no tokenizer" + hint, param=param)
    return core.tokenizer


def _unsupported(body: dict) -> None:
    for k, ok in _UNSUPPORTED.items():
        if k in body and body[k] not in (None, ok, [], "", {}):
            raise invalid(f"'{k}' is not supported", param=k)
    rf = body.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise invalid(f"'response_format' must be an object, got {json_type(rf)}",
                      param="response_format")


def _guided(b) -> dict:
    """response_format -> the engine's constrained decoding (engine/structured.py compiles it;
    a schema it cannot compile comes back from prefill as a 400 naming the field)."""
    rf = b.response_format
    if rf is None or rf.type == "text":
        return {}
    if rf.type == "json_object":
        return {"guided": GuidedJSON()}
    if rf.json_schema is None:
        raise invalid("response_format.json_schema is required with type 'json_schema'",
                      param="response_format.json_schema")
    return {"guided": GuidedJSON(json.dumps(rf.json_schema.schema_))}


def _gen(b, ids: list[int], params, core, op: str) -> GenRequest:
    slo = b.slo
    ttft = b.ttft_ms if b.ttft_ms is not None else (slo.ttft_ms if slo else None)
    tpot = b.tpot_ms if b.tpot_ms is not None else (slo.tpot_ms if slo else None)
    return GenRequest(b.request_id or core.new_request_id(), ids, params, ttft, tpot,
                      b.priority or 0, operation=op)


def _include_usage(b) -> bool:
    return bool(b.stream_options and b.stream_options.include_usage)


async def parse_completion(body, core, served: list[str], limits: Limits) -> ParsedRequest:
    check_body(body, served)
    _unsupported(body)
    b = parse(CompletionBody, body)
    if isinstance(b.prompt, str):
        tok = _tokenizer(core, ": send 'prompt' as an array of token ids", param="prompt")
        ids = await encode(tok, b.prompt, True)
    else:
        ids = list(b.prompt)
    core.check_prompt(ids)
    params = sampling_params(b, len(ids), limits, logprobs=b.logprobs, **_guided(b))
    gen = _gen(b, ids, params, core, "text_completion")
    return ParsedRequest(gen, bool(b.stream), _include_usage(b), "completion", b.logprobs)


_USE_IDS = ": use /v1/completions with token ids"


def _chat_text(core, messages: list[Message], add_generation_prompt: bool = True) -> str:
    tok = _tokenizer(core, _USE_IDS)
    try:
        return tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                       add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise invalid(f"messages: {e}", param="messages") from None


async def parse_chat(body, core, served: list[str], limits: Limits) -> ParsedRequest:
    check_body(body, served)
    _unsupported(body)
    b = parse(ChatBody, body)
    tok = _tokenizer(core, _USE_IDS)
    if b.top_logprobs is not None and not b.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    lp = (b.top_logprobs or 0) if b.logprobs else None
    ids = await encode(tok, _chat_text(core, b.messages), False)
    core.check_prompt(ids)
    use_mct = b.max_completion_tokens is not None
    params = sampling_params(b, len(ids), limits, logprobs=lp,
                             max_tokens=b.max_completion_tokens if use_mct else b.max_tokens,
                             param="max_completion_tokens" if use_mct else "max_tokens",
                             **_guided(b))
    return ParsedRequest(_gen(b, ids, params, core, "chat"), bool(b.stream), _include_usage(b),
                         "chat", lp)


# ---- /tokenize, /detokenize (vLLM's bodies) --------------------------------------------------

async def tokenize(body, core, served: list[str]) -> dict:
    check_body(body, served, model_required=False)
    b = parse(TokenizeBody, body)
    tok = _tokenizer(core)
    if b.messages is not None:
        text = _chat_text(core, b.messages, b.add_generation_prompt is not False)
        ids = await encode(tok, text, bool(b.add_special_tokens))
    elif b.prompt is not None:
        ids = await encode(tok, b.prompt, b.add_special_tokens is not False)
    else:
        raise invalid("one of 'prompt' or 'messages' is required", param="prompt")
    strs = [tok.tk.id_to_token(i) for i in ids] if b.return_token_strs else None
    return {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body, core, served: list[str]) -> dict:
    check_body(body, served, model_required=False)
    b = parse(DetokenizeBody, body)
    tok = _tokenizer(core)
    bad = next((t for t in b.tokens if not 0 <= t < core.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is out of range [0, {core.vocab_size})", param="tokens")
    return {"prompt": tok.decode(b.tokens, skip_special_tokens=False)}


# ---- responses --------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage_json(u: dict | None) -> dict | None:
    if not u:
        return None
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}


def timings_json(t: dict | None) -> dict:
    """The gateway's extension beside `usage`: {"timings": {ttft_ms, queue_ms, ...,
    predicted_ttft_ms, predicted_tpot_ms, admitted_ms}} (empty without timings)."""
    return {"timings": {k: round(float(v), 3) for k, v in t.items()}} if t else {}


def _tok(tokenizer, i: int) -> str:
    return tokenizer.decode([i], skip_special_tokens=False) if tokenizer is not None else str(i)


def logprobs_json(kind: str, tokenizer, c: GenChunk, text_offset: int) -> dict | None:
    if not c.logprobs:
        return None
    if kind == "chat":
        content = []
        for lp in c.logprobs:
            t = _tok(tokenizer, lp.token_id)
            content.append({"token": t, "logprob": lp.logprob, "bytes": list(t.encode()),
                            "top_logprobs": [{"token": _tok(tokenizer, x.token_id),
                                              "logprob": x.logprob,
                                              "bytes": list(_tok(tokenizer, x.token_id).encode())}
                                             for x in lp.top]})
        return {"content": content}
    toks = [_tok(tokenizer, lp.token_id) for lp in c.logprobs]
    offsets, off = [], text_offset
    for t in toks:
        offsets.append(off)
        off += len(t)
    return {"tokens": toks, "token_logprobs": [lp.logprob for lp in c.logprobs],
            "top_logprobs": [{_tok(tokenizer, x.token_id): x.logprob for x in lp.top}
                             for lp in c.logprobs], "text_offset": offsets}


def merge_logprobs(kind: str, acc: dict | None, new: dict | None) -> dict | None:
    if new is None:
        return acc
    if acc is None:
        return new
    for k in acc:
        acc[k] = acc[k] + new[k]
    return acc


def stream_chunk(kind: str, rid: str, model: str, created: int, text: str, finish: str | None,
                 logprobs: dict | None, first: bool = False) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def full_response(kind: str, rid: str, model: str, text: str, finish: str | None,
                  logprobs: dict | None, usage: dict | None, timings: dict | None = None) -> dict:
    created = int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_json(usage), **timings_json(timings)}
