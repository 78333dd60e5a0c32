"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

import json
from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request's parameters are invalid; the message names the problem (maps to INVALID_ARGUMENT / 400)."""


@dataclass(frozen=True)
class GuidedJSON:
    """Constrained decoding to JSON (engine/structured.py): schema None -> any JSON object
    (OpenAI response_format json_object); else JSON Schema text the output is valid against."""
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.schema is None:
            return
        if not isinstance(self.schema, str):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON object")
        try:
            doc = json.loads(self.schema)
        except ValueError as e:
            raise InvalidRequestError(f"response_format.json_schema.schema is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON object, "
                                      f"got {type(doc).__name__}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # 0 or -1 -> disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None -> no logprobs; N >= 0 -> chosen token + top-N
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    guided: GuidedJSON | None = None  # constrained decoding (response_format); None: free text

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop strings must be non-empty strings")
        if len(self.stop) > 16:
            bad("at most 16 stop strings are allowed")
        if self.guided is not None and not isinstance(self.guided, GuidedJSON):
            bad(f"guided must be a GuidedJSON, got {type(self.guided).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
