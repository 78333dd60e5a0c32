"""OpenAI-compatible request parsing/validation (-> GenRequest) and response shaping.

Validation is done by hand, not by pydantic, so every error is a 400 whose message names the
field and what was wrong with it (OpenAI error shape: {"error": {"message", "type", "param"}});
a model that is not served is a 404 with code "model_not_found", as OpenAI answers.
Extensions accepted in the body: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, priority, ttft_ms, tpot_ms (per-request SLOs; also as "slo": {...}).
A request without max_tokens generates until an end token or the end of the context (as vLLM),
unless the gateway was given --default-max-tokens. Fields whose meaning this server cannot honour
(n > 1, response_format json_object / json_schema, logit_bias, tools, vLLM's guided_*) are a 400
naming the field, never silently ignored.

/tokenize and /detokenize take vLLM's bodies: {"prompt"} or {"messages"} (+ add_special_tokens,
add_generation_prompt, return_token_strs) -> {"count", "max_model_len", "tokens", "token_strs"};
{"tokens"} -> {"prompt"}.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc

from gateway.convert import make_sampling_params
from gateway.types import GatewayError, GenChunk, GenRequest, invalid

_NUM = (int, float)
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


def _type_name(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _get(body: dict, key: str, types, default=None, what: str | None = None):
    """body[key] if present and of the right JSON type (booleans are not numbers)."""
    if key not in body or body[key] is None:
        return default
    v = body[key]
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _as_tuple(types))
    if not ok:
        raise invalid(f"'{key}' must be {what or _names(types)}, got {_type_name(v)}", param=key)
    return v


def _as_tuple(t):
    return t if isinstance(t, tuple) else (t,)


def _names(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "an array", dict: "an object"}
    ts = _as_tuple(types)
    if set(ts) == {int, float}:
        return "a number"
    return " or ".join(names.get(t, t.__name__) for t in ts)


def _stop(body: dict) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or not all(isinstance(x, str) for x in s):
        raise invalid("'stop' must be a string or an array of strings", param="stop")
    return tuple(s)


def _int_list(v, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise invalid(f"'{key}' must be an array of integers", param=key)
    return v


def check_model(body: dict, served: list[str], required: bool = True) -> str | None:
    model = _get(body, "model", str)
    if model is None:
        if not required:
            return None
        raise invalid("'model' is required", param="model")
    if model not in served:
        raise ModelNotFound(model, served)
    return model


def check_body(body, served: list[str], model_required: bool = True) -> None:
    """The request body must be a JSON object whose 'model' is served (or, where not required,
    absent)."""
    if not isinstance(body, dict):
        raise invalid(f"request body must be a JSON object, got {_type_name(body)}")
    check_model(body, served, model_required)


def _tokenizer(core, hint: str = "", param: str | None = None):
    if core.tokenizer is None:
        raise invalid("this model has no tokenizer" + hint, param=param)
    return core.tokenizer


def _response_format(body: dict) -> None:
    rf = _get(body, "response_format", dict, None)
    if rf is None:
        return
    kind = rf.get("type")
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise invalid(f"response_format {kind!r} is not supported: this server has no constrained "
                      f"decoding, so the output would not be guaranteed JSON (leave "
                      f"response_format out, or use type 'text')", param="response_format")
    raise invalid(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                  f"{kind!r}", param="response_format")


def _common(body: dict, core, default_max_tokens: int | None, max_tokens_key: str,
            logprobs: int | None, n_prompt: int):
    """Sampling and service fields. max_tokens unset: default_max_tokens, or (None) the rest of
    the context after the prompt's n_prompt tokens."""
    for k, ok in _UNSUPPORTED.items():
        if k in body and body[k] not in (None, ok, [], "", {}):
            raise invalid(f"'{k}' is not supported", param=k)
    n = _get(body, "n", int, 1)
    if n != 1:
        raise invalid(f"'n' must be 1 (got {n}); only one choice per request is supported", param="n")
    _response_format(body)
    max_tokens = _get(body, max_tokens_key, int, None)
    if max_tokens is None and max_tokens_key != "max_tokens":
        max_tokens = _get(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = default_max_tokens or max(1, core.max_model_len - n_prompt)
    kw = dict(
        max_tokens=max_tokens,
        temperature=_get(body, "temperature", _NUM, 1.0), top_p=_get(body, "top_p", _NUM, 1.0),
        top_k=_get(body, "top_k", int, 0), min_p=_get(body, "min_p", _NUM, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", _NUM, 1.0),
        presence_penalty=_get(body, "presence_penalty", _NUM, 0.0),
        frequency_penalty=_get(body, "frequency_penalty", _NUM, 0.0),
        seed=_get(body, "seed", int, None), stop=_stop(body),
        stop_token_ids=tuple(_int_list(body.get("stop_token_ids") or [], "stop_token_ids")),
        ignore_eos=_get(body, "ignore_eos", bool, False), logprobs=logprobs,
        min_tokens=_get(body, "min_tokens", int, 0))
    for k in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty"):
        kw[k] = float(kw[k])
    params = make_sampling_params(**kw)
    slo = _get(body, "slo", dict, {})
    ttft = _get(body, "ttft_ms", _NUM, None) or _get(slo, "ttft_ms", _NUM, None)
    tpot = _get(body, "tpot_ms", _NUM, None) or _get(slo, "tpot_ms", _NUM, None)
    for k, v in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        if v is not None and v <= 0:
            raise invalid(f"'{k}' must be > 0, got {v}", param=k)
    stream = _get(body, "stream", bool, False)
    so = _get(body, "stream_options", dict, {}) or {}
    include_usage = bool(_get(so, "include_usage", bool, False))
    rid = _get(body, "request_id", str, None) or core.new_request_id()
    return params, ttft, tpot, _get(body, "priority", int, 0), stream, include_usage, rid


def parse_completion(body, core, served: list[str], default_max_tokens: int | None) -> ParsedRequest:
    check_body(body, served)
    if "prompt" not in body:
        raise invalid("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if p == "":
            raise invalid("'prompt' is empty", param="prompt")
        tok = _tokenizer(core, ": send 'prompt' as an array of token ids", param="prompt")
        ids = tok.encode(p, add_special_tokens=True)
    elif isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1:
        raise invalid("'prompt' holds several prompts; send one prompt per request", param="prompt")
    else:
        raise invalid(f"'prompt' must be a string or an array of token ids, got {_type_name(p)}",
                      param="prompt")
    lp = _get(body, "logprobs", int, None)
    if lp is not None and not 0 <= lp <= 5:
        raise invalid(f"'logprobs' must be in [0, 5], got {lp}", param="logprobs")
    core.check_prompt(ids)
    params, ttft, tpot, prio, stream, inc, rid = _common(body, core, default_max_tokens,
                                                         "max_tokens", lp, len(ids))
    gen = GenRequest(rid, ids, params, ttft, tpot, prio, operation="text_completion")
    return ParsedRequest(gen, stream, inc, "completion", lp)


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # [{"type": "text", "text": "..."}]
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content: only text parts are supported",
                              param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content must be a string or an array of text parts, got "
                  f"{_type_name(c)}", param="messages")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty array", param="messages")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'", param="messages")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise invalid(f"messages[{i}].role {m['role']!r} is not one of system, user, "
                          f"assistant, tool, developer", param="messages")
        messages.append({"role": m["role"], "content": _content(m, i)})
    return messages


_USE_IDS = ": use /v1/completions with token ids"


def _chat_text(core, messages: list[dict], add_generation_prompt: bool = True) -> str:
    tok = _tokenizer(core, _USE_IDS)
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise invalid(f"messages: {e}", param="messages") from None


def parse_chat(body, core, served: list[str], default_max_tokens: int | None) -> ParsedRequest:
    check_body(body, served)
    messages = _messages(body)
    tok = _tokenizer(core, _USE_IDS)
    want_lp = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int, None)
    if top is not None and not 0 <= top <= 20:
        raise invalid(f"'top_logprobs' must be in [0, 20], got {top}", param="top_logprobs")
    if top is not None and not want_lp:
        raise invalid("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    lp = (top or 0) if want_lp else None
    ids = tok.encode(_chat_text(core, messages), add_special_tokens=False)
    core.check_prompt(ids)
    params, ttft, tpot, prio, stream, inc, rid = _common(body, core, default_max_tokens,
                                                         "max_completion_tokens", lp, len(ids))
    gen = GenRequest(rid, ids, params, ttft, tpot, prio, operation="chat")
    return ParsedRequest(gen, stream, inc, "chat", lp)


# ---- /tokenize, /detokenize (vLLM's bodies) --------------------------------------------------

def tokenize(body, core, served: list[str]) -> dict:
    check_body(body, served, model_required=False)
    tok = _tokenizer(core)
    if body.get("messages") is not None:
        text = _chat_text(core, _messages(body),
                          _get(body, "add_generation_prompt", bool, True))
        ids = tok.encode(text, add_special_tokens=_get(body, "add_special_tokens", bool, False))
    elif body.get("prompt") is not None:
        ids = tok.encode(_get(body, "prompt", str),
                         add_special_tokens=_get(body, "add_special_tokens", bool, True))
    else:
        raise invalid("one of 'prompt' or 'messages' is required", param="prompt")
    strs = ([tok.tk.id_to_token(i) for i in ids]
            if _get(body, "return_token_strs", bool, False) else None)
    return {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body, core, served: list[str]) -> dict:
    check_body(body, served, model_required=False)
    tok = _tokenizer(core)
    if "tokens" not in body:
        raise invalid("'tokens' is required", param="tokens")
    ids = _int_list(body["tokens"], "tokens")
    bad = next((t for t in ids if not 0 <= t < core.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is out of range [0, {core.vocab_size})", param="tokens")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}


# ---- responses --------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage_json(u: dict | None) -> dict | None:
    if not u:
        return None
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}


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
                  logprobs: dict | None, usage: dict | None) -> dict:
    created = int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_json(usage)}
