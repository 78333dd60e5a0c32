"""bench.common.parse_attrs: the module switches of decode_ab --attr-b and step_profile --attr
(the A/Bs themselves need a GPU)."""
import pytest

from bench.common import parse_attrs


def test_parse_attrs_resolves_modules_and_classes():
    import engine.kernels.rmsnorm as rn
    from engine.layers.attention_triton import TritonAttentionBackend as T

    got = parse_attrs("engine.kernels.rmsnorm.PDL=False"
                      "&engine.layers.attention_triton.TritonAttentionBackend.fuse_decode_rope_max_seqs=64")
    assert got == [(rn, "PDL", False), (T, "fuse_decode_rope_max_seqs", 64)]


def test_parse_attrs_replaces_dataclass_fields():
    from engine.kernels import decode_tiles as da

    [(obj, name, tile)] = parse_attrs("engine.kernels.decode_tiles.TILE_16BIT="
                                      "{'block_n': 32, 'num_warps': 4, 'programs_per_sm': 4}")
    assert (obj, name) == (da, "TILE_16BIT")
    assert (tile.block_n, tile.num_warps, tile.programs_per_sm) == (32, 4, 4)
    assert tile.num_stages == da.TILE_16BIT.num_stages  # the other fields kept
    with pytest.raises(SystemExit):
        parse_attrs("engine.kernels.decode_tiles.TILE_16BIT={'no_such_field': 1}")


@pytest.mark.parametrize("spec", ["engine.kernels.rmsnorm.PDX=1",  # typo: no such attribute
                                  "engine.kernels.rmsnorm.PDL=maybe",  # not a literal
                                  "engine.kernels.rmsnorm.PDL",  # no value
                                  "nosuchmodule.x=1", "PDL=1"])
def test_parse_attrs_rejects_bad_specs(spec):
    with pytest.raises(SystemExit):
        parse_attrs(spec)


def test_tile_ab_runs_its_tiles_at_every_batch(monkeypatch):
    """decode_ab's tile A/B turns the batch tiles off on both sides (else large batches would
    run the same tile on A and B), and puts the module back afterwards."""
    import bench.decode_ab as ab
    from engine.kernels import decode_tiles as da

    seen = []

    def fake_ab(shape, name, cases, set_a, set_b, reps):
        for setter in (set_a, set_b):
            setter(None)
            seen.append((da.TILE_16BIT, da.BATCH_TILE))
        return []

    monkeypatch.setattr(ab, "_ab", fake_ab)
    before = (da.TILE_16BIT, da.BATCH_TILE)
    tile_b = da.DecodeTile(64, 4, 2, False, programs_per_sm=4, min_tiles_per_split=1)
    ab.engine_tile_ab("llama-3.1-8b", 1, tile_b=tile_b)
    assert seen == [(ab.OLD_TILE, False), (tile_b, False)]
    assert (da.TILE_16BIT, da.BATCH_TILE) == before
