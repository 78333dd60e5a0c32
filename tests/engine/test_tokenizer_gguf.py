"""Our tokenizer built from the SmolLM2 GGUF metadata (no transformers at serving time) encodes,
decodes and renders chat templates exactly like HF's AutoTokenizer on the same file; the same
holds for a HF tokenizer directory (tokenizer.json + tokenizer_config.json)."""
from __future__ import annotations

import pytest

from engine.chat_template import ChatTemplateError
from engine.tokenizer import Tokenizer

pytest.importorskip("transformers")

TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "numbers 1234567 and 3.14159, dates 2024-01-31",
    "héllo naïve café — 日本語のテキスト, Ελληνικά, русский",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'll we've THEY'RE",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks 😀"}],
]


@pytest.fixture(scope="module")
def ours(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(ours, hf_smollm2_tokenizer, text):
    ids = ours.encode(text)
    assert ids == hf_smollm2_tokenizer.encode(text)
    assert ours.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf_smollm2_tokenizer.decode(ids)
    if "<|" not in text:
        assert ours.decode(ids) == text  # byte-level BPE round-trips exactly


def test_special_tokens(ours, hf_smollm2_tokenizer):
    assert ours.vocab_size == len(hf_smollm2_tokenizer) == 49152
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1
    assert ours.encode("<|im_end|>") == [2]
    assert ours.decode([1, 28120, 2]) == hf_smollm2_tokenizer.decode([1, 28120, 2], skip_special_tokens=True)


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_template_matches_hf(ours, hf_smollm2_tokenizer, chat, gen):
    msgs = CHATS[chat]
    want = hf_smollm2_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_hf_dir_tokenizer_matches_hf(hf_smollm2_tokenizer, tmp_path):
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    for t in TEXTS:
        assert tok.encode(t) == hf_smollm2_tokenizer.encode(t)
    for msgs in CHATS:
        assert tok.apply_chat_template(msgs) == hf_smollm2_tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)
    assert 2 in tok.eos_token_ids


def test_chat_template_errors():
    tok = Tokenizer.byte_level(512, bos_token_id=256, eos_token_ids=(257,))
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "x"}])
    tok.chat_template = "{% for m in messages %}"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{{ ''.__class__.__mro__ }}"  # sandbox: no attribute escape
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_default_template_without_own():
    tok = Tokenizer.byte_level(512, bos_token_id=256, eos_token_ids=(257,))
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_text_parts_content_flattened(ours):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(CHATS[0])
