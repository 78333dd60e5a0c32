"""load_model fails with a ModelLoadError naming the problem, for every bad source."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.config import ModelConfig
from engine.loader import ModelLoadError, load_model


def _load(spec: str):
    return load_model(ModelConfig(model=spec), "cpu", torch.float32)


def _copy_dir(src: str, dst) -> str:
    d = str(dst / "m")
    shutil.copytree(src, d)
    return d


def test_unknown_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        _load(str(tmp_path / "nope"))


def test_model_load_error_is_value_error():
    assert issubclass(ModelLoadError, ValueError)


def test_missing_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json"):
        _load(str(tmp_path))


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        _load(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*gpt2"):
        _load(str(tmp_path))


@pytest.mark.parametrize("extra", [{"hidden_act": "gelu"}, {"mlp_bias": True}])
def test_unsupported_variants(tiny_hf_dirs, tmp_path, extra):
    d = _copy_dir(tiny_hf_dirs["llama"][1], tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.update(extra)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match="unsupported"):
        _load(d)


def test_unsupported_rope_scaling(tiny_hf_dirs, tmp_path):
    d = _copy_dir(tiny_hf_dirs["llama"][1], tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match="yarn"):
        _load(d)


def test_no_safetensors(tiny_hf_dirs, tmp_path):
    d = _copy_dir(tiny_hf_dirs["llama"][1], tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="safetensors"):
        _load(d)


def test_truncated_safetensors(tiny_hf_dirs, tmp_path):
    d = _copy_dir(tiny_hf_dirs["llama"][1], tmp_path)
    f = os.path.join(d, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated.*model.safetensors|model.safetensors.*truncated"):
        _load(d)


def test_garbage_safetensors_header(tiny_hf_dirs, tmp_path):
    d = _copy_dir(tiny_hf_dirs["llama"][1], tmp_path)
    open(os.path.join(d, "model.safetensors"), "wb").write(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        _load(d)


def test_missing_shard_in_index(tiny_hf_dirs, tmp_path):
    d = _copy_dir(tiny_hf_dirs["llama"][1], tmp_path)
    json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        _load(d)


def test_garbage_gguf(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="x.gguf"):
        _load(str(f))


def test_truncated_gguf(smollm2_gguf, tmp_path):
    f = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        f.write_bytes(src.read(2 << 20))  # metadata intact, tensor data cut
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        _load(str(f))


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        _load(str(f))


def test_unknown_dummy_shape():
    with pytest.raises(ModelLoadError, match="tiny-llama"):
        _load("dummy:gpt-5")


def test_corrupt_tokenizer_json(tiny_hf_dirs, tmp_path):
    d = _copy_dir(tiny_hf_dirs["llama"][1], tmp_path)
    open(os.path.join(d, "tokenizer.json"), "w").write('{"version": "1.0", "model": 42}')
    with pytest.raises(ModelLoadError, match="tokenizer"):
        _load(d)
