"""Layer-streamed KV export on CUDA: during the forward (eager: the hook after each layer) or
after a CUDA-graph replay (end_step emits every layer), each exported layer equals export_kv
byte for byte once its event completed; fp8 scales travel with it."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_streamed_layers_equal_export_on_cuda(eager, kv_dtype):
    eng = Engine(EngineConfig(
        model=ModelConfig("dummy:tiny-llama", dtype="bf16", max_model_len=256),
        cache=CacheConfig(num_blocks=64, kv_cache_dtype=kv_dtype),
        device=DeviceConfig(device="cuda", enforce_eager=eager)))
    got = []
    prompt = list(range(3, 40))
    eng.stream_kv_layers("r", got.append)
    eng.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    ref = eng.export_kv("r")
    assert [x.layer_idx for x in got] == list(range(eng.arch.num_layers))
    for x, t in zip(got, ref.layers):
        h = x.host()
        assert h.shape == t.shape and torch.equal(h.view(torch.uint8), t.cpu().view(torch.uint8))
    if kv_dtype == "fp8_e4m3":
        assert [x.k_scale for x in got] == pytest.approx(ref.k_scales)
    if not eager:
        assert eng.runner.prefill_graphs is not None and eng.runner.prefill_graphs.replays >= 1
    eng.release("r")
