"""Layer-by-layer KV export: every layer is handed out during the forward that completes the
prompt (layer 0 before the last layer's forward ends), byte-equal to export_kv after the fact,
also with chunked prefill and fp8; the id is claimed; a forward that skips the hook still
exports everything."""
from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.layer_stream import LayerStreamer
from engine.sampling_params import InvalidRequestError, SamplingParams

PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def _engine(kv_dtype="auto", max_batched=2048):
    return Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
                               cache=CacheConfig(num_blocks=64, kv_cache_dtype=kv_dtype),
                               scheduler=SchedulerConfig(max_num_batched_tokens=max_batched)))


def _run(eng, rid, prompt):
    got, steps = [], []
    eng.stream_kv_layers(rid, got.append)
    eng.add_request(rid, prompt, PARAMS, prefill_only=True)
    while eng.has_unfinished():
        eng.step()
        steps.append(len(got))
    return got, steps


def _bytes(t):
    return t.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_layers_stream_in_order_and_equal_export(kv_dtype):
    eng = _engine(kv_dtype)
    prompt = list(range(3, 40))  # 3 blocks, last one partial
    got, _ = _run(eng, "r", prompt)
    ref = eng.export_kv("r")
    assert [x.layer_idx for x in got] == list(range(eng.arch.num_layers))
    for x, t in zip(got, ref.layers):
        assert x.num_tokens == len(prompt) and x.tensor.shape == t.shape
        assert _bytes(x.tensor) == _bytes(t)
    if kv_dtype == "fp8_e4m3":
        assert [x.k_scale for x in got] == pytest.approx(ref.k_scales)
        assert [x.v_scale for x in got] == pytest.approx(ref.v_scales)
    else:
        assert got[0].k_scale is None
    assert "r" not in eng.layer_streamer.callbacks  # one prompt, one export
    eng.release("r")


def test_chunked_prefill_exports_only_in_the_last_chunk():
    eng = _engine(max_batched=16)
    prompt = list(range(3, 43))  # 40 tokens: chunks of 16, 16, 8
    got, steps = _run(eng, "r", prompt)
    assert steps == [0, 0, eng.arch.num_layers]
    for x, t in zip(got, eng.export_kv("r").layers):
        assert _bytes(x.tensor) == _bytes(t)
    eng.release("r")


def test_first_layer_is_handed_out_before_the_last_layer_finishes():
    eng = _engine()
    events = []
    last = eng.runner.model.layers[-1]
    orig = last.forward

    def traced(*a, **k):
        out = orig(*a, **k)
        events.append("last layer forward done")
        return out

    last.forward = traced
    eng.stream_kv_layers("r", lambda x: events.append(f"export {x.layer_idx}"))
    eng.add_request("r", list(range(3, 30)), PARAMS, prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    n = eng.arch.num_layers
    assert events.index("export 0") < events.index("last layer forward done") < events.index(f"export {n - 1}")
    eng.release("r")


def test_the_id_is_claimed_and_freed():
    eng = _engine()
    eng.stream_kv_layers("r", lambda x: None)
    with pytest.raises(InvalidRequestError, match="in use"):
        eng.stream_kv_layers("r", lambda x: None)
    eng.abort("r")
    eng.stream_kv_layers("r", lambda x: None)  # free again after abort
    eng.add_request("r", [5, 6, 7], PARAMS, prefill_only=True)
    with pytest.raises(InvalidRequestError, match="in use"):
        eng.stream_kv_layers("r", lambda x: None)
    eng.abort("r")
    assert not eng.layer_streamer.callbacks


def test_a_forward_that_skips_the_hook_still_exports_every_layer():
    caches = [torch.arange(2 * 4 * 16 * 2 * 8, dtype=torch.float32).reshape(2, 4, 16, 2, 8) + i
              for i in range(3)]
    s = LayerStreamer(caches, None, torch.device("cpu"))
    got = []
    s.register("r", got.append)
    hook = s.begin_step([("r", [2, 0, 3], 20)])  # 20 tokens: 2 blocks
    hook(0)  # e.g. a CUDA-graph replay would call none
    s.end_step()
    assert [x.layer_idx for x in got] == [0, 1, 2]
    for i, x in enumerate(got):
        assert torch.equal(x.tensor, caches[i][:, [2, 0]])
    assert s.begin_step([("r", [2], 5)]) is None  # forgotten after its export
