"""Request schemas (pydantic, strict): the OpenAI bodies the REST bridge takes and the sampling
rules both fronts share (gRPC messages are converted to SamplingFields / Message and validated
by the same models).

Strict mode: no coercion ("5" is not an integer, true is not a number); integers are accepted
where numbers are, and an integral number (5.0) where integers are, as JSON Schema's "integer"
(the published /openapi.json) says. Every number has a range (the engine's and the wire's:
uint32 token counts, int64 seeds), floats must be finite. A field's own rule is phrased to
follow its quoted name ("'stop' must be ..."); gateway/validate.py turns errors into a 400 /
INVALID_ARGUMENT naming the field. Unknown fields are ignored, as OpenAI's SDKs send extras.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

U32 = (1 << 32) - 1
I32 = (1 << 31) - 1
I64 = (1 << 63) - 1
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 16  # stop strings per request (engine SamplingParams)
MAX_STOP_CHARS = 4096  # one stop string: the detokenizer searches a tail this long every step
MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_CHARS = 256


def json_type(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number",
                                     str: "string", list: "array", dict: "object"}.get(
        type(v), type(v).__name__)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integral(v):
    """An integral float (5.0, not 5.5, inf or nan) as the integer; anything else unchanged."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]  # an integer field of a JSON body


def _finite(lo: float, hi: float):
    """An optional finite float in [lo, hi]."""
    return Field(None, allow_inf_nan=False, ge=lo, le=hi)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SamplingFields(Strict):
    """The sampling and service fields of one generation, the same on REST and gRPC.
    None = not given (the engine's default, or the gateway's for max_tokens)."""
    request_id: Optional[str] = Field(None, max_length=MAX_REQUEST_ID_CHARS)  # "": the gateway's
    max_tokens: Optional[Int] = Field(None, ge=1, le=U32)
    temperature: Optional[float] = _finite(0.0, 100.0)
    # > 0 as the services see it: they keep 6 decimals of a float32 (1e-30 arrives as 0)
    top_p: Optional[float] = _finite(1e-6, 1.0)
    top_k: Optional[Int] = Field(None, ge=-1, le=I32)
    min_p: Optional[float] = _finite(0.0, 1.0)
    repetition_penalty: Optional[float] = _finite(1e-6, 100.0)
    presence_penalty: Optional[float] = _finite(-2.0, 2.0)
    frequency_penalty: Optional[float] = _finite(-2.0, 2.0)
    seed: Optional[Int] = Field(None, ge=-I64 - 1, le=I64)
    min_tokens: Optional[Int] = Field(None, ge=0, le=U32)
    stop: Any = None
    stop_token_ids: Optional[list[Int]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: Optional[bool] = None
    priority: Optional[Int] = Field(None, ge=-I32 - 1, le=I32)
    # an SLO of 0 ms is valid and impossible: admission answers 429 / RESOURCE_EXHAUSTED
    ttft_ms: Optional[float] = _finite(0.0, float(U32))
    tpot_ms: Optional[float] = _finite(0.0, float(U32))

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError(f"must be a string or an array of strings, got {json_type(v)}")
        if len(v) > MAX_STOP:
            raise ValueError(f"must hold at most {MAX_STOP} strings, got {len(v)}")
        if any(s == "" or len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"strings must be non-empty and at most {MAX_STOP_CHARS} characters")
        return tuple(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        bad = next((t for t in v or () if not 0 <= t <= U32), None)
        if bad is not None:
            raise ValueError(f"must hold token ids >= 0, got {bad}")
        return v


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    """One chat message; content is required (a string or text parts), roles as OpenAI's."""
    role: Literal[ROLES]
    content: Any

    @field_validator("content")
    @classmethod
    def _content(cls, c):
        if isinstance(c, str):
            return c
        if isinstance(c, list) and all(isinstance(p, dict) for p in c):
            return "".join(TextPart.model_validate(p).text for p in c)
        raise ValueError(f"must be a string or an array of text parts, got {json_type(c)}")


class Slo(Strict):
    ttft_ms: Optional[float] = _finite(0.0, float(U32))
    tpot_ms: Optional[float] = _finite(0.0, float(U32))


class StreamOptions(Strict):
    include_usage: Optional[bool] = None


class JsonSchemaFormat(Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: dict = Field(..., alias="schema")  # the JSON Schema the output must satisfy
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None  # required with type json_schema


class _OpenAIBody(SamplingFields):
    model: Optional[str] = None  # required and served: openai_api.check_model
    n: Optional[Literal[1]] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    slo: Optional[Slo] = None
    response_format: Optional[ResponseFormat] = None


class CompletionBody(_OpenAIBody):
    prompt: Any = Field(...)
    logprobs: Optional[Int] = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, p):
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, list):
            p = [_integral(x) for x in p]
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(x) for x in p)):
            if p == "":
                raise ValueError("is empty")
            return p
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise ValueError("holds several prompts; send one prompt per request")
        raise ValueError(f"must be a string or an array of token ids, got {json_type(p)}")


class ChatBody(_OpenAIBody):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=1, le=U32)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Int] = Field(None, ge=0, le=20)


class TokenizeBody(Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    return_token_strs: Optional[bool] = None


class DetokenizeBody(Strict):
    model: Optional[str] = None
    tokens: list[Int]


class GenerateFields(SamplingFields):
    """gRPC GenerateRequest's fields after conversion (sampling.*, slo.*, the request's own)."""
    logprobs: Optional[Int] = Field(None, ge=0, le=20)


class ChatMessagesFields(Strict):
    """gRPC ChatMessages: the same message rules as REST."""
    messages: list[Message] = Field(..., min_length=1)


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra` declaring `model` as its JSON request body (the handlers read
    the raw body themselves), nested models inlined: the OpenAPI document has no $defs."""
    schema = model.model_json_schema(by_alias=True)
    defs = schema.pop("$defs", {})

    def inline(x):  # NOTE: none of these models is recursive, so inlining ends
        if isinstance(x, dict):
            if "$ref" in x:
                return inline(defs[x["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in x.items()}
        return [inline(v) for v in x] if isinstance(x, list) else x

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}
