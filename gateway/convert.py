"""engine.SamplingParams <-> protobuf (splitserve.v1.SamplingParams / internal RequestParams)."""
from __future__ import annotations

from engine.sampling_params import InvalidRequestError, SamplingParams
from gateway.types import invalid

_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "logprobs", "min_tokens")


def make_sampling_params(**kw) -> SamplingParams:
    """SamplingParams(**kw) with InvalidRequestError/TypeError turned into INVALID_ARGUMENT."""
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise invalid(str(e)) from None
    except TypeError as e:
        raise invalid(f"invalid sampling parameters: {e}") from None


def sampling_from_pb(sp, max_tokens: int, stop, stop_token_ids, ignore_eos: bool) -> SamplingParams:
    """splitserve.v1.SamplingParams (+ GenerateRequest fields) -> engine SamplingParams.
    Unset optional fields keep the engine defaults."""
    kw = {}
    for f in _OPTIONAL_FIELDS:
        if sp is not None and sp.HasField(f):
            v = getattr(sp, f)
            # float32 on the wire: 0.9 arrives as 0.8999999761...; round to what was meant
            kw[f] = round(v, 6) if isinstance(v, float) else int(v)
    return make_sampling_params(max_tokens=int(max_tokens), stop=tuple(stop),
                                stop_token_ids=tuple(int(t) for t in stop_token_ids),
                                ignore_eos=bool(ignore_eos), **kw)


def sampling_to_pb(p: SamplingParams):
    from protos import generate_pb2

    sp = generate_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, min_tokens=p.min_tokens)
    if p.seed is not None:
        sp.seed = p.seed
    if p.logprobs is not None:
        sp.logprobs = p.logprobs
    return sp


def request_params_pb(p: SamplingParams):
    from protos import common_pb2

    return common_pb2.RequestParams(
        sampling=sampling_to_pb(p), max_tokens=p.max_tokens, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output)
