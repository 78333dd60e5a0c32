"""Tokenizer: HF `tokenizers` for encode/decode, jinja2 chat templates, and an incremental
detokenizer for streaming (no partial UTF-8, stop strings held back and cut).

Built from a HF dir (tokenizer.json + tokenizer_config.json), from GGUF metadata
(engine.loader.gguf_tokenizer), or as a byte-level fallback for dummy models.
"""
from __future__ import annotations

import json
import logging
import os

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from engine import chat_template
from engine.sampling_params import SamplingParams

log = logging.getLogger("splitserve.engine.tokenizer")

# Used when a tokenizer has no chat template of its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")


def _token_str(v) -> str | None:
    """tokenizer_config.json spells special tokens as "x" or {"content": "x", ...}."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    def __init__(self, tk: HFTokenizer, *, chat_template: str | None = None,
                 bos_token_id: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 bos_token: str | None = None, eos_token: str | None = None):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token = bos_token if bos_token is not None else self._id_str(bos_token_id)
        self.eos_token = eos_token if eos_token is not None else (
            self._id_str(self.eos_token_ids[0]) if self.eos_token_ids else None)
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def _id_str(self, i: int | None) -> str | None:
        return self.tk.id_to_token(i) if i is not None else None

    # ---- constructors -----------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids: tuple[int, ...] = (),
                    bos_token_id: int | None = None) -> "Tokenizer":
        """eos/bos ids from config.json / generation_config.json (merged with the tokenizer's)."""
        tk = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(path, "chat_template.jinja")  # transformers >= 4.50 writes this
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        bos_tok, eos_tok = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        eos = list(eos_token_ids)
        if eos_tok is not None and tk.token_to_id(eos_tok) is not None:
            eos.append(tk.token_to_id(eos_tok))
        if bos_token_id is None and bos_tok is not None:
            bos_token_id = tk.token_to_id(bos_tok)
        return cls(tk, chat_template=template, bos_token_id=bos_token_id,
                   eos_token_ids=tuple(dict.fromkeys(eos)), bos_token=bos_tok, eos_token=eos_tok)

    @classmethod
    def byte_level(cls, vocab_size: int, bos_token_id: int | None = None,
                   eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """Fallback for dummy models: ids 0..255 are the bytes (GPT-2 byte alphabet), bos/eos
        get special tokens at their ids; every other id decodes to nothing."""
        alphabet = ByteLevel.alphabet()
        byte_chars = sorted(alphabet, key=lambda c: _BYTE_ORDER[c])
        vocab = {c: i for i, c in enumerate(byte_chars)}
        specials = {}
        if bos_token_id is not None:
            specials[bos_token_id] = "<|bos|>"
        for e in eos_token_ids:
            specials.setdefault(e, "<|eos|>" if e == eos_token_ids[0] else f"<|eos_{e}|>")
        for i, s in specials.items():
            if i < vocab_size:
                vocab[s] = i
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        from tokenizers import AddedToken

        tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials.values()])
        return cls(tk, chat_template=None, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)

    # ---- encode / decode ----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra) -> str:
        """Raises engine.chat_template.ChatTemplateError (a ValueError) on bad messages."""
        tpl = self.chat_template or DEFAULT_CHAT_TEMPLATE
        return chat_template.render(tpl, messages, add_generation_prompt, bos_token=self.bos_token or "",
                                    eos_token=self.eos_token or "", **extra)

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids, params)

    # ---- export ---------------------------------------------------------------------------
    def save_hf_dir(self, path: str, model_max_length: int | None = None) -> list[str]:
        """Write this tokenizer as a HF tokenizer directory (tokenizer.json, tokenizer_config.json
        with the chat template, special_tokens_map.json) that transformers' AutoTokenizer and
        the tools built on it load. -> the file names written."""
        os.makedirs(path, exist_ok=True)
        self.tk.save(os.path.join(path, "tokenizer.json"))
        special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                     ("pad_token", self.eos_token)) if v is not None}
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
               "clean_up_tokenization_spaces": False,
               "chat_template": self.chat_template or DEFAULT_CHAT_TEMPLATE}
        if model_max_length is not None:
            cfg["model_max_length"] = int(model_max_length)
        for name, obj in (("tokenizer_config.json", cfg), ("special_tokens_map.json", special)):
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
                f.write("\n")
        return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _byte_order() -> dict[str, int]:
    # GPT-2 bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_ORDER = _byte_order()


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Invariants:
    - never emits a partial UTF-8 character: while the decoded tail ends in U+FFFD (bytes
      of a character still to come) the text is held (up to MAX_HELD_TOKENS tokens, after
      which it is emitted as is: the model produced invalid bytes);
    - never emits a suffix that could begin a stop string; a matched stop string ends the
      stream: the text is cut before it (or after it with include_stop_str_in_output).
    Decoding works on a window (prefix_offset..) that starts a few tokens back, so tokens
    whose text depends on their left neighbour decode as in a full decode.
    """

    MAX_HELD_TOKENS = 8
    CONTEXT_TOKENS = 6

    def __init__(self, tok: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.tok = tok
        self.stops = tuple(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.partial = 0  # chars of the open window (read_offset..) already emitted
        self.pending = ""  # decoded text held back as a possible stop-string prefix
        self.text = ""  # everything emitted so far
        self.stopped: str | None = None

    def step(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """-> (text delta, matched stop string or None). After a stop, returns ("", None)."""
        if self.stopped is not None:
            return "", None
        self.ids.extend(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of stream: everything still held (partial bytes, stop-string prefixes)."""
        if self.stopped is not None:
            return ""
        delta, _ = self._emit(self._decode_new(final=True), final=True)
        return delta

    def _decode_new(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        # rare: a decoder that rewrites earlier text -- then take what is past the prefix length
        new = full[len(prefix):] if len(full) > len(prefix) else ""
        held = len(self.ids) - self.read_offset
        if new.endswith("\ufffd") and not final and held < self.MAX_HELD_TOKENS:
            # NOTE: a multi-byte character is split across tokens: emit what precedes it and
            # keep the window open; text before a trailing incomplete sequence is stable.
            safe = new.rstrip("\ufffd")
            out = safe[self.partial:]
            self.partial = max(self.partial, len(safe))
            return out
        out = new[self.partial:]
        self.partial = 0
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return out

    def _emit(self, new: str, final: bool) -> tuple[str, str | None]:
        buf = self.pending + new
        if not self.stops:
            self.pending = ""
            self.text += buf
            return buf, None
        # earliest match wins; emitted text never holds a stop prefix, so a match starts in buf
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            out = buf[:i + len(s)] if self.include_stop else buf[:i]
            self.pending = ""
            self.text += out
            self.stopped = s
            return out, s
        hold = 0 if final else _held_suffix_len(buf, self.stops)
        out = buf[:len(buf) - hold]
        self.pending = buf[len(buf) - hold:]
        self.text += out
        return out, None


def _held_suffix_len(buf: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(buf)), best, -1):
            if buf.endswith(s[:k]):
                best = k
                break
    return best
