"""lab/table_variant.py: candidate tables for the step-level A/B."""
import copy

import pytest

from lab.table_variant import apply

DOC = {"device": "Fake GPU", "max_m": 16, "fused_m": [1, 16], "entries": [
    {"n": 4096, "k": 4096, "silu": False, "m": 1, "cfg": [4, 512, 4, 3, False, 1, False, False], "us": 11.0},
    {"n": 14336, "k": 4096, "silu": True, "m": 1, "cfg": [4, 512, 4, 3, False, 1, False, False]},
    {"n": 6144, "k": 4096, "silu": False, "m": 64, "cfg": ["cublas"]}]}


def test_field_and_whole_cfg_changes():
    doc = copy.deepcopy(DOC)
    apply(doc, "4096,4096@1=split_k:2;num_stages:1")
    apply(doc, "14336,4096,silu@1=cfg:[4,1024,8,3,false,1,true]")
    apply(doc, "6144,4096@64=cfg:[16,256,4,3,true]")
    e = doc["entries"]
    assert e[0]["cfg"] == [4, 512, 4, 1, False, 2, False, False] and "us" not in e[0]
    assert e[1]["cfg"] == [4, 1024, 8, 3, False, 1, True, False]
    assert e[2]["cfg"] == [16, 256, 4, 3, True, 1, False, False]
    assert doc["fused_m"] == [1, 16]  # only the named entries change


@pytest.mark.parametrize("spec", ["4096,4096@2=split_k:4", "4096,4096,silu@1=split_k:4",
                                  "4096,4096@1=bogus:1", "4096,4096@1=use_dot:maybe",
                                  "6144,4096@64=split_k:2", "4096@1=split_k:2"])
def test_bad_specs_are_errors(spec):
    with pytest.raises(SystemExit):
        apply(copy.deepcopy(DOC), spec)
