"""One engine-level handoff for the disaggregation tests: prefill a prompt-only request on one
engine, and decode the rest on another once its KV is imported."""
from __future__ import annotations


def prefill_outputs(pre, rid: str, prompt: list[int], params) -> list:
    """Run `rid` as a prefill-only request on `pre` to the end; -> every output it gave (the
    last one's first token is the request's first token)."""
    pre.add_request(rid, prompt, params, prefill_only=True)
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    return outs


def decode_to_end(dec, first: int) -> list[int]:
    """Step `dec` until nothing is left; -> `first` and every token sampled after it."""
    toks = [first]
    while dec.has_unfinished():
        for o in dec.step():
            toks += o.new_token_ids
    return toks
