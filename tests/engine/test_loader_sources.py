"""load_model on good sources: sharded HF dirs, tokenizer/generation config pick-up, dummy
shapes (deterministic, right sizes), and the model's weight-name checks."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.config import ModelConfig
from engine.loader import load_model
from engine.loader.dummy import SHAPES, weight_shapes
from tests.conftest import build_model, make_kv, make_meta


def _load(spec: str, dtype=torch.float32, seed: int = 0):
    return load_model(ModelConfig(model=spec, seed=seed), "cpu", dtype)


def test_sharded_dir_equals_single_file(tiny_hf_dirs, tmp_path):
    hf, path = tiny_hf_dirs["qwen2"]
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    a = dict(_load(path).weights)
    b = dict(_load(sharded).weights)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_weights_in_target_dtype(tiny_hf_dirs):
    loaded = _load(tiny_hf_dirs["llama"][1], torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for _, t in loaded.weights)


def test_generation_config_eos_and_tokenizer(tiny_hf_dirs, hf_smollm2_tokenizer, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(tiny_hf_dirs["llama"][1], d)
    json.dump({"eos_token_id": [2, 7]}, open(os.path.join(d, "generation_config.json"), "w"))
    hf_smollm2_tokenizer.save_pretrained(d)
    loaded = _load(d)
    assert loaded.arch.eos_token_ids == (2, 7)
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("hello world") == hf_smollm2_tokenizer.encode("hello world")
    assert set(loaded.tokenizer.eos_token_ids) >= {2, 7}
    assert loaded.name == "m"


def test_dir_without_tokenizer_has_none(tiny_hf_dirs):
    assert _load(tiny_hf_dirs["mistral"][1]).tokenizer is None


def test_dummy_shape_sizes():
    approx = {"llama-3.1-8b": 8.03e9, "llama-3.2-1b": 1.24e9, "smollm2-135m": 134.5e6}
    for name, n in approx.items():
        a = SHAPES[name]
        assert abs(a.num_params() - n) / n < 0.01, name
        assert sum(torch.Size(s).numel() for _, s in weight_shapes(a)) == a.num_params()
    assert SHAPES["llama-3.1-8b"].rope_scaling["rope_type"] == "llama3"
    for a in SHAPES.values():  # biases (tiny-qwen2) counted too
        assert sum(torch.Size(s).numel() for _, s in weight_shapes(a)) == a.num_params()


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])
def test_dummy_tiny_runs_and_is_seeded(shape):
    a1 = dict(_load(f"dummy:{shape}", seed=1).weights)
    a2 = dict(_load(f"dummy:{shape}", seed=1).weights)
    b = dict(_load(f"dummy:{shape}", seed=2).weights)
    k = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a1[k], a2[k]) and not torch.equal(a1[k], b[k])
    assert abs(a1[k].std().item() - 0.02) < 0.003
    loaded = _load(f"dummy:{shape}")
    assert loaded.name == f"dummy-{shape}" and loaded.tokenizer is not None
    model = build_model(loaded)
    ids = loaded.tokenizer.encode("hi there")
    pos, meta = make_meta([([0], 0, len(ids))], 16)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), pos, make_kv(loaded.arch, 1, 16), meta))
    assert logits.shape == (len(ids), loaded.arch.vocab_size) and torch.isfinite(logits).all()


def test_load_weights_rejects_bad_names_and_shapes():
    loaded = _load("dummy:tiny-llama")
    w = dict(loaded.weights)
    model = build_model(_load("dummy:tiny-llama"))
    with pytest.raises(ValueError, match="unexpected tensor"):
        model.load_weights([("model.layers.0.self_attn.foo.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights([(k, v) for k, v in w.items() if "down_proj" not in k])
    with pytest.raises(ValueError, match="layer 5"):
        model.load_weights([("model.layers.5.mlp.up_proj.weight", w["model.layers.0.mlp.up_proj.weight"])])
