"""bench.common.kernel_options: the KernelOptions specs of lab.decode_ab --kernel-options-a/-b
and lab.step_profile --kernel-options (the A/Bs themselves need a GPU)."""
import pytest

from bench.common import kernel_options
from engine.kernels.options import TILE_16BIT, DecodeTile, KernelOptions


def test_empty_spec_is_the_base():
    assert kernel_options("") == KernelOptions()
    base = KernelOptions(few_tile=False)
    assert kernel_options(" ", base) is base


def test_fields_replaced_on_the_base():
    got = kernel_options("batch_tile=False, pdl_rmsnorm=True,pdl_o_proj=False,skinny_table='t.json'")
    assert got == KernelOptions(batch_tile=False, pdl_rmsnorm=True, pdl_o_proj=False,
                                skinny_table="t.json")
    got = kernel_options("trace=True", KernelOptions(few_tile=False))
    assert got == KernelOptions(few_tile=False, trace=True)


def test_tile_from_a_dict_of_fields_or_a_whole_tuple():
    got = kernel_options("tile_16bit={'block_n': 32, 'num_warps': 4, 'programs_per_sm': 4}").tile_16bit
    assert (got.block_n, got.num_warps, got.programs_per_sm) == (32, 4, 4)
    assert got.num_stages == TILE_16BIT.num_stages  # the other fields kept
    assert kernel_options("tile_16bit=(64, 4, 2, False, 4, 1), batch_tile=False").tile_16bit == \
        DecodeTile(64, 4, 2, False, programs_per_sm=4, min_tiles_per_split=1)


@pytest.mark.parametrize("spec,says", [
    ("batch_tiles=False", "unknown option 'batch_tiles'"),  # typo: listed with the known names
    ("batch_tile=maybe", "not a Python literal"),
    ("batch_tile", "NAME=VALUE"),
    ("batch_tile=1", "must be bool"),  # the field's type is checked
    ("pdl_qkv='off'", "must be bool | None"),
    ("batch_tile=False,batch_tile=True", "given twice"),
    ("tile_16bit={'no_such_field': 1}", "no_such_field"),
    ("tile_16bit=(100, 4, 2, False, 2, 1)", "powers of two"),
    ("batch_tile=False,,", "NAME=VALUE"),
])
def test_bad_specs_say_what_is_wrong(spec, says):
    with pytest.raises(ValueError) as e:
        kernel_options(spec)
    assert says in str(e.value)
    if "unknown" in says:
        assert "batch_tile" in str(e.value) and "pdl_rmsnorm" in str(e.value)
