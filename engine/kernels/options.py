"""KernelOptions: the launch choices of the decode step's Triton kernels, one frozen value per
engine (EngineConfig.kernels), handed down runner -> model -> layers -> kernel launchers.

The defaults are what serving runs. A/B tools build engines with other values
(python -m lab.decode_ab --kernel-options-b 'batch_tile=False'); nothing patches modules.
Importing this module imports neither torch nor triton (engine/config.py imports it).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """Launch shape of the decode attention split kernel and its split rule: at most
    `programs_per_sm` x SMs programs (ONE wave: a second, partial wave of long programs costs
    more than shorter splits), splits of at least `min_tiles_per_split` KV tiles."""
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool  # manual register double buffering of the next K/V tile
    programs_per_sm: int
    min_tiles_per_split: int
    # launched without the PDL attribute, still triggering the reduce early (KernelOptions.cut_split)
    cut: bool = False

    def __post_init__(self) -> None:
        pow2 = lambda v: isinstance(v, int) and v >= 1 and v & (v - 1) == 0  # noqa: E731
        if not (pow2(self.block_n) and pow2(self.num_warps)):
            raise ValueError(f"DecodeTile: block_n and num_warps must be powers of two, got {self}")
        if min(self.num_stages, self.programs_per_sm, self.min_tiles_per_split) < 1:
            raise ValueError(f"DecodeTile: num_stages, programs_per_sm and min_tiles_per_split must "
                             f"be >= 1, got {self}")


# 128-token tiles, 8 warps, 3 stages, <= 2 programs per SM: fastest 16-bit tile at batches 1-64
# on the H200 (measure: python -m lab.decode_ab --attn-tiles --attn-splits)
TILE_16BIT = DecodeTile(128, 8, 3, False, programs_per_sm=2, min_tiles_per_split=1)

# the fused decode matmuls of a layer, as KernelOptions.skinny_pdl(op) names them
SKINNY_OPS = ("qkv", "o_proj", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Each choice below is the faster one on the H200 in whole decode steps; measure one with
    python -m lab.decode_ab --kernel-options-b 'NAME=VALUE' (lab/notes/kernels.md: past runs)."""
    # decode attention (engine/kernels/decode_tiles.py, decode_attention.py)
    tile_16bit: DecodeTile = TILE_16BIT  # the 16-bit tile where no other tile applies
    batch_tile: bool = True  # batches filling tile_16bit's wave: smaller tiles, 3-9% faster 8B steps
    few_tile: bool = True  # <= FEW_PAIRS pairs of 128-wide heads: TILE_16BIT_FEW, ~2% at 8B batch 1
    pdl_split: bool = True  # the split kernel launches with PDL where supported
    pdl_reduce: bool = True  # the reduce kernel too (without: up to 4% slower at 8B batches 4-16)
    cut_split: bool = False  # cut every split launch (DecodeTile.cut), not only TILE_16BIT_FEW's
    # PDL elsewhere (engine/kernels/pdl.py)
    pdl_rmsnorm: bool = False  # off: with it the 8B batch-1 step is 10% slower (rmsnorm.py)
    pdl_late_trigger: bool = False  # trigger dependents after the main loads: 6% slower 8B batch 1
    # per fused decode matmul (SKINNY_OPS): None = PDL where supported, False = without it (a cut
    # in the step's PDL chain; each such cut made 8B steps 0.2-1.9% slower)
    pdl_qkv: bool | None = None
    pdl_o_proj: bool | None = None
    pdl_gate_up: bool | None = None
    pdl_down: bool | None = None
    # o_proj's last program computes gate_up's input norm where the table runs it apart from
    # gate_up (skinny_linear's next_norm): one rmsnorm launch less, ~0.6% at 8B batch 1
    fuse_next_norm: bool = True
    # a skinny-GEMM table file instead of engine/kernels/configs/skinny_gemm-<gpu>.json
    # (a candidate: python -m lab.decode_ab --table-ab FILE)
    skinny_table: str | None = None
    # in-kernel timestamps, a diagnostic (engine/kernels/trace.py, python -m lab.step_profile
    # --stamps); trace_probe also times the decode split's first block-id and K/V loads
    trace: bool = False
    trace_probe: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, _TYPES[str(f.type)]):
                raise TypeError(f"KernelOptions.{f.name} must be {f.type}, got {v!r}")

    def skinny_pdl(self, op: str) -> bool | None:
        """PDL for one fused decode matmul (SKINNY_OPS): None = where supported."""
        return getattr(self, f"pdl_{op}")


_TYPES = {"bool": (bool,), "bool | None": (bool, type(None)), "str | None": (str, type(None)),
          "DecodeTile": (DecodeTile,)}

DEFAULT_KERNELS = KernelOptions()
