"""Hypothesis strategies for the fuzz suite: REST bodies (OpenAI completions / chat, vLLM
tokenize / detokenize) and gRPC Generate / Tokenize messages. Each field is drawn from a mix of
valid values (so requests also reach generation) and hostile ones (out of range, NaN,
surrogates, wrong types, junk JSON)."""
from __future__ import annotations

import json

import grpc
from hypothesis import strategies as st

from protos import generate_pb2

MODEL = "dummy-tiny-llama"
ROLES = ["system", "user", "assistant", "tool", "developer"]
EDGE_INTS = [0, -1, 1, 255, 256, 511, 512, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
             (1 << 63) - 1, 1 << 63, -(1 << 63) - 1, 10 ** 30]
EDGE_FLOATS = [0.0, 0.5, 1.0, 2.0, -0.0, -1.0, 1e308, -1e308, 5e-324, float("nan"),
               float("inf"), float("-inf")]
SURROGATES = ["\ud800", "a\udfffb", "\udbff"]

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=8)
texts = st.text(max_size=40) | st.sampled_from(SURROGATES)
ints = st.integers(-3, 40) | st.sampled_from(EDGE_INTS) | st.integers()
floats = st.floats(-3, 3) | st.sampled_from(EDGE_FLOATS) | st.floats()


hostile = st.one_of(ints, floats, junk, texts)


@st.composite
def body(draw, required: dict, optional: dict):
    """A body of valid values for `required` and some of `optional`, then up to two fields
    (any, or unknown) set to hostile values (none in about a third of the bodies)."""
    d = {k: draw(v) for k, v in required.items()}
    for k in draw(st.lists(st.sampled_from(sorted(optional)), max_size=5, unique=True)):
        d[k] = draw(optional[k])
    keys = sorted({*required, *optional, "unknown_field"})
    for k in draw(st.lists(st.sampled_from(keys), max_size=2, unique=True)):
        d[k] = draw(hostile)
    return d


SAMPLING = {  # typical values and the ends of each field's valid range
    "temperature": st.floats(0, 2) | st.sampled_from([1e-300, 100]),
    "top_p": st.floats(0.01, 1) | st.just(1e-6),
    "top_k": st.integers(-1, 50) | st.just((1 << 31) - 1),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2) | st.sampled_from([1e-6, 100]),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(-(1 << 63), (1 << 63) - 1), "min_tokens": st.integers(0, 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.text(min_size=1, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "ignore_eos": st.booleans(),
    "priority": st.integers(-5, 5), "ttft_ms": st.floats(1e4, 1e5), "tpot_ms": st.floats(1e3, 1e5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1), "response_format": st.just({"type": "text"}), "logit_bias": st.just({}),
    "slo": st.fixed_dictionaries({}, optional={"ttft_ms": st.floats(1e4, 1e5)}),
}
model = st.sampled_from([MODEL] * 8 + ["gpt-4o"])
prompt = (st.text(min_size=1, max_size=60) | st.lists(st.integers(0, 511), min_size=1, max_size=20)
          | st.sampled_from(SURROGATES) | st.lists(st.text(max_size=3), max_size=3))
part = st.fixed_dictionaries({"type": st.sampled_from(["text"] * 3 + ["image_url"]), "text": texts})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES * 3 + ["bot", ""])},
    optional={"content": texts | texts | st.lists(part, max_size=2) | st.none()})
messages = st.lists(message, min_size=1, max_size=3)

completion = body({"model": model, "prompt": prompt, "max_tokens": st.integers(1, 12)},
                  {**SAMPLING, "logprobs": st.integers(0, 5)})
chat = body({"model": model, "messages": messages, "max_tokens": st.integers(1, 12)},
            {**SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
             "max_completion_tokens": st.integers(1, 12)})
tokenize = body({}, {"model": model, "prompt": texts, "messages": messages,
                     "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                     "return_token_strs": st.booleans()})
detokenize = body({}, {"model": model, "tokens": st.lists(st.integers(0, 600), max_size=8)})


def _dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN / Infinity as JS literals, surrogates as \ud800


ctypes = st.sampled_from(["application/json"] * 12
                         + [None, "text/plain", "application/x-www-form-urlencoded"])
rest_request = st.one_of(
    st.tuples(st.just("/v1/completions"), completion.map(_dumps), ctypes),
    st.tuples(st.just("/v1/chat/completions"), chat.map(_dumps), ctypes),
    st.tuples(st.just("/tokenize"), tokenize.map(_dumps), ctypes),
    st.tuples(st.just("/detokenize"), detokenize.map(_dumps), ctypes),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              st.binary(max_size=64) | junk.map(_dumps)
              | st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n), ctypes),
)

# ---- gRPC -----------------------------------------------------------------------------------

u32 = (st.sampled_from([0, 1, 255, 256, 257, 511, 512, 1 << 31, (1 << 32) - 1])
       | st.integers(0, (1 << 32) - 1))
