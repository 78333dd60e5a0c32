"""Public gRPC front: splitserve.v1.Generation (Generate stream, Tokenize, ModelInfo).
Thin: GenerateRequest -> GenRequest, GatewayCore.generate -> GenerateResponse stream."""
from __future__ import annotations

import logging


from gateway.convert import sampling_from_pb
from gateway.core import GatewayCore
from gateway.types import GatewayError, GenChunk, GenRequest, invalid
from protos import generate_pb2, generate_pb2_grpc

log = logging.getLogger("splitserve.gateway.grpc")

_FINISH_PB = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH,
              "abort": generate_pb2.FINISH_REASON_ABORT, "error": generate_pb2.FINISH_REASON_ERROR}


def chat_to_ids(core: GatewayCore, msgs_pb) -> list[int]:
    if core.tokenizer is None:
        raise invalid("this model has no tokenizer: send token_ids", param="messages")
    messages = [{"role": m.role, "content": m.content} for m in msgs_pb.messages]
    if not messages:
        raise invalid("messages is empty", param="messages")
    add_gen = msgs_pb.add_generation_prompt if msgs_pb.HasField("add_generation_prompt") else True
    try:
        text = core.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen)
    except ValueError as e:
        raise invalid(f"messages: {e}", param="messages") from None
    # NOTE: the template already holds the special tokens (bos etc.)
    return core.tokenizer.encode(text, add_special_tokens=False)


def request_from_pb(core: GatewayCore, pb, default_max_tokens: int | None) -> GenRequest:
    which = pb.WhichOneof("input")
    if which is None:
        raise invalid("one of prompt, messages or token_ids is required", param="input")
    if which == "prompt":
        if pb.prompt == "":
            raise invalid("prompt is empty", param="prompt")
        if core.tokenizer is None:
            raise invalid("this model has no tokenizer: send token_ids", param="prompt")
        ids = core.tokenizer.encode(pb.prompt, add_special_tokens=True)
        op = "text_completion"
    elif which == "messages":
        ids, op = chat_to_ids(core, pb.messages), "chat"
    else:
        ids, op = list(pb.token_ids.ids), "text_completion"
    # unset: the gateway's default, else until an end token or the end of the context
    max_tokens = pb.max_tokens or default_max_tokens or max(1, core.max_model_len - len(ids))
    params = sampling_from_pb(pb.sampling if pb.HasField("sampling") else None,
                              max_tokens, pb.stop, pb.stop_token_ids, pb.ignore_eos)
    slo = pb.slo if pb.HasField("slo") else None
    return GenRequest(
        request_id=pb.request_id or core.new_request_id(), prompt_token_ids=ids, params=params,
        ttft_slo_ms=float(slo.ttft_ms) if slo is not None and slo.HasField("ttft_ms") else None,
        tpot_slo_ms=float(slo.tpot_ms) if slo is not None and slo.HasField("tpot_ms") else None,
        priority=pb.priority, want_text=not pb.skip_text, operation=op)


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


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, core: GatewayCore, default_max_tokens: int | None = None):
        self.core = core
        self.default_max_tokens = default_max_tokens

    async def Generate(self, request, context):  # noqa: N802
        try:
            req = request_from_pb(self.core, request, self.default_max_tokens)
            async for chunk in self.core.generate(req, metadata=context.invocation_metadata()):
                yield chunk_to_pb(req.request_id, chunk)
        except GatewayError as e:
            await abort_with(context, e)

    async def Tokenize(self, request, context):  # noqa: N802
        core = self.core
        try:
            which = request.WhichOneof("input")
            if core.tokenizer is None:
                raise invalid("this model has no tokenizer")
            if which == "messages":
                ids = chat_to_ids(core, request.messages)
            elif which == "text":
                ids = core.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
            else:
                raise invalid("one of text or messages is required")
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


def add_to_server(server, core: GatewayCore, default_max_tokens: int | None) -> None:
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(core, default_max_tokens),
                                                      server)
