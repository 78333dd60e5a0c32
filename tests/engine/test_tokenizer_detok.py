"""IncrementalDetokenizer: streamed deltas equal a full decode, never split a UTF-8 character,
hold back possible stop-string prefixes, and cut at a matched stop string."""
from __future__ import annotations

import random

import pytest

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_tok():
    # one token per byte: every multi-byte character is split across tokens
    return Tokenizer.byte_level(512, bos_token_id=256, eos_token_ids=(257,))


def _stream(tok, ids, params=SamplingParams(), prompt=(), chunk=1):
    d = tok.detokenizer(list(prompt), params)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        delta, s = d.step(ids[i:i + chunk])
        deltas.append(delta)
        stop = stop or s
    deltas.append(d.flush())
    return deltas, stop


def test_emoji_split_across_tokens_never_partial(byte_tok):
    text = "a😀b👨‍👩‍👧c日本"
    ids = byte_tok.encode(text)
    assert len(ids) == len(text.encode())
    deltas, stop = _stream(byte_tok, ids)
    assert stop is None
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # the three middle bytes of 😀 give no output; its last byte gives the whole character
    assert deltas[1:5] == ["", "", "", "😀"]


def test_matches_full_decode_random_smollm2(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rng = random.Random(0)
    text = "Streaming 😀 works — naïve café 日本語 👍🏽 123 done.\n"
    ids = tok.encode(text)
    deltas, _ = _stream(tok, ids, prompt=tok.encode("<|im_start|>assistant\n"))
    assert "".join(deltas) == text
    for _ in range(5):  # random ids: whatever the bytes, streaming == one decode
        ids = [rng.randrange(0, tok.vocab_size) for _ in range(40)]
        deltas, _ = _stream(tok, ids, chunk=rng.choice([1, 3]))
        assert "".join(deltas) == tok.decode(ids)


def test_stop_string_cut_and_held_back(byte_tok):
    p = SamplingParams(stop=("STOP",))
    ids = byte_tok.encode("hello STOP world")
    deltas, stop = _stream(byte_tok, ids, p)
    assert stop == "STOP"
    assert "".join(deltas) == "hello "
    # while "S", "ST", "STO" arrive nothing past "hello " is emitted
    assert "".join(deltas[:7]) == "hello "


def test_stop_string_included(byte_tok):
    p = SamplingParams(stop=("STOP",), include_stop_str_in_output=True)
    deltas, stop = _stream(byte_tok, byte_tok.encode("hello STOP world"), p)
    assert stop == "STOP" and "".join(deltas) == "hello STOP"


def test_false_prefix_is_released(byte_tok):
    p = SamplingParams(stop=("STOP",))
    deltas, stop = _stream(byte_tok, byte_tok.encode("a STO b ST"), p)
    assert stop is None
    assert "".join(deltas[:-1]) == "a STO b "  # "ST" held until the end
    assert deltas[-1] == "ST"  # flush releases it


def test_earliest_of_several_stops_and_chunks(byte_tok):
    p = SamplingParams(stop=("world", "lo w", "xyz"))
    deltas, stop = _stream(byte_tok, byte_tok.encode("hello world"), p, chunk=4)
    assert stop == "lo w" and "".join(deltas) == "hel"


def test_stop_spanning_multibyte_tokens(byte_tok):
    p = SamplingParams(stop=("😀!",))
    deltas, stop = _stream(byte_tok, byte_tok.encode("ok 😀 then 😀! gone"), p)
    assert stop == "😀!" and "".join(deltas) == "ok 😀 then "


def test_after_stop_nothing_more(byte_tok):
    d = byte_tok.detokenizer([], SamplingParams(stop=("x",)))
    assert d.step(byte_tok.encode("ax")) == ("a", "x")
    assert d.step(byte_tok.encode("bbb")) == ("", None)
    assert d.flush() == ""


def test_incomplete_utf8_at_end_flushed(byte_tok):
    ids = byte_tok.encode("ok😀")[:-1]  # model stopped mid-character
    d = byte_tok.detokenizer([], SamplingParams())
    assert d.step(ids) == ("ok", None)
    assert d.flush() == "\ufffd"
