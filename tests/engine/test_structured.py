"""Structured output in the engine: the bitmask we unpack and apply equals xgrammar's own
(its matcher's mask and its apply kernel), the sampler with and without masks, and the
embedded SmolLM2 producing JSON valid against a schema (greedy and sampled, on one engine
and joined on a decode engine after a prefilled first token)."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.layers.sampler import Sampler, SamplingBatch
from engine.request import Request
from engine.sampling_params import GuidedJSON, InvalidRequestError, SamplingParams
from engine.structured import GrammarBackend, apply_bitmask, unpack_bitmask

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
SPEC = GuidedJSON(json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine():
    # one intra-op thread: on a shared, loaded 2-core machine more threads spin against others
    return Engine(EngineConfig(model=ModelConfig("default", dtype="fp32", max_model_len=256),
                               cache=CacheConfig(num_blocks=48), device=DeviceConfig(cpu_threads=1)))


@pytest.fixture(scope="module")
def tokenizer():
    from engine.loader import default_gguf_path
    from engine.loader.gguf import _open, read_metadata
    from engine.loader.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_metadata(_open(default_gguf_path())))


V = 49152  # SmolLM2's vocabulary (the model's lm_head rows)


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, V, tokenizer.eos_token_ids)


def _ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                      add_special_tokens=False)


def test_unpack_matches_bits():
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32)
    allowed = unpack_bitmask(bits, 150)
    assert allowed.shape == (3, 150)
    for r in range(3):
        for t in range(150):
            assert bool(allowed[r, t]) == bool((int(bits[r, t // 32]) >> (t % 32)) & 1)


def test_mask_equals_xgrammar_along_a_valid_output(tokenizer, backend):
    """At every position of a valid JSON text: our applied mask == xgrammar's apply kernel on
    its matcher's bitmask, and the text's next token is allowed."""
    state = backend.state(SPEC)
    ref = xgr.GrammarMatcher(backend.compile(SPEC))
    text = json.dumps({"name": "Bob", "age": 33, "ok": True})
    toks = tokenizer.encode(text, add_special_tokens=False)
    logits = torch.randn(2, V)
    for t in toks:
        ours, theirs = backend.new_bitmask(1), xgr.allocate_token_bitmask(1, V)
        state.fill(ours, 0)
        ref.fill_next_token_bitmask(theirs, 0)
        assert torch.equal(ours, theirs)
        bits = torch.cat([torch.full_like(ours, -1), ours])  # row 0: no grammar
        got = apply_bitmask(logits, bits)
        want = logits[1:].clone()
        xgr.apply_token_bitmask_inplace(want, theirs)
        assert torch.equal(got[1], want[0]) and torch.equal(got[0], logits[0])
        assert got[1, t] != float("-inf")
        assert not state.terminated
        assert state.accept(t) and ref.accept_token(t)
    assert state.terminated and state.complete  # only the end token may follow: done already


def _batch(reqs):
    return SamplingBatch.from_requests(reqs, V, "cpu")


def test_sampler_with_and_without_masks(tokenizer, backend):
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    plain = [Request(f"p{i}", [1], SamplingParams(temperature=0.0)) for i in range(3)]
    b = _batch(plain)
    assert b.grammar_bitmask is None and b.greedy_only
    assert Sampler()(logits, b).token_ids == logits.argmax(-1).tolist()
    # row 1 constrained: greedy picks its best allowed token; rows 0 and 2 are untouched
    reqs = list(plain)
    reqs[1] = Request("g", [1], SamplingParams(temperature=0.0, guided=SPEC))
    reqs[1].grammar = backend.state(SPEC)
    b = _batch(reqs)
    assert b.grammar_host == (1,) and not b.greedy_only and b.step_dependent
    allowed = unpack_bitmask(b.grammar_bitmask, V)[1]
    assert unpack_bitmask(b.grammar_bitmask, V)[[0, 2]].all()  # free rows: all allowed
    out = Sampler()(logits, b).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[1] == logits[1].masked_fill(~allowed, float("-inf")).argmax()
    assert tokenizer.decode([out[1]]).startswith("{")
    # sampled rows (temperature 1, seeded) only ever draw allowed tokens
    samp = [Request(f"s{i}", [1], SamplingParams(temperature=1.0, seed=i, guided=SPEC))
            for i in range(4)]
    for r in samp:
        r.grammar = backend.state(SPEC)
    b = _batch(samp)
    for _ in range(3):
        toks = Sampler()(torch.randn(4, V) * 5, b).token_ids
        assert all(bool(allowed[t]) for t in toks)


def test_min_tokens_does_not_ban_the_grammars_end(tokenizer, backend):
    r = Request("m", [1], SamplingParams(min_tokens=5, guided=SPEC), eos_token_ids=tokenizer.eos_token_ids)
    r.grammar = backend.state(SPEC)
    assert _batch([r]).ban_rows is None


def _check(engine, out: list[int], schema=SCHEMA):
    text = engine.tokenizer.decode(out)
    doc = json.loads(text)
    jsonschema.validate(doc, schema)
    return doc


def test_smollm2_json_schema_and_object(engine):
    """Greedy and sampled rows in one batch: each output is JSON valid against the schema."""
    p = _ids(engine, "Describe a person as JSON.")
    for i, temp in enumerate((0.0, 1.0)):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=40, temperature=temp, seed=3,
                                                      guided=SPEC))
    engine.add_request("obj", _ids(engine, "Reply with a JSON object."),
                       SamplingParams(max_tokens=12, temperature=0.0, guided=GuidedJSON()))
    got: dict[str, list[int]] = {"s0": [], "s1": [], "obj": []}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    _check(engine, got["s0"])
    _check(engine, got["s1"])
    assert engine.tokenizer.decode(got["obj"]).startswith("{")  # 12 tokens: maybe cut short


def test_decode_side_join_continues_the_grammar(engine):
    """add_prefilled: the grammar is rebuilt from the spec and takes prefill's first token;
    a first token the grammar refuses is INVALID_ARGUMENT."""
    p = _ids(engine, "Describe a person as JSON.")
    params = SamplingParams(max_tokens=40, temperature=0.0, guided=SPEC)
    first = engine.tokenizer.encode('{"', add_special_tokens=False)
    assert len(first) == 1
    assert engine.reserve("j1", len(p))
    assert engine.add_prefilled("j1", p, first[0], params) is None
    got = [first[0]]
    while "j1" in engine.requests:
        for o in engine.step():
            if o.request_id == "j1":
                got += o.new_token_ids
    _check(engine, got)
    assert engine.reserve("j2", len(p))
    bad = engine.tokenizer.encode("hello", add_special_tokens=False)[0]
    with pytest.raises(InvalidRequestError, match="response_format"):
        engine.add_prefilled("j2", p, bad, params)
    engine.release("j2")


@pytest.mark.parametrize("schema, match", [
    ('{"type": "objectx"}', "objectx"),
    ('{"type": "string", "pattern": "(?<=a)b"}', "Lookbehind"),
    ('{"$ref": "#/nope"}', "nope"),
])
def test_unsupported_schema_is_invalid_request(backend, schema, match):
    with pytest.raises(InvalidRequestError, match=rf"response_format\.json_schema: .*{match}"):
        backend.compile(GuidedJSON(schema))


def test_schema_must_be_a_json_object():
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        GuidedJSON("{nope")
    with pytest.raises(InvalidRequestError, match="must be a JSON object"):
        GuidedJSON("[1]")


def test_missing_library_is_invalid_request(monkeypatch, tokenizer):
    import builtins

    real = builtins.__import__

    def no_xgrammar(name, *a, **kw):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'", name="xgrammar")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    fresh = GrammarBackend(tokenizer, V, tokenizer.eos_token_ids)
    with pytest.raises(InvalidRequestError, match=r"splitserve\[structured\]"):
        fresh.compile(GuidedJSON())


def test_guided_crosses_the_wire():
    """RequestParams (gateway -> prefill -> decode) carry the spec; an empty GuidedDecoding is
    INVALID_ARGUMENT."""
    from common.convert import params_from_pb, params_to_pb, sampling_kwargs
    from protos import generate_pb2

    for g in (SPEC, GuidedJSON()):
        assert params_from_pb(params_to_pb(SamplingParams(guided=g))).guided == g
    assert params_from_pb(params_to_pb(SamplingParams())).guided is None
    with pytest.raises(InvalidRequestError, match="sampling.guided"):
        sampling_kwargs(generate_pb2.SamplingParams(guided=generate_pb2.GuidedDecoding()))
