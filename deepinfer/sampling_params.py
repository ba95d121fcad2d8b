"""Per-request sampling parameters, validated up front with one-line errors."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field, fields

from deepinfer.errors import DeepInferError

ENGINE_SEEDS = "deepinfer-seed"  # the engine's by default: keyed by request number
CONTENT_SEEDS = "deepinfer-content-seed"  # the engine's with unseeded_seeds="content": keyed by request content
SUITE_SEEDS = "deepinfer-request-seed"  # the harness's: keyed by a suite's request id
UNSEEDED_SEEDS = ("request_order", "content")  # how `LLM` derives the seed of an unseeded request


def derive_seed(run_seed: int, key: int | str, namespace: str = ENGINE_SEEDS) -> int:
    """The seed of a request that brought none: a 63-bit hash of (namespace, run seed, key).
    Recorded seeds must keep reproducing, so the namespaces and this formula never change."""
    digest = hashlib.sha256(f"{namespace}:{run_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def request_content_hash(prompt_token_ids: list[int], params: SamplingParams) -> str:
    """SHA-256 (hex) of a request's content: its prompt token ids and the sampling params that differ
    from their defaults (as stream hashes record them, so a field added later keeps the hashes).
    Recorded seeds derive from it, so this formula never changes either."""
    content = {"prompt_token_ids": list(prompt_token_ids), "params": params.to_dict(skip_defaults=True)}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class SamplingParamsError(DeepInferError, ValueError):
    pass


STRUCTURED_KINDS = ("regex", "json_schema", "choice", "grammar")
TOOL_CALL = "tool_call"  # the assistant turn as tool calls of the request's tools (`LLM.chat` resolves it)
GRAMMAR_SYNTAXES = ("lark", "ebnf")


MAX_JSON_NESTING = 100  # levels of objects and arrays in a request line or a JSON schema


def json_nesting(value: object) -> int:
    """How many levels of objects and arrays `value` has, walked a level at a time without recursion (a
    hostile value may be nested deeper than Python's recursion limit, or 70,000 keys wide); the count
    stops just past MAX_JSON_NESTING."""
    deepest, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level and deepest <= MAX_JSON_NESTING:
        deepest += 1
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
    return deepest


def structured_problem(value: object) -> str | None:
    """What is wrong with the shape of a `structured` constraint (compiling it is the engine's job), or
    None: one of {"regex": str}, {"json_schema": dict | JSON text}, {"choice": [str, ...]},
    {"grammar": str, "syntax": "lark" | "ebnf"}, or "tool_call" (a chat turn's tool calls)."""
    if value == TOOL_CALL:
        return None
    if not isinstance(value, dict):
        return f"must be an object or {TOOL_CALL!r}, got {type(value).__name__}"
    kinds = [key for key in STRUCTURED_KINDS if key in value]
    if len(kinds) != 1:
        return f"needs exactly one of {', '.join(STRUCTURED_KINDS)}, got {sorted(value) or 'none'}"
    kind, allowed = kinds[0], {kinds[0], "syntax"} if kinds[0] == "grammar" else {kinds[0]}
    if extra := sorted(set(value) - allowed):
        return f"has unknown keys {extra} for a {kind} constraint"
    spec = value[kind]
    if kind in ("regex", "grammar") and (not isinstance(spec, str) or not spec):
        return f"{kind} must be a non-empty string"
    if kind == "grammar" and value.get("syntax") not in GRAMMAR_SYNTAXES:
        return f"grammar needs syntax {' or '.join(GRAMMAR_SYNTAXES)}, got {value.get('syntax')!r}"
    if kind == "choice" and (not isinstance(spec, list) or not spec
                             or not all(isinstance(c, str) and c for c in spec)):
        return "choice must be a non-empty list of non-empty strings"
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as err:
                return f"json_schema is not valid JSON: {err}"
            except RecursionError:
                return f"json_schema nested more than {MAX_JSON_NESTING} levels deep"
        if not isinstance(spec, (dict, bool)):
            return f"json_schema must be an object (or its JSON text), got {type(spec).__name__}"
        if json_nesting(spec) > MAX_JSON_NESTING:
            return f"json_schema nested more than {MAX_JSON_NESTING} levels deep"
    return None


@dataclass
class SamplingParams:
    """temperature 0 means greedy. `seed` keys the counter-based sampling noise; requests without
    one get a seed derived from the engine's seed and the request's number or content (see `LLM`'s
    `unseeded_seeds`), reported back in the output.
    `logprobs=k` returns, per generated token, the chosen token's logprob and the k most likely.
    `prompt_logprobs=True` also scores the prompt: the logprob of every prompt token after the first
    given the tokens before it, with the max(k, 1) most likely tokens there (what evaluations need).
    `structured` constrains the output to a regex, JSON Schema, choice or grammar
    (`deepinfer.engine.structured`), or with "tool_call" a chat turn to tool calls of its tools
    (`LLM.chat`); logprobs stay those of the unconstrained distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: bool = False
    structured: dict | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise SamplingParamsError(f"invalid sampling params: {msg}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v) -> bool:
            """A finite int or float (bools, NaN and infinities are not sampling values)."""
            return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)

        if not is_number(self.temperature) or self.temperature < 0:
            fail(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            fail(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            fail(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            fail(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            fail(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.prompt_logprobs, bool):
            fail(f"prompt_logprobs must be true or false, got {self.prompt_logprobs!r}")
        if self.structured is not None and (problem := structured_problem(self.structured)):
            fail(f"structured {problem}")

    def to_dict(self, *, skip_defaults: bool = False) -> dict:
        """All fields; with `skip_defaults`, only those that differ from their defaults. Stream hashes
        record the latter, so a field added later with a default leaves earlier hashes unchanged."""
        values = self._values()
        if skip_defaults:
            defaults = SamplingParams()._values()
            values = {k: v for k, v in values.items() if v != defaults[k] or type(v) is not type(defaults[k])}
        return values

    def _values(self) -> dict:
        """The fields, each container copied one level deep: a schema of 70,000 properties is not
        walked again for every row that records it (dataclasses.asdict copies it whole)."""
        return {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)}
