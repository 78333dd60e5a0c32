"""Triton kernels, each with a torch reference in reference.py (the test oracle).

kv_write.write_kv                       scatter new K/V into the paged cache (bf16/fp16/fp32/fp8)
decode_attention.paged_decode_attention flash-decoding over pages, GQA groups per program
prefill_attention.paged_prefill_attention varlen causal attention over pages (prefix-aware)
rmsnorm.rms_norm / fused_add_rms_norm   RMSNorm, residual add fused
rotary.rotary_neox_                     neox rotary embedding, in place
rope_kv_write.rope_write_kv             rotary on q + rotated k and v into the cache, one launch
skinny_gemm.skinny_linear               decode matmul for few rows, norm / silu*up / residual fused;
                                        tile configs from configs/ (skinny_configs.py) or a heuristic;
                                        Triton pieces in skinny_gemm_parts.py; next_norm: the
                                        next matmul's input rmsnorm by the last program
slab_gemv.slab_gemv                     one-row GEMV, one wave of programs streaming whole rows
trace                                   in-kernel timestamps (diagnostic, compiled out when off;
                                        python -m lab.step_profile --stamps)
options.KernelOptions                   the launch choices above, one frozen value per engine
Importing a submodule imports triton (options.py excepted); this package file imports nothing.
"""
