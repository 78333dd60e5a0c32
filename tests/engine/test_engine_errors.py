"""Bad configurations and bad requests raise clear errors."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import InvalidRequestError, SamplingParams


@pytest.mark.parametrize("kw,msg", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2.0}, "min_p"),
    ({"top_k": -3}, "top_k"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": ("",)}, "stop"),
])
def test_bad_sampling_params(kw, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("make,msg", [
    (lambda: CacheConfig(block_size=8), "block_size"),
    (lambda: CacheConfig(kv_cache_dtype="int3"), "kv_cache_dtype"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: ModelConfig(dtype="fp64"), "dtype"),
])
def test_bad_configs(make, msg):
    with pytest.raises(ConfigError, match=msg):
        make()


def test_unknown_model_path():
    with pytest.raises(ValueError, match="no/such/model"):
        Engine(EngineConfig(model=ModelConfig("/no/such/model")))


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=64),
                               cache=CacheConfig(num_blocks=32)))


def test_bad_requests(engine):
    p = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], p)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("b", [1] * 64, p)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("c", [1, 10 ** 9], p)
    engine.add_request("d", [1, 2, 3], p)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("d", [1, 2, 3], p)
    engine.abort("d")
    assert not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
