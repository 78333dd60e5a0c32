"""The one validator of both fronts: pydantic errors -> a 400 / INVALID_ARGUMENT naming the
field, the JSON body of a REST request (content type, size, depth, surrogates), and the rules
that need the served model (the context bounds max_tokens, the vocabulary bounds token ids).

    parse(Model, data, names) -> Model instance, or raises GatewayError (INVALID_ARGUMENT)
    read_json_body(request, max_body_bytes) -> the decoded JSON (415 / 400 on a bad body)
    Limits: what the served model and the gateway's flags allow
    sampling_params(fields, n_prompt, limits) -> engine SamplingParams
    encode(tokenizer, text, add_special_tokens) -> token ids (long texts off the event loop)
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pydantic_core
from pydantic import BaseModel, ValidationError

from engine.sampling_params import InvalidRequestError, SamplingParams
from gateway.config import MAX_TOKENS_OVER_CONTEXT
from gateway.schemas import SamplingFields, json_type
from gateway.types import GatewayError, invalid

# SamplingParams keywords taken from SamplingFields as they are
_ENGINE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "min_tokens", "ignore_eos")


class UnsupportedMediaType(GatewayError):
    """415: the body is not declared as JSON."""
    http_status = 415

    def __init__(self, ctype: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Content-Type must be application/json, got {ctype!r}")


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    default_max_tokens: int | None = None  # None: the rest of the context
    over_context: str = "error"  # max_tokens beyond the context: "error" (400) or "cap"
    max_prompt_bytes: int = 1 << 20  # gRPC prompt / chat / Tokenize text (REST: the body cap)

    def __post_init__(self):
        if self.over_context not in MAX_TOKENS_OVER_CONTEXT:
            raise ValueError(f"max_tokens_over_context must be one of {MAX_TOKENS_OVER_CONTEXT}, "
                             f"got {self.over_context!r}")


def _path(loc, names: dict[str, str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else names.get(part, part)
    return out


def _message(e: dict, path: str) -> str:
    t, v, ctx = e["type"], e.get("input"), e.get("ctx") or {}
    kinds = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
             "string_type": "a string", "bool_type": "a boolean", "list_type": "an array",
             "dict_type": "an object", "model_type": "an object", "model_attributes_type":
             "an object"}
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
              "less_than_equal": "<="}
    if t == "missing":
        return f"'{path}' is required"
    if t in kinds:
        return f"'{path}' must be {kinds[t]}, got {json_type(v)}"
    if t in bounds:
        bound = next(iter(ctx.values()))
        if isinstance(bound, float) and bound.is_integer() and abs(bound) < 1e16:
            bound = int(bound)
        return f"'{path}' must be {bounds[t]} {bound}, got {v}"
    if t == "finite_number":
        return f"'{path}' must be a finite number, got {v}"
    if t == "too_short" and ctx.get("min_length") == 1:
        return f"'{path}' must be a non-empty array"
    if t in ("too_short", "string_too_short"):
        return f"'{path}' must have at least {ctx.get('min_length')} item(s) / characters"
    if t in ("too_long", "string_too_long"):
        return f"'{path}' must have at most {ctx.get('max_length')} items / characters"
    if t == "literal_error":
        return f"'{path}' must be {ctx.get('expected')}, got {v!r}"
    if t == "value_error":
        return f"'{path}' {str(ctx.get('error', e['msg']))}"
    return f"'{path}': {e['msg']}"


def parse(model: type[BaseModel], data, names: dict[str, str] | None = None):
    """model.model_validate(data); the first error is raised as INVALID_ARGUMENT naming its
    field. names: field -> the name the client knows it by (e.g. gRPC's sampling.temperature)."""
    if not isinstance(data, dict):
        raise invalid(f"request body must be a JSON object, got {json_type(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as ex:
        e = ex.errors(include_url=False)[0]
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        path = _path(loc, names or {}) or "body"
        raise invalid(_message(e, path), param=path) from None


def _media_type(ctype: str) -> str:
    return ctype.split(";", 1)[0].strip().lower()


async def read_json_body(request, max_body_bytes: int):
    """The request's JSON value. A Content-Type other than JSON is 415 (none at all is read as
    JSON); bodies over max_body_bytes, empty, invalid UTF-8 / JSON, NaN or Infinity, a lone
    surrogate escape or nesting deeper than the parser's limit (200) are a 400."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        mt = _media_type(ctype)
        if mt != "application/json" and not mt.endswith("+json"):
            raise UnsupportedMediaType(ctype)
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > max_body_bytes:
        raise invalid(f"request body is too large: {cl} bytes > limit {max_body_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_body_bytes:
            raise invalid(f"request body is too large: > limit {max_body_bytes} bytes")
    if not body:
        raise invalid("request body is empty; expected a JSON object")
    try:
        # NOTE: jiter (pydantic_core) bounds nesting and rejects lone surrogates; json.loads
        # recursed into a RecursionError (a 500) and let "\ud800" through to the tokenizer
        return pydantic_core.from_json(bytes(body), allow_inf_nan=False)
    except ValueError as e:
        raise invalid(f"request body is not valid JSON: {e}") from None


OFF_LOOP_CHARS = 32 << 10  # texts this long are tokenized on a worker thread


async def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """tokenizer.encode(text). A long text goes to a worker thread through the Rust tokenizer's
    batch call, which releases the GIL (encode holds it: a 1 MiB prompt stalled the event loop,
    every other request with it, for ~2 s)."""
    tk = getattr(tokenizer, "tk", None)
    if len(text) < OFF_LOOP_CHARS or tk is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(
        lambda: tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def check_text_size(texts, limits: Limits, param: str) -> None:
    """The UTF-8 size of texts (str or several) is within limits.max_prompt_bytes (checked
    before any tokenizing: a 30 MiB text took the tokenizer 45 s and 3 GiB)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    cap = limits.max_prompt_bytes
    n = sum(map(len, texts))
    if n <= cap:  # characters <= bytes <= 4 x characters: encode only where it decides
        n = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) if n * 4 > cap else 0
    if n > cap:
        raise invalid(f"'{param}' is too large: more than the limit of {cap} bytes", param=param)


def max_tokens_for(asked: int | None, n_prompt: int, limits: Limits,
                   param: str = "max_tokens") -> int:
    """The request's max_tokens: unset -> the gateway's default, else the rest of the context
    (capped by it); beyond the context -> a 400 or the rest of the context (limits.over_context)."""
    room = max(1, limits.max_model_len - n_prompt)
    if asked is None:
        return min(limits.default_max_tokens or room, room)
    if asked > room:
        if limits.over_context == "cap":
            return room
        raise invalid(f"This model's maximum context length is {limits.max_model_len} tokens. "
                      f"However, you requested {n_prompt + asked} tokens ({n_prompt} in the "
                      f"prompt, {asked} in '{param}'). Reduce the prompt or '{param}' (or start "
                      f"the gateway with --max-tokens-over-context cap)", param=param)
    return asked


def sampling_params(f: SamplingFields, n_prompt: int, limits: Limits, *, logprobs: int | None,
                    max_tokens: int | None = None, param: str = "max_tokens",
                    **extra) -> SamplingParams:
    """SamplingParams of validated fields; the model-dependent rules apply here.
    max_tokens: overrides f.max_tokens (chat's max_completion_tokens); extra: more keywords."""
    mt = max_tokens_for(max_tokens if max_tokens is not None else f.max_tokens, n_prompt,
                        limits, param)
    ids = tuple(f.stop_token_ids or ())
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(f"'stop_token_ids' holds {bad}, out of range [0, {limits.vocab_size})",
                      param="stop_token_ids")
    if f.min_tokens is not None and f.min_tokens > mt:
        raise invalid(f"'min_tokens' must be <= max_tokens ({mt}), got {f.min_tokens}",
                      param="min_tokens")
    kw = {k: getattr(f, k) for k in _ENGINE_FIELDS if getattr(f, k) is not None}
    for k in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty"):
        if k in kw:
            kw[k] = float(kw[k])
    try:
        return SamplingParams(max_tokens=mt, stop=f.stop or (), stop_token_ids=ids,
                              logprobs=logprobs, **kw, **extra)
    except InvalidRequestError as e:
        raise invalid(str(e)) from None
    except TypeError as e:
        raise invalid(f"invalid sampling parameters: {e}") from None
