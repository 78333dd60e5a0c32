"""Protobuf <-> engine objects, at the servicer edge only (pb messages go no deeper).

    params_from_pb(common_pb2.RequestParams) -> engine SamplingParams (raises InvalidRequestError)
    params_to_pb(SamplingParams) -> common_pb2.RequestParams (the gateway's too)
    sampling_kwargs(generate_pb2.SamplingParams) -> SamplingParams keywords of its set fields
    guided_from_pb / guided_to_pb: GuidedDecoding <-> engine GuidedJSON (response_format)
    logprob_to_pb((logprob, [(id, lp), ...]) | None, token_id) -> generate_pb2.TokenLogprob
    load_to_pb(engine stats dict, **extra) -> common_pb2.LoadStats
    FINISH_REASONS: engine finish_reason str -> generate_pb2.FinishReason
"""
from __future__ import annotations

import math

from engine.sampling_params import GuidedJSON, InvalidRequestError, SamplingParams
from protos import common_pb2, generate_pb2

# the optional fields of SamplingParams messages (unset: the engine's default)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "logprobs", "min_tokens")

FINISH_REASONS = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
    "error": generate_pb2.FINISH_REASON_ERROR,
}


def sampling_kwargs(sp: generate_pb2.SamplingParams | None) -> dict:
    """The fields set in a SamplingParams message, as SamplingParams keywords."""
    kw = {}
    for f in SAMPLING_FIELDS:
        if sp is not None and sp.HasField(f):
            v = getattr(sp, f)
            if isinstance(v, float) and not math.isfinite(v):
                # NaN passes every range check of SamplingParams (and then samples the end token)
                raise InvalidRequestError(f"sampling.{f} must be a finite number, got {v}")
            # NOTE: proto floats are float32; round so 0.7 stays 0.7, not 0.69999999
            kw[f] = round(v, 6) if isinstance(v, float) else int(v)
    if sp is not None and sp.HasField("guided"):
        kw["guided"] = guided_from_pb(sp.guided)
    return kw


def guided_from_pb(g: generate_pb2.GuidedDecoding) -> GuidedJSON:
    kind = g.WhichOneof("kind")
    if kind == "json_schema":
        return GuidedJSON(schema=g.json_schema)
    if kind == "json_object" and g.json_object:
        return GuidedJSON()
    raise InvalidRequestError("sampling.guided must set json_object (true) or json_schema")


def guided_to_pb(g: GuidedJSON) -> generate_pb2.GuidedDecoding:
    if g.schema is None:
        return generate_pb2.GuidedDecoding(json_object=True)
    return generate_pb2.GuidedDecoding(json_schema=g.schema)


def params_from_pb(p: common_pb2.RequestParams) -> SamplingParams:
    if not p.max_tokens:
        raise InvalidRequestError("max_tokens must be >= 1")
    return SamplingParams(max_tokens=int(p.max_tokens), stop=tuple(p.stop),
                          stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
                          ignore_eos=p.ignore_eos,
                          include_stop_str_in_output=p.include_stop_str_in_output,
                          **sampling_kwargs(p.sampling))


def params_to_pb(sp: SamplingParams) -> common_pb2.RequestParams:
    s = generate_pb2.SamplingParams()
    for f in SAMPLING_FIELDS:
        v = getattr(sp, f)
        if v is not None:
            setattr(s, f, v)
    if sp.guided is not None:
        s.guided.CopyFrom(guided_to_pb(sp.guided))
    return common_pb2.RequestParams(
        sampling=s, max_tokens=sp.max_tokens, stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output)


def logprob_to_pb(lp, token_id: int) -> generate_pb2.TokenLogprob | None:
    if lp is None:
        return None
    chosen, top = lp
    return generate_pb2.TokenLogprob(
        token_id=int(token_id), logprob=float(chosen),
        top=[generate_pb2.TopLogprob(token_id=int(i), logprob=float(v)) for i, v in top])


def load_to_pb(stats: dict, **extra) -> common_pb2.LoadStats:
    q, h = stats.get("prefix_queries") or 0, stats.get("prefix_hits") or 0
    steps = [float(x) for x in stats.get("recent_step_ms") or []]
    msg = common_pb2.LoadStats(
        running=int(stats.get("running", 0)), waiting=int(stats.get("waiting", 0)),
        kv_usage=float(stats.get("kv_usage", 0.0)),
        queued_tokens=int(stats.get("waiting_tokens", 0)),
        num_free_blocks=int(stats.get("num_free_blocks", 0)),
        num_total_blocks=int(stats.get("num_blocks", 0)),
        recent_step_ms=steps, mean_step_ms=sum(steps) / len(steps) if steps else 0.0,
        prefix_hit_rate=h / q if q else 0.0, max_num_seqs=int(stats.get("max_num_seqs", 0)),
        max_num_batched_tokens=int(stats.get("max_num_batched_tokens", 0)))
    for k, v in extra.items():
        setattr(msg, k, v)
    return msg


def merge_decode_response(into, later) -> None:
    """Append DecodeResponse `later` to `into` (its tokens, text, logprobs; its finish fields
    and count): a stream's messages that queued up behind a slow reader leave as one."""
    into.token_ids.extend(later.token_ids)
    into.text += later.text
    into.logprobs.extend(later.logprobs)
    into.finish_reason = later.finish_reason
    into.stop_reason = later.stop_reason
    into.num_generated = later.num_generated