i32 = (st.sampled_from([-(1 << 31), -2, -1, 0, (1 << 31) - 1])
       | st.integers(-(1 << 31), (1 << 31) - 1))
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
f32 = st.sampled_from(EDGE_FLOATS) | st.floats(width=32)
ptext = st.text(max_size=40)  # protobuf strings are valid UTF-8 (no surrogates)

# valid values / hostile ones of the wire's type, per field
SAMPLING_PB = {
    "temperature": st.floats(0, 2, width=32), "top_p": st.floats(0.125, 1, width=32),
    "top_k": st.integers(-1, 50) | st.just((1 << 31) - 1), "min_p": st.floats(0, 1, width=32),
    "repetition_penalty": st.floats(0.5, 2, width=32),
    "presence_penalty": st.floats(-2, 2, width=32), "frequency_penalty": st.floats(-2, 2, width=32),
    "seed": i64, "logprobs": st.integers(0, 5), "min_tokens": st.integers(0, 1)}
SAMPLING_PB_BAD = {**{k: f32 for k in SAMPLING_PB}, "top_k": i32, "seed": i64, "logprobs": i32,
                   "min_tokens": i32}
TOP_PB = {"stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
          "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "ignore_eos": st.booleans(),
          "priority": st.integers(-5, 5), "skip_text": st.booleans(), "request_id": ptext,
          "slo": st.builds(generate_pb2.SLO, ttft_ms=st.integers(10_000, 100_000))}
TOP_PB_BAD = {"max_tokens": u32, "stop": st.lists(ptext, max_size=20),
              "stop_token_ids": st.lists(u32, max_size=3), "priority": i32,
              "slo": st.builds(generate_pb2.SLO, ttft_ms=u32, tpot_ms=u32)}


def _chat(msgs, agp):
    return generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in msgs],
        **({} if agp is None else {"add_generation_prompt": agp}))


chat_pb = st.builds(_chat, st.lists(st.tuples(st.sampled_from(ROLES * 3 + ["bot", ""]) | ptext,
                                              ptext), max_size=3), st.none() | st.booleans())
pb_input = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)}),
    st.fixed_dictionaries({"messages": chat_pb}),
    st.fixed_dictionaries({"token_ids": st.builds(generate_pb2.TokenIds, ids=st.lists(
        st.integers(0, 511), min_size=1, max_size=12))}),
    st.fixed_dictionaries({"token_ids": st.builds(generate_pb2.TokenIds,
                                                  ids=st.lists(u32, max_size=5))}),
    st.fixed_dictionaries({"prompt": st.just("")}), st.just({}))


@st.composite
def generate_pb(draw):
    """A GenerateRequest of valid fields, then up to two set to hostile values of their type."""
    samp = {k: draw(SAMPLING_PB[k]) for k in draw(st.lists(st.sampled_from(sorted(SAMPLING_PB)),
                                                            max_size=4, unique=True))}
    top = {"max_tokens": draw(st.integers(1, 12))}
    top.update({k: draw(TOP_PB[k]) for k in draw(st.lists(st.sampled_from(sorted(TOP_PB)),
                                                            max_size=3, unique=True))})
    bad = sorted({*SAMPLING_PB_BAD, *TOP_PB_BAD})
    for k in draw(st.lists(st.sampled_from(bad), max_size=2, unique=True)):
        if k in SAMPLING_PB_BAD:
            samp[k] = draw(SAMPLING_PB_BAD[k])
        else:
            top[k] = draw(TOP_PB_BAD[k])
    sp = generate_pb2.SamplingParams(**samp) if samp else None
    return generate_pb2.GenerateRequest(**draw(pb_input), sampling=sp, **top)


tokenize_pb = st.one_of(
    st.builds(lambda t, a: generate_pb2.TokenizeRequest(text=t, add_special_tokens=a), ptext,
              st.booleans()),
    st.builds(lambda m: generate_pb2.TokenizeRequest(messages=m), chat_pb),
    st.just(generate_pb2.TokenizeRequest()))
grpc_request = st.one_of(
    st.tuples(st.just("Generate"), generate_pb().map(lambda m: m.SerializeToString())),
    st.tuples(st.just("Generate"), generate_pb().map(lambda m: m.SerializeToString())),
    st.tuples(st.just("Generate"), generate_pb().map(lambda m: m.SerializeToString())),
    st.tuples(st.just("Tokenize"), tokenize_pb.map(lambda m: m.SerializeToString())),
    st.tuples(st.sampled_from(["Generate", "Tokenize"]), st.binary(max_size=48)),
)


def raw_grpc_caller(channel: grpc.Channel, timeout: float):
    """-> call((method, raw bytes)) -> (status code, details): one grpc_request sent as it is
    (Generate read to its end)."""
    ident = dict(request_serializer=lambda x: x, response_deserializer=lambda x: x)
    generate = channel.unary_stream("/splitserve.v1.Generation/Generate", **ident)
    tokenize = channel.unary_unary("/splitserve.v1.Generation/Tokenize", **ident)

    def call(req) -> tuple[grpc.StatusCode, str]:
        method, raw = req
        try:
            if method == "Generate":
                for _ in generate(raw, timeout=timeout):
                    pass
            else:
                tokenize(raw, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""
    return call
