"""The L2 prefetch path of the decode attention kernel cannot run under the CPU interpreter
(inline PTX), so it is compiled here for sm_90 with Triton's own ptxas, without a GPU: the
kernel must build, keep its bulk prefetch (an asm with no used result must not be dropped),
and issue it BEFORE the grid-dependency wait (its point is to overlap the previous kernel)."""
import os
import subprocess
import sys

import pytest

from engine.kernels.prefetch import prefetch_span

_COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from engine.kernels.decode_attention import _decode_split_kernel as k
types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
         "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "out_ptr": "*bf16", "part_o_ptr": "*fp32",
         "part_lse_ptr": "*fp32", "sm_scale": "fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
         "cos_ptr": "*fp32", "sin_ptr": "*fp32", "idx_ptr": "*i64", "slot_ptr": "*i64",
         "pf_ptr": "*bf16", "pf_numel": "i64"}
const = dict(G=4, G_PAD=16, D=128, D_PAD=128, BS=16, BLOCK_N=32, DIRECT=False, IS_FP8=False,
             PREC=None, UPCAST=False, PREFETCH=True, PDL=True, ROPE=ROPE_FLAG, L2PF=True, HEADS_FIRST=True)
sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in k.params}
src = triton.compiler.ASTSource(fn=k, signature=sig,
                                constexprs={(k.arg_names.index(n),): v for n, v in const.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"].splitlines()
pf = [i for i, l in enumerate(ptx) if "cp.async.bulk.prefetch.L2.global" in l]
wait = [i for i, l in enumerate(ptx) if "griddepcontrol.wait" in l]
print("PREFETCH", len(pf), "WAIT", len(wait), "ORDER", int(bool(pf and wait and pf[-1] < wait[0])))
'''


def _has_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _has_ptxas(), reason="triton without its bundled ptxas")
@pytest.mark.parametrize("rope", [False, True])
def test_decode_kernel_prefetch_compiles_for_sm90_before_the_wait(rope):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE.replace("ROPE_FLAG", str(rope))], env=env,
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    got = dict(zip(words[::2], map(int, words[1::2])))
    assert got["PREFETCH"] >= 1 and got["WAIT"] >= 1, r.stdout
    assert got["ORDER"] == 1, f"the L2 prefetch must precede griddepcontrol.wait: {r.stdout}"


def test_prefetch_span_rules():
    import torch

    assert prefetch_span(None) == 0
    assert prefetch_span(torch.zeros(10)) == 0  # CPU tensors: nothing to prefetch
