"""The tiny random Llama (fp32, no prefix caching) that the AsyncEngine and decode-stream tests
drive, one builder for all of them."""
from __future__ import annotations

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine


def tiny_engine(max_model_len: int = 256, num_blocks: int = 64, device: str | None = None) -> Engine:
    """device None: the engine's own default."""
    extra = {} if device is None else {"device": DeviceConfig(device=device)}
    return Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=max_model_len),
                               cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=False),
                               **extra))
