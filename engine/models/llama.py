"""Llama-family causal LM in plain torch (Llama 2/3, SmolLM2, Mistral, Qwen2).

The model runs over a flat batch: T tokens of many sequences concatenated, with their
positions; attention (and the KV cache write) goes through the AttentionBackend, which is
the only piece that knows about sequences and pages. q/k/v and gate/up are fused into one
matmul each; `load_weights` still takes HF tensor names and fills the fused slices.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable

import torch

from engine.kernels.common import interpreting  # no triton import: safe on CPU
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.layers.activation import SiluAndMul
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVScales
from engine.layers.linear import Linear, MergedLinear
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.arch import ModelArch

log = logging.getLogger("splitserve.engine.model")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF sub-name inside a layer -> (our module path, shard or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
# tensors some checkpoints carry that the model does not need
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Attention(torch.nn.Module):
    cpu_ops = None  # engine/layers/cpu_ops.CpuOps on an fp32 CPU model: rotary in place (runner)

    def __init__(self, arch: ModelArch, layer_idx: int, backend: AttentionBackend,
                 dtype: torch.dtype | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv_proj = MergedLinear(arch.hidden_size, {"q": arch.q_size, "k": arch.kv_size, "v": arch.kv_size},
                                     bias=arch.attention_bias, dtype=dtype)
        self.o_proj = Linear(arch.q_size, arch.hidden_size, bias=arch.o_proj_bias, dtype=dtype)
        self.backend = backend

    def forward(self, rope, x, kv_cache, meta, kv_scales):
        """rope: (cos, sin, token_index) for this batch, computed once per forward."""
        o = self.attend(rope, self.qkv_proj(x), kv_cache, meta, kv_scales)
        return self.o_proj(o)

    def attend(self, rope, qkv, kv_cache, meta, kv_scales):
        """qkv [T, q+k+v] -> rope, KV write, attention -> [T, Hq * D] (before o_proj)."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.reshape(t, self.num_heads, self.head_dim)      # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)   # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        # rotary + KV write + attention (the backend may fuse the rotation into its KV write)
        if self.cpu_ops is not None and not qkv.is_cuda and self.cpu_ops.rotary(q, k, rope[0], rope[1]):
            o = self.backend.forward(self.layer_idx, q, k, v, kv_cache, meta, kv_scales)
            return o.reshape(t, self.num_heads * self.head_dim)
        o = self.backend.forward_rope(self.layer_idx, q, k, v, rope, kv_cache, meta, kv_scales)  # [T, Hq, D]
        return o.reshape(t, self.num_heads * self.head_dim)


