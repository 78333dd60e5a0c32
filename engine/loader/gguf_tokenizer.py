"""Build an engine Tokenizer from GGUF metadata (tokenizer.ggml.*), without transformers.

Supports tokenizer.ggml.model == "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2).
Control tokens (type 3) become special added tokens, user-defined (type 4) plain added tokens.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _pre_tokenizer(pre: str | None):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":
        # SmolLM's own tokenizer.json: single digits, then GPT-2 byte-level regex split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2 default


def tokenizer_from_gguf(md: dict) -> Tokenizer:
    """md: GGUF metadata key -> python value. Raises ValueError when it cannot be built."""
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = _pre_tokenizer(md.get("tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, y in zip(tokens, types) if y == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, y in zip(tokens, types) if y == USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos = md.get("tokenizer.ggml.eos_token_id")
    # GGUF's default for add_bos_token is "yes" for llama-style vocabularies; SmolLM2 says no
    if md.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bt = tokens[bos]
        tk.post_processor = processors.TemplateProcessing(single=f"{bt}:0 $A:0", pair=f"{bt}:0 $A:0 $B:1",
                                                          special_tokens=[(bt, bos)])
    eos_ids = (int(eos),) if eos is not None else ()
    eot = md.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids += (int(eot),)
    return Tokenizer(tk, chat_template=md.get("tokenizer.chat_template"),
                     bos_token_id=int(bos) if bos is not None else None, eos_token_ids=eos_ids)
