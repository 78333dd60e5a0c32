"""ModelArch: the shape of a Llama-family model, built from a HF config.json dict or from
GGUF metadata. Everything the model, the KV cache and the loaders need, nothing more.

Raises plain ValueError for configs we cannot serve; the loaders wrap it in ModelLoadError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF model_type / GGUF general.architecture -> our arch name
_HF_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_GGUF_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
# "factors": per-frequency divisors (GGUF rope_freqs.weight): inv_freq[i] / factors[i]
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "factors")


@dataclass(frozen=True)
class ModelArch:
    arch: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3"|"linear", "factor": ..., ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2: True (bias on q/k/v); llama with attention_bias: o_proj too
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.arch not in _HF_TYPES.values():
            raise ValueError(f"unsupported architecture {self.arch!r}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"model config: {f} must be a positive integer, got {getattr(self, f)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            rt = self.rope_scaling.get("rope_type")
            if rt not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope scaling type {rt!r} (supported: {SUPPORTED_ROPE_TYPES})")

    # ---- derived sizes ----------------------------------------------------------------
    @property
    def o_proj_bias(self) -> bool:
        # HF Llama/Mistral's attention_bias covers o_proj as well; Qwen2 biases q/k/v only
        return self.attention_bias and self.arch != "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            per_layer += h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    # ---- constructors -----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArch":
        mt = cfg.get("model_type")
        if mt not in _HF_TYPES:
            archs = cfg.get("architectures")
            raise ValueError(f"unsupported architecture: model_type={mt!r} architectures={archs!r} "
                             f"(supported model_type: {sorted(_HF_TYPES)})")
        arch = _HF_TYPES[mt]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu / SwiGLU)")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        # transformers >= 5 writes rope_parameters (theta inside); older files use
        # rope_theta + rope_scaling (with "type" in the oldest ones).
        rp = cfg.get("rope_parameters")
        theta = cfg.get("rope_theta")
        scaling = cfg.get("rope_scaling")
        if isinstance(rp, dict):
            theta = rp.get("rope_theta", theta)
            scaling = rp
        rope_scaling = _normalize_rope_scaling(scaling)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (
            (int(eos),) if eos is not None else ())
        bias = bool(cfg.get("attention_bias", arch == "qwen2"))
        return cls(
            arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], has_output_tensor: bool,
                           vocab_size: int | None = None) -> "ModelArch":
        """md: GGUF key -> python value. has_output_tensor: the file holds output.weight
        (otherwise the lm_head is tied to token_embd)."""
        ga = md.get("general.architecture")
        if ga not in _GGUF_TYPES:
            raise ValueError(f"unsupported GGUF architecture {ga!r} (supported: {sorted(_GGUF_TYPES)})")
        p = ga + "."

        def need(key: str):
            if p + key not in md:
                raise ValueError(f"GGUF metadata lacks {p + key!r}")
            return md[p + key]

        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        kv_heads = int(md.get(p + "attention.head_count_kv", heads))
        head_dim = int(md.get(p + "attention.key_length") or md.get(p + "rope.dimension_count")
                       or hidden // heads)
        vocab = vocab_size or md.get(p + "vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
        scaling = None
        st = md.get(p + "rope.scaling.type")
        if st == "linear":
            scaling = {"rope_type": "linear", "factor": float(md[p + "rope.scaling.factor"])}
        elif st not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling type {st!r}")
        eos = md.get("tokenizer.ggml.eos_token_id")
        return cls(
            arch=_GGUF_TYPES[ga], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(md.get(p + "context_length", 2048)),
            tie_word_embeddings=not has_output_tensor,
            attention_bias=ga == "qwen2",
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )


def _normalize_rope_scaling(s: dict | None) -> dict | None:
    """None for plain rope; otherwise a dict with 'rope_type' set (old files say 'type')."""
    if not s:
        return None
    s = {k: v for k, v in s.items() if k != "rope_theta"}
    rt = s.get("rope_type", s.get("type", "default"))
    if rt == "default":
        return None
    s["rope_type"] = rt
    s.pop("type", None)
    return s
