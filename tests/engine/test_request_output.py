"""RequestOutput's leading fields are built positionally on the decode hot path
(Engine._complete); their order is part of that contract. And RequestStatus.is_finished."""
from __future__ import annotations

import dataclasses

from engine.request import Request, RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams


def test_the_leading_fields_engine_complete_passes_by_position():
    names = [f.name for f in dataclasses.fields(RequestOutput)]
    assert names[:7] == ["request_id", "new_token_ids", "finished", "finish_reason", "logprobs",
                         "num_prompt_tokens", "num_cached_tokens"]


def test_a_running_rows_output_is_the_same_built_either_way():
    from tests.tiny_engine import tiny_engine

    eng = tiny_engine(128, 64, "cpu")
    eng.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=4, ignore_eos=True,
                                                             temperature=0.0))
    outs = [o for _ in range(6) for o in eng.step()]
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    first, mid, last = outs[0], outs[1], outs[-1]
    assert first.queue_s is not None and first.prefill_s is not None  # the keyword path
    want = RequestOutput("a", mid.new_token_ids, finished=False, finish_reason=None, logprobs=[],
                         num_prompt_tokens=20, num_cached_tokens=mid.num_cached_tokens)
    assert mid == want  # the positional path: every field where the keyword path puts it
    assert last.finished and last.finish_reason == "length"


def test_is_finished_matches_the_finished_statuses():
    fin = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
           RequestStatus.FINISHED_ABORTED}
    for s in RequestStatus:
        assert s.is_finished == s.finished == (s in fin)
        r = Request("r", [1], SamplingParams(), status=s)
        assert r.finished == (s in fin)
