"""KernelOptions: the defaults are the launch choices serving made before they were options,
and an engine hands its options down to every kernel launch (no module switch involved)."""
import pytest
import torch

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.kernels.options import DecodeTile, KernelOptions
from engine.sampling_params import SamplingParams


def test_defaults_are_the_former_module_values():
    k = KernelOptions()
    # engine.kernels.decode_tiles.TILE_16BIT / BATCH_TILE / FEW_TILE
    assert k.tile_16bit == DecodeTile(128, 8, 3, False, programs_per_sm=2, min_tiles_per_split=1)
    assert (k.batch_tile, k.few_tile) == (True, True)
    # engine.kernels.decode_attention.PDL_SPLIT / PDL_REDUCE / CUT_SPLIT
    assert (k.pdl_split, k.pdl_reduce, k.cut_split) == (True, True, False)
    # engine.kernels.rmsnorm.PDL, engine.kernels.pdl.LATE_TRIGGER
    assert (k.pdl_rmsnorm, k.pdl_late_trigger) == (False, False)
    # engine.models.llama.SKINNY_PDL = {} (every matmul: where supported), FUSE_NEXT_NORM
    assert [k.skinny_pdl(op) for op in ("qkv", "o_proj", "gate_up", "down")] == [None] * 4
    assert k.fuse_next_norm is True
    # the shipped table of the GPU; engine.kernels.trace.ENABLED / PROBE
    assert (k.skinny_table, k.trace, k.trace_probe) == (None, False, False)
    assert EngineConfig().kernels == k


def test_options_are_frozen_and_typed():
    with pytest.raises(AttributeError):
        KernelOptions().batch_tile = False
    with pytest.raises(TypeError, match="batch_tile"):
        KernelOptions(batch_tile=0)


OPTS = KernelOptions(batch_tile=False, few_tile=False, pdl_o_proj=False, fuse_next_norm=False,
                     tile_16bit=DecodeTile(32, 4, 2, True, programs_per_sm=4, min_tiles_per_split=4))


def _engine(device, kernels):
    return Engine(EngineConfig(
        model=ModelConfig(model="dummy:tiny-llama", dtype="fp32", max_model_len=256),
        cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_seqs=4),
        device=DeviceConfig(device=str(device), enforce_eager=True, attention_backend="triton"),
        kernels=kernels))


def test_engine_hands_its_options_to_every_launch(device, monkeypatch):
    """Built with non-default KernelOptions: the model, its layers and norms and the attention
    backend hold them, and the decode step's matmul and attention launches receive them."""
    import engine.kernels.skinny_gemm as sg
    import engine.layers.attention_triton as at

    eng = _engine(device, OPTS)
    model = eng.runner.model
    assert model.kernels is OPTS and model.attn_backend.kernels is OPTS
    assert all(layer.kernels is OPTS and layer.input_layernorm.kernels is OPTS
               and layer.post_attention_layernorm.kernels is OPTS for layer in model.layers)
    assert model.norm.kernels is OPTS
    seen = []

    def spy(real):
        return lambda *a, **kw: seen.append((real.__name__, kw.get("kernels"))) or real(*a, **kw)

    monkeypatch.setattr(sg, "skinny_linear", spy(sg.skinny_linear))
    monkeypatch.setattr(at, "paged_decode_attention", spy(at.paged_decode_attention))
    model.skinny_max_m = 4  # decode steps (2 rows) take the fused matmuls
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    out = eng.generate([[5, 9, 33], [40, 41]], params)
    assert all(len(o) == 3 for o in out)
    names = {name for name, _ in seen}
    assert names == {"skinny_linear", "paged_decode_attention"}, names
    assert all(k is OPTS for _, k in seen), [name for name, k in seen if k is not OPTS]


def test_set_kernels_reaches_every_part():
    from engine.layers.attention import TorchAttentionBackend
    from engine.loader.dummy import SHAPES
    from engine.models.llama import CausalLM

    a = SHAPES["tiny-llama"]
    be = TorchAttentionBackend(a.num_heads, a.num_kv_heads, a.head_dim)
    model = CausalLM(a, be, dtype=torch.float32)
    assert model.kernels == KernelOptions() and be.kernels == KernelOptions()
    model.set_kernels(OPTS)
    assert be.kernels is OPTS and model.norm.kernels is OPTS
    assert all(m.kernels is OPTS for m in model.modules() if hasattr(m, "kernels"))
