"""The public API's protobuf -> engine.SamplingParams (the internal RequestParams both ways:
common/convert.py)."""
from __future__ import annotations

from common.convert import sampling_kwargs
from engine.sampling_params import InvalidRequestError, SamplingParams
from gateway.types import invalid


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
    return make_sampling_params(max_tokens=int(max_tokens), stop=tuple(stop),
                                stop_token_ids=tuple(int(t) for t in stop_token_ids),
                                ignore_eos=bool(ignore_eos), **sampling_kwargs(sp))