class MLP(torch.nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype | None):
        super().__init__()
        i = arch.intermediate_size
        self.gate_up_proj = MergedLinear(arch.hidden_size, {"gate": i, "up": i}, dtype=dtype)
        self.act = SiluAndMul()
        self.down_proj = Linear(i, arch.hidden_size, dtype=dtype)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(torch.nn.Module):
    def __init__(self, arch: ModelArch, idx: int, backend: AttentionBackend, dtype,
                 kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        self.kernels = kernels  # forward_fused's matmul launches and next-norm choice
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, kernels)
        self.self_attn = Attention(arch, idx, backend, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, kernels)
        self.mlp = MLP(arch, dtype)

    def forward(self, rope, h, residual, kv_cache, meta, kv_scales):
        # pre-norm residual stream: residual carries the running sum, h the block output
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(rope, x, kv_cache, meta, kv_scales)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual

    def forward_fused(self, rope, res, kv_cache, meta, kv_scales):
        """Decode fast path: `res` [T, H] is the residual stream, updated IN PLACE.
        4 skinny-GEMM launches: norm+qkv, o_proj+residual, norm+gate_up+silu, down+residual."""
        from engine.kernels.skinny_gemm import next_norm_fuses, norm_separate, skinny_linear

        a, m, k = self.self_attn, self.mlp, self.kernels
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        pdl = k.skinny_pdl
        qkv = skinny_linear(res, a.qkv_proj.weight, a.qkv_proj.bias, norm_weight=ln1.weight, eps=ln1.eps,
                            pdl=pdl("qkv"), kernels=k)
        o = a.attend(rope, qkv, kv_cache, meta, kv_scales)
        rows, hidden = res.shape
        gu = m.gate_up_proj.weight
        # where the table runs gate_up's norm as a kernel of its own, o_proj's last program
        # computes it (KernelOptions.fuse_next_norm) and gate_up launches cut, after o_proj ends
        if (k.fuse_next_norm
                and norm_separate(rows, gu.shape[0] // 2, hidden, res.device, silu=True, kernels=k)
                and next_norm_fuses(rows, hidden, o.shape[1], res.device, kernels=k)):
            normed = torch.empty_like(res)
            skinny_linear(o, a.o_proj.weight, a.o_proj.bias, residual=res, out=res, pdl=pdl("o_proj"),
                          next_norm=(ln2.weight, ln2.eps, normed), kernels=k)
            act = skinny_linear(normed, gu, silu=True, pdl=pdl("gate_up"), cut=True, kernels=k)
        else:
            skinny_linear(o, a.o_proj.weight, a.o_proj.bias, residual=res, out=res, pdl=pdl("o_proj"),
                          kernels=k)
            act = skinny_linear(res, gu, norm_weight=ln2.weight, eps=ln2.eps, silu=True, pdl=pdl("gate_up"),
                                kernels=k)
        skinny_linear(act, m.down_proj.weight, residual=res, out=res, pdl=pdl("down"), kernels=k)


class CausalLM(torch.nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, dtype: torch.dtype | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS):
        """dtype (optional, extension of API.md): build parameters directly in this dtype;
        None -> torch's default dtype. Parameters are uninitialised until load_weights.
        kernels: the Triton kernels' launch options (set_kernels changes them before use)."""
        super().__init__()
        self.arch = arch
        self.attn_backend = attn_backend
        self.kernels = kernels
        self.embed_tokens = torch.nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(arch, i, attn_backend, dtype, kernels) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, kernels)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        if arch.tie_word_embeddings:
            self.lm_head = None  # NOTE: tied: compute_logits reads embed_tokens
        else:
            self.lm_head = torch.nn.Parameter(
                torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype), requires_grad=False)
        for p in self.parameters():
            p.requires_grad_(False)
        # Batches of <= skinny_max_m tokens take the fused skinny-GEMM path on CUDA (set by
        # the runner from DeviceConfig.skinny_gemm_max_batch; 0 = never), restricted to
        # skinny_rows when set (the tuned table's winning batch sizes).
        self.skinny_max_m = 0
        self.skinny_rows: frozenset[int] | None = None

    def set_kernels(self, kernels: KernelOptions) -> None:
        """Hand the engine's KernelOptions to every part that launches kernels: the layers,
        their norms and the attention backend (the runner calls this once, before any step)."""
        self.kernels = self.attn_backend.kernels = kernels
        for mod in self.modules():
            if isinstance(mod, (DecoderLayer, RMSNorm)):
                mod.kernels = kernels

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, kv_scales: KVScales | None = None) -> torch.Tensor:
        """input_ids, positions: [T] long -> final-normed hidden [T, hidden]."""
        h = torch.nn.functional.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions)  # [T, D/2] f32, shared by every layer
        idx = torch.arange(input_ids.shape[0], device=input_ids.device) if input_ids.is_cuda else None
        rope = (cos, sin, idx)
        hook = getattr(self, "layer_hook", None)  # optional: hook(i) after layer i (KV streaming)
        if self._use_skinny(h):
            # NOTE: h is a fresh tensor (embedding output): the fused path mutates it in place
            for i, layer in enumerate(self.layers):
                layer.forward_fused(rope, h, kv_caches[i], meta, kv_scales)
                if hook is not None:
                    hook(i)
            return self.norm(h)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(rope, h, residual, kv_caches[i], meta, kv_scales)
            if hook is not None:
                hook(i)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32.
        NOTE: with fp32 weights the matmul is fp32; with bf16/fp16 weights the matmul runs
        in the weight dtype (fp32 accumulation in cuBLAS) and the result is upcast --
        materialising an fp32 copy of a 128k-vocab lm_head per step would cost GBs."""
        w = self.lm_head_weight
        if self._use_skinny(hidden):
            from engine.kernels.skinny_gemm import skinny_linear

            return skinny_linear(hidden.to(w.dtype), w, out_dtype=torch.float32, kernels=self.kernels)
        return torch.nn.functional.linear(hidden.to(w.dtype), w).float()

    def _use_skinny(self, x: torch.Tensor) -> bool:
        n = x.shape[0]
        return (0 < n <= self.skinny_max_m and (self.skinny_rows is None or n in self.skinny_rows)
                and (x.is_cuda or interpreting())
                and x.dtype == self.embed_tokens.dtype)

    # ---- weights ----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: (HF name, tensor) pairs. Raises ValueError on an unknown name, a shape
        mismatch, or when a parameter is never filled."""
        filled: set[str] = set()
        n = 0
        for name, t in weights:
            n += 1
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            filled.add(self._load_one(name, t))
        expected = self._expected_keys()
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
        log.debug("loaded %d tensors", n)

    def _load_one(self, name: str, t: torch.Tensor) -> str:
        """Copies one HF tensor in; returns the key it fills (HF-style, for the coverage check)."""
        if name == "model.embed_tokens.weight":
            _copy_param(self.embed_tokens, t, name)
            return name
        if name == "lm_head.weight":
            if self.lm_head is None:
                return name  # tied checkpoints sometimes store the duplicate; ignore it
            _copy_param(self.lm_head, t, name)
            return name
        if name == "model.norm.weight":
            _copy_param(self.norm.weight, t, name)
            return name
        m = _LAYER_RE.match(name)
        if not m:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        idx, rest = int(m.group(1)), m.group(2)
        if idx >= len(self.layers):
            raise ValueError(f"tensor {name!r}: layer {idx} >= num_layers {len(self.layers)}")
        layer = self.layers[idx]
        mod_name, _, pname = rest.rpartition(".")
        if mod_name in _FUSED:
            target, shard = _FUSED[mod_name]
            try:
                layer.get_submodule(target).load_shard(shard, pname, t)
            except ValueError as e:
                raise ValueError(f"tensor {name!r}: {e}") from None
            return name
        try:
            mod = layer.get_submodule(mod_name)
        except AttributeError:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint") from None
        p = getattr(mod, pname, None)
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        _copy_param(p, t, name)
        return name

    def _expected_keys(self) -> set[str]:
        a = self.arch
        keys = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            keys.add("lm_head.weight")
        per = ["input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight"]
        if a.attention_bias:
            per += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if a.o_proj_bias:
            per.append("self_attn.o_proj.bias")
        for i in range(a.num_layers):
            keys.update(f"model.layers.{i}.{p}" for p in per)
        return keys


def _copy_param(p: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if tuple(p.shape) != tuple(t.shape):
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(t.shape)} != model shape {tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(t)
