"""Request traces for bench/serve.py, generated offline from a seed: the same arguments give
the same requests (lengths, prompts, prefix groups, arrival gaps) on any machine.

    spec = TraceSpec(num_requests=200, input_len="lognormal:256,0.8", output_len="fixed:64",
                     prefix_share=0.5, prefix_len=128, prefix_groups=4, seed=0)
    reqs = build_trace(spec, vocab=49152)
    times = arrival_times(len(reqs), rate=4.0, kind="gamma", burstiness=0.5, seed=0)

Lengths: "fixed:N", "uniform:LO,HI" (inclusive), "lognormal:MEDIAN,SIGMA" (long-tailed like
chat traffic; clipped to [1, 16 * MEDIAN]). A request in a shared-prefix group (share
`prefix_share` of all) starts with its group's `prefix_len` tokens (a system prompt or a RAG
document); its input length counts them. Prompts are token ids (exact lengths, /v1/completions
and gRPC) with a text rendering of the same length in words for chat endpoints; a local JSONL
file (`{"prompt": ...}` or `{"messages": [...]}` per line, optional "max_tokens") replaces the
synthetic prompts.

Arrivals: open loop "poisson" (exponential gaps) or "gamma" with a burstiness factor (shape
k = burstiness, same mean rate; k < 1 is burstier than Poisson, k = 1 is Poisson). The gaps
are drawn once at rate 1 and divided by the rate, so a rate sweep replays one sequence of
requests at every load.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field

# presets: defaults that explicit arguments override (bench/serve.py)
PRESETS = {
    "chat": dict(input_len="lognormal:192,0.8", output_len="lognormal:128,0.6", arrival="poisson"),
    "rag": dict(input_len="uniform:1024,2048", output_len="uniform:16,64", prefix_share=0.9,
                prefix_len=768, prefix_groups=4, arrival="poisson"),
    "burst": dict(input_len="lognormal:192,0.8", output_len="lognormal:128,0.6", arrival="gamma",
                  burstiness=0.25),
}

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there been one all we their has would when "
          "if so what about more will up out who into some time can like other than then now "
          "only its over also new after first two may most well way very").split()


@dataclass(frozen=True)
class LenDist:
    kind: str  # fixed | uniform | lognormal
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> "LenDist":
        if isinstance(spec, int) or str(spec).isdigit():
            return cls("fixed", float(spec))
        kind, _, args = str(spec).partition(":")
        try:
            nums = [float(x) for x in args.split(",")] if args else []
        except ValueError:
            nums = None
        ok = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in ok or nums is None or len(nums) != ok[kind] or min(nums) <= 0 or \
                (kind == "uniform" and nums[0] > nums[1]):
            raise ValueError(f"length {spec!r}: want fixed:N, uniform:LO,HI or lognormal:MEDIAN,SIGMA "
                             "(positive numbers)")
        return cls(kind, *nums)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return max(1, int(self.a))
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        import math

        x = rng.lognormvariate(math.log(self.a), self.b)
        return int(min(max(1.0, round(x)), 16 * self.a))


@dataclass
class TraceSpec:
    num_requests: int = 100
    input_len: str = "fixed:128"
    output_len: str = "fixed:64"
    prefix_share: float = 0.0  # fraction of requests that start with a group's shared prefix
    prefix_len: int = 0
    prefix_groups: int = 1
    seed: int = 0
    jsonl: str | None = None  # local prompts file (replaces the synthetic prompts)
    max_input_len: int | None = None  # clip (the server's context minus the output)

    def __post_init__(self):
        LenDist.parse(self.input_len), LenDist.parse(self.output_len)
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 0.0 <= self.prefix_share <= 1.0:
            raise ValueError("prefix_share must be in [0, 1]")
        if self.prefix_share > 0 and (self.prefix_len < 1 or self.prefix_groups < 1):
            raise ValueError("a shared prefix needs prefix_len >= 1 and prefix_groups >= 1")


@dataclass
class Req:
    idx: int
    prompt_ids: list[int] | None  # synthetic prompts: exact token ids
    text: str | None  # the prompt as text (chat endpoints, JSONL prompts)
    max_tokens: int
    group: int = -1  # shared-prefix group, -1 for none
    messages: list | None = None  # JSONL chat messages
    meta: dict = field(default_factory=dict)

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids is not None else len((self.text or "").split())


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Token ids clear of the low (bytes / specials) and high (llama-3 special) ids."""
    lo, hi = min(100, vocab // 4), min(vocab, 128000)
    return [rng.randrange(lo, hi) for _ in range(n)]


def _text(ids: list[int]) -> str:
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


def build_trace(spec: TraceSpec, vocab: int = 32000, content_seed: int = 0) -> list[Req]:
    """Lengths, prefix groups and output lengths come from spec.seed; the token content from
    (spec.seed, content_seed), so a second content_seed gives the same shape of trace with
    other tokens (an A/B against one server without the second side hitting the first's
    prefix cache)."""
    rng = random.Random(spec.seed)
    crng = random.Random(f"{spec.seed}-content-{content_seed}")
    din, dout = LenDist.parse(spec.input_len), LenDist.parse(spec.output_len)
    if spec.jsonl:
        return _from_jsonl(spec, rng, dout)
    prefixes = [_ids(random.Random(f"{spec.seed}-prefix-{g}-{content_seed}"), spec.prefix_len, vocab)
                for g in range(spec.prefix_groups)] if spec.prefix_share > 0 else []
    out = []
    for i in range(spec.num_requests):
        n_in, n_out = din.sample(rng), dout.sample(rng)
        if spec.max_input_len:
            n_in = min(n_in, spec.max_input_len)
        group = -1
        if prefixes and rng.random() < spec.prefix_share:
            group = rng.randrange(len(prefixes))
        head = prefixes[group][:n_in] if group >= 0 else []
        ids = head + _ids(crng, n_in - len(head), vocab)
        out.append(Req(i, ids, _text(ids), n_out, group))
    return out


def _from_jsonl(spec: TraceSpec, rng: random.Random, dout: LenDist) -> list[Req]:
    rows = []
    with open(spec.jsonl) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{spec.jsonl}:{ln}: not JSON: {e}") from None
            if not isinstance(d, dict) or not ({"prompt", "messages", "text"} & d.keys()):
                raise ValueError(f"{spec.jsonl}:{ln}: want an object with prompt, text or messages")
            rows.append(d)
    if not rows:
        raise ValueError(f"{spec.jsonl}: no prompts")
    out = []
    for i in range(spec.num_requests):
        d = rows[rng.randrange(len(rows))]
        n_out = int(d["max_tokens"]) if d.get("max_tokens") else dout.sample(rng)
        msgs = d.get("messages")
        text = d.get("prompt") or d.get("text")
        if text is None and msgs:
            text = "\n".join(str(m.get("content", "")) for m in msgs)
        out.append(Req(i, None, text, n_out, -1, msgs))
    return out


def arrival_times(n: int, rate: float, kind: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Offsets (s) from the start of n open-loop arrivals at `rate` requests/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if kind not in ("poisson", "gamma"):
        raise ValueError(f"arrival {kind!r}: poisson or gamma")
    if kind == "gamma" and burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    rng = random.Random(f"{seed}-arrivals")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t / rate)
        t += rng.expovariate(1.0) if kind == "poisson" else rng.gammavariate(burstiness, 1.0 / burstiness)
    return out


def trace_digest(reqs: list[Req], times: list[float] | None = None, shape_only: bool = False) -> str:
    """A short hash of the requests (and arrival times): equal digests, identical traces.
    shape_only: lengths, groups and times only (the same trace up to token content)."""
    h = hashlib.sha256()
    for r in reqs:
        h.update(json.dumps([r.input_len, r.max_tokens, r.group] if shape_only else
                            [r.prompt_ids, r.text, r.max_tokens, r.group, r.messages]).encode())
    if times is not None:
        h.update(json.dumps([round(t, 6) for t in times]).encode())
    return h.hexdigest()[:16]


def describe(reqs: list[Req]) -> dict:
    ins = sorted(r.input_len for r in reqs)
    outs = sorted(r.max_tokens for r in reqs)
    return {"requests": len(reqs), "input_len_median": ins[len(ins) // 2], "input_len_max": ins[-1],
            "output_len_median": outs[len(outs) // 2], "output_len_max": outs[-1],
            "in_prefix_groups": sum(r.group >= 0 for r in reqs), "digest": trace_digest(reqs)}


def spec_dict(spec: TraceSpec) -> dict:
    return asdict(spec)
