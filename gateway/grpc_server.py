"""Public gRPC front: splitserve.v1.Generation (Generate stream, Tokenize, ModelInfo).
Thin: GenerateRequest -> GenRequest (validated by the REST bridge's rules: gateway/schemas.py,
gateway/validate.py), GatewayCore.generate -> GenerateResponse stream.

Requests are parsed here, not by grpc: a message that is not valid protobuf (or holds bad
UTF-8) is INVALID_ARGUMENT naming the message type, where grpc's own parsing answered UNKNOWN.
"""
from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError

from common.convert import SAMPLING_FIELDS, sampling_kwargs
from engine.sampling_params import InvalidRequestError
from gateway.core import GatewayCore
from gateway.schemas import ChatMessagesFields, GenerateFields
from gateway.types import GatewayError, GenChunk, GenRequest, invalid
from gateway.validate import Limits, check_text_size, encode, parse, sampling_params
from protos import generate_pb2

log = logging.getLogger("splitserve.gateway.grpc")
SERVICE = "splitserve.v1.Generation"

_FINISH_PB = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH,
              "abort": generate_pb2.FINISH_REASON_ABORT, "error": generate_pb2.FINISH_REASON_ERROR}
# SamplingFields name -> the field's name in GenerateRequest, for error messages
_PB_NAMES = {**{f: f"sampling.{f}" for f in SAMPLING_FIELDS},
             "ttft_ms": "slo.ttft_ms", "tpot_ms": "slo.tpot_ms"}


async def chat_to_ids(core: GatewayCore, msgs_pb, limits: Limits) -> list[int]:
    if core.tokenizer is None:
        raise invalid("this model has no tokenizer: send token_ids", param="messages")
    check_text_size([m.content for m in msgs_pb.messages], limits, "messages")
    fields = parse(ChatMessagesFields, {"messages": [{"role": m.role, "content": m.content}
                                                     for m in msgs_pb.messages]})
    messages = [{"role": m.role, "content": m.content} for m in fields.messages]
    add_gen = msgs_pb.add_generation_prompt if msgs_pb.HasField("add_generation_prompt") else True
    try:
        text = core.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen)
    except ValueError as e:
        raise invalid(f"messages: {e}", param="messages") from None
    # NOTE: the template already holds the special tokens (bos etc.)
    return await encode(core.tokenizer, text, False)


def _fields(pb) -> tuple[GenerateFields, dict]:
    """The request's sampling / service fields, validated; + engine keywords taken as they are
    (guided decoding)."""
    try:
        kw = sampling_kwargs(pb.sampling if pb.HasField("sampling") else None)
    except InvalidRequestError as e:
        raise invalid(str(e), param="sampling") from None
    extra = {k: kw.pop(k) for k in list(kw) if k not in SAMPLING_FIELDS}
    slo = pb.slo if pb.HasField("slo") else None
    for k in ("ttft_ms", "tpot_ms"):
        if slo is not None and slo.HasField(k):
            kw[k] = getattr(slo, k)
    kw.update(max_tokens=pb.max_tokens or None, stop=list(pb.stop),
              stop_token_ids=list(pb.stop_token_ids), ignore_eos=pb.ignore_eos,
              priority=pb.priority, request_id=pb.request_id or None)
    return parse(GenerateFields, kw, _PB_NAMES), extra


async def request_from_pb(core: GatewayCore, pb, limits: Limits) -> GenRequest:
    f, extra = _fields(pb)
    which = pb.WhichOneof("input")
    if which is None:
        raise invalid("one of prompt, messages or token_ids is required", param="input")
    if which == "prompt":
        if pb.prompt == "":
            raise invalid("prompt is empty", param="prompt")
        if core.tokenizer is None:
            raise invalid("this model has no tokenizer: send token_ids", param="prompt")
        check_text_size(pb.prompt, limits, "prompt")
        ids = await encode(core.tokenizer, pb.prompt, True)
        op = "text_completion"
    elif which == "messages":
        ids, op = await chat_to_ids(core, pb.messages, limits), "chat"
    else:
        ids, op = list(pb.token_ids.ids), "text_completion"
    core.check_prompt(ids)
    params = sampling_params(f, len(ids), limits, logprobs=f.logprobs, **extra)
    return GenRequest(
        request_id=f.request_id or core.new_request_id(), prompt_token_ids=ids, params=params,
        ttft_slo_ms=f.ttft_ms, tpot_slo_ms=f.tpot_ms, priority=f.priority or 0,
        want_text=not pb.skip_text, operation=op)


def chunk_to_pb(request_id: str, c: GenChunk):
    out = generate_pb2.GenerateResponse(request_id=request_id, token_ids=c.token_ids, text=c.text,
                                        logprobs=c.logprobs, stop_reason=c.stop_reason or "")
    if c.finish_reason:
        out.finish_reason = _FINISH_PB[c.finish_reason]
    if c.usage:
        out.usage.CopyFrom(generate_pb2.Usage(**c.usage))
    if c.timings:
        out.timings.CopyFrom(generate_pb2.Timings(**c.timings))
    return out


async def abort_with(context, e: GatewayError):
    if e.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
    await context.abort(e.code, e.message)


class Malformed:
    """What a request that is not valid protobuf parses to (the servicer answers
    INVALID_ARGUMENT)."""

    def __init__(self, message: str):
        self.message = message


def _lenient(cls):
    def parse_bytes(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Malformed(f"request is not a valid {cls.DESCRIPTOR.full_name} message: {e}")
    return parse_bytes


class GenerationServicer:
    def __init__(self, core: GatewayCore, limits: Limits):
        self.core = core
        self.limits = limits

    async def Generate(self, request, context):  # noqa: N802
        try:
            if isinstance(request, Malformed):
                raise invalid(request.message)
            req = await request_from_pb(self.core, request, self.limits)
            async for chunk in self.core.generate(req, metadata=context.invocation_metadata()):
                yield chunk_to_pb(req.request_id, chunk)
        except GatewayError as e:
            await abort_with(context, e)

    async def Tokenize(self, request, context):  # noqa: N802
        core = self.core
        try:
            if isinstance(request, Malformed):
                raise invalid(request.message)
            which = request.WhichOneof("input")
            if core.tokenizer is None:
                raise invalid("this model has no tokenizer")
            if which == "messages":
                ids = await chat_to_ids(core, request.messages, self.limits)
            elif which == "text":
                check_text_size(request.text, self.limits, "text")
                ids = await encode(core.tokenizer, request.text, request.add_special_tokens)
            else:
                raise invalid("one of text or messages is required", param="input")
        except GatewayError as e:
            await abort_with(context, e)
            return
        toks = [core.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return generate_pb2.TokenizeResponse(token_ids=ids, tokens=toks)

    async def ModelInfo(self, request, context):  # noqa: N802
        i = self.core.info
        return generate_pb2.ModelInfoResponse(
            model=self.core.model_name, arch=i.get("arch", ""), vocab_size=self.core.vocab_size,
            max_model_len=self.core.max_model_len, eos_token_ids=list(self.core.eos_token_ids),
            num_layers=i.get("num_layers", 0), block_size=i.get("block_size", 0),
            kv_cache_dtype=i.get("kv_cache_dtype", ""))


def add_to_server(server, core: GatewayCore, default_max_tokens: int | None,
                  max_tokens_over_context: str = "error", max_prompt_bytes: int = 1 << 20) -> None:
    """Generation's handlers with this module's request parsing (see the module docstring)."""
    s = GenerationServicer(core, Limits(core.max_model_len, core.vocab_size, default_max_tokens,
                                        max_tokens_over_context, max_prompt_bytes))
    pb = generate_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            s.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            s.Tokenize, request_deserializer=_lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            s.ModelInfo, request_deserializer=_lenient(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
