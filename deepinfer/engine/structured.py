"""Structured outputs: a request's `structured` constraint as a token mask per sampled row.

A constraint is one of (`SamplingParams.structured`):

- `{"regex": pattern}`: the output matches the pattern in full;
- `{"json_schema": schema}` (a dict or its JSON text): the output is one compact JSON value valid
  under the schema, whitespace limited to single spaces where JSON allows it;
- `{"choice": [text, ...]}`: the output is one of the texts;
- `{"grammar": text, "syntax": "lark" | "ebnf"}`: the output is a sentence of the grammar (Lark's
  dialect as llguidance reads it, start rule `start`; EBNF as llama.cpp's GBNF, start rule `root`).

Regexes, schemas and choices compile with outlines-core (`json_schema.build_regex_from_schema`, an
`Index` over the tokenizer's byte vocabulary, a `Guide` per request); grammars with llguidance
(`LLMatcher`), which also takes a regex or schema outlines-core cannot compile, and a schema using a
keyword outlines-core would not enforce (`OUTLINES_SCHEMA_KEYWORDS`: numeric bounds, for one). Compiled
constraints are cached by (tokenizer content hash, constraint). A constraint that compiles in neither
fails its request at submission with the compiler's one-line error, and so does one that no output
can even start (an empty character class, a `$ref` loop) or the schema `false`; the schema `true`
is `{}`.

Compiling is bounded: outlines-core builds a DFA, which can be exponential in the regex
(`(a|b)*a(a|b){24}`) or huge for a huge schema, so it runs in a forked child limited to
`COMPILE_SECONDS` and `COMPILE_BYTES` more memory, and a constraint that does not fit goes to
llguidance instead, whose lazy lexer and parser work within its own limits (`LLParserLimits`).

Each request holds a `Matcher`: its constraint's state after the tokens it has generated. The mask
allows the tokens the constraint allows there, and the end token only where the output may end; an
output ends when it samples the end token (also with `ignore_eos`). Masks are int32 bitmasks (bit j
of word i: token 32 i + j), what both compilers write.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import pickle
import re
import resource
import select
import signal
import time
from collections.abc import Callable

import llguidance
import outlines_core
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from deepinfer.errors import DeepInferError
from deepinfer.recipe.tokenizer import TextTokenizer

JSON_WHITESPACE = r"[ ]?"  # between JSON tokens: a random model could otherwise emit whitespace forever
# the keywords outlines-core's schema regexes enforce: a schema using any other goes to llguidance, which
# does enforce numeric bounds (outlines-core ignores them), string formats (outlines-core's `date` takes
# any Unicode digit and February 30th) and uniqueItems
OUTLINES_SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "allOf", "minLength", "maxLength", "pattern", "$ref", "$defs", "definitions",
    "$schema", "$id", "title", "description", "default", "examples"})
LITERAL_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})
MAX_ROLLBACK = 64  # tokens a matcher can take back: a step's pending token and its drafts
COMPILE_SECONDS = 4.0  # an outlines-core index that takes longer is left to llguidance
COMPILE_BYTES = 1 << 29  # nor may it take more memory than this (the largest index measured on V4's vocabulary: 100 MB)


class StructuredError(DeepInferError, ValueError):
    """A constraint that cannot be compiled."""


def mask_words(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class Matcher:
    """One request's constraint state after the tokens it took. `advance` and `rollback` move it; the
    rest only read it. The end token is taken here, not by the compiler's state (outlines-core's final
    states have no transition on it; llguidance may stop on its own once nothing can follow): it is
    allowed wherever the output may end."""

    eos: int
    vocab_size: int  # the tokenizer's: a model's vocabulary may be larger, and the ids past it spell nothing
    ended = False  # took the end token

    def allows(self, tokens: list[int]) -> int:
        """How many of `tokens`, taken in order from the current state, the constraint allows."""
        taken = 0
        for token in tokens:
            if not self.advance(token):
                break
            taken += 1
        self.rollback(taken)
        return taken

    def advance(self, token: int) -> bool:
        """Take `token`; False (and no change) when the constraint does not allow it."""
        if self.ended or not 0 <= token < self.vocab_size:  # llguidance would stop in error on such an id
            return False
        if token == self.eos:
            self.ended = self._may_end()
            return self.ended
        return self._take(token)

    def rollback(self, count: int) -> None:
        """Take back the last `count` tokens taken."""
        if count and self.ended:
            count, self.ended = count - 1, False
        if count:
            self._take_back(count)

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into the int32 bitmask `out` [mask_words(vocab)]."""
        if self.ended:
            _only(out, self.eos)
        else:
            self._write_mask(out)

    def _may_end(self) -> bool:
        raise NotImplementedError

    def _take(self, token: int) -> bool:
        raise NotImplementedError

    def _take_back(self, count: int) -> None:
        raise NotImplementedError

    def _write_mask(self, out: torch.Tensor) -> None:
        raise NotImplementedError


class _OutlinesMatcher(Matcher):
    def __init__(self, index: outlines_core.Index, eos: int, vocab_size: int) -> None:
        self.index, self.guide = index, outlines_core.Guide(index, max_rollback=MAX_ROLLBACK)
        self.eos, self.vocab_size = eos, vocab_size

    def _may_end(self) -> bool:
        return self.index.is_final_state(self.guide.get_state())

    def _take(self, token: int) -> bool:
        if self.index.get_next_state(self.guide.get_state(), token) is None:  # not the guide's token list: O(vocab)
            return False
        self.guide.advance(token, return_tokens=False)
        return True

    def _take_back(self, count: int) -> None:
        self.guide.rollback_state(count)

    def _write_mask(self, out: torch.Tensor) -> None:
        self.guide.write_mask_into(out.data_ptr(), out.numel(), 4)  # the end token where the state is final


class _GuidanceMatcher(Matcher):
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.eos, self.vocab_size = tokenizer.eos_token, tokenizer.vocab_size

    def _may_end(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()

    def _take(self, token: int) -> bool:
        return not self.matcher.is_stopped() and self.matcher.validate_tokens([token]) == 1 \
            and self.matcher.consume_token(token)

    def _take_back(self, count: int) -> None:
        self.matcher.rollback(count)

    def _write_mask(self, out: torch.Tensor) -> None:
        if self.matcher.is_stopped():  # nothing can follow: the output ends
            _only(out, self.eos)
            return
        words = mask_words(self.vocab_size)  # llguidance writes exactly its tokenizer's words
        out[words:].zero_()
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), words * 4)


def _only(out: torch.Tensor, token: int) -> None:
    """`out` allowing `token` alone."""
    out.zero_()
    bit = 1 << (token % 32)
    out[token // 32] = bit - (1 << 32 if bit >= 1 << 31 else 0)  # the int32 with that bit set


def constraint_key(structured: dict) -> str:
    """The canonical text of a constraint (a schema given as JSON text and as a dict are one)."""
    value = dict(structured)
    if isinstance(value.get("json_schema"), str):
        value["json_schema"] = json.loads(value["json_schema"])
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class StructuredCompiler:
    """Compiles constraints for one tokenizer and hands out a fresh `Matcher` per request."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.digest = tokenizer.content_hash
        self.eos = tokenizer.eos_id
        self.guidance = _guidance_tokenizer(tokenizer.text, tokenizer.vocab_size, self.eos)

    def check(self, structured: dict) -> None:
        """Compile `structured` (or find it compiled); StructuredError when it cannot compile."""
        _compile(self, constraint_key(structured))

    def matcher(self, structured: dict) -> Matcher:
        """A matcher at the start of `structured`'s output; StructuredError when it cannot compile."""
        compiled = _compile(self, constraint_key(structured))
        if isinstance(compiled, outlines_core.Index):
            return _OutlinesMatcher(compiled, self.eos, self.guidance.vocab_size)
        return _GuidanceMatcher(self.guidance, compiled)


@functools.lru_cache(maxsize=8)
def _guidance_tokenizer(text: str, size: int, eos: int) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(text, n_vocab=size, eos_token=eos)


def _vocabulary(compiler: StructuredCompiler) -> outlines_core.Vocabulary:
    """outlines-core's vocabulary of the compiler's tokenizer: every token but the special ones, by the
    bytes it stands for (built once per tokenizer)."""
    if compiler.digest not in _VOCABULARIES:
        tokens: dict[bytes, list[int]] = {}
        guidance = compiler.guidance
        for token in range(guidance.vocab_size):
            if not guidance.is_special_token(token):
                tokens.setdefault(guidance.decode_bytes([token]), []).append(token)
        _VOCABULARIES[compiler.digest] = outlines_core.Vocabulary(compiler.eos, tokens)
    return _VOCABULARIES[compiler.digest]


_VOCABULARIES: dict[str, outlines_core.Vocabulary] = {}
_COMPILED: dict[tuple[str, str], outlines_core.Index | str] = {}
_COMPILED_LIMIT = 256


def _compile(compiler: StructuredCompiler, key: str) -> outlines_core.Index | str:
    """The outlines-core index of a regex, schema or choice, or the llguidance grammar of a grammar (or
    of a regex or schema outlines-core cannot compile), cached by (tokenizer digest, constraint)."""
    cache_key = (compiler.digest, key)
    if cache_key not in _COMPILED:
        if len(_COMPILED) >= _COMPILED_LIMIT:
            del _COMPILED[next(iter(_COMPILED))]
        _COMPILED[cache_key] = _compile_uncached(compiler, json.loads(key))
    return _COMPILED[cache_key]


def _compile_uncached(compiler: StructuredCompiler, structured: dict) -> outlines_core.Index | str:
    if "grammar" in structured:
        text = structured["grammar"]
        if structured["syntax"] == "ebnf":
            try:
                text = gbnf_to_lark(text)
            except Exception as err:  # GbnfToLarkError, or a bare Exception for an undefined rule
                raise StructuredError(f"invalid EBNF grammar: {_first_line(err)}") from None
        return _guidance_grammar(compiler, _guidance_source(lambda: llguidance.LLMatcher.grammar_from_lark(text),
                                                            "grammar"), "grammar")
    if "json_schema" in structured:
        if structured["json_schema"] is False:
            raise StructuredError("invalid JSON schema: false accepts no value")
        schema_value = {} if structured["json_schema"] is True else structured["json_schema"]
        schema = json.dumps(schema_value)
        return _index_or_grammar(
            compiler, "JSON schema",
            (lambda: outlines_core.json_schema.build_regex_from_schema(schema, JSON_WHITESPACE))
            if _outlines_enforces(schema_value) else None,
            lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    if "choice" in structured:
        regex, kind = "|".join(re.escape(choice) for choice in structured["choice"]), "choice"
    else:
        regex, kind = structured["regex"], "regex"
    return _index_or_grammar(compiler, kind, lambda: regex, lambda: llguidance.LLMatcher.grammar_from_regex(regex))


def _index_or_grammar(compiler: StructuredCompiler, kind: str, regex: Callable[[], str] | None,
                      grammar: Callable[[], str]) -> outlines_core.Index | str:
    """outlines-core's index of `regex()` where it can be made within the limits (`regex` None: it
    would not enforce the constraint), else llguidance's `grammar()`; StructuredError when neither
    compiles or no output can start."""
    vocabulary = _vocabulary(compiler)  # built here, once: a child's copy would be lost with it
    index = None if regex is None else _within_limits(lambda: outlines_core.Index(regex(), vocabulary))
    if index is None:
        return _guidance_grammar(compiler, _guidance_source(grammar, kind), kind)
    start = index.get_initial_state()
    if not index.is_final_state(start) and not set(index.get_allowed_tokens(start)) - {compiler.eos}:
        raise StructuredError(f"invalid {kind}: no output satisfies it")
    return index


def _within_limits(build: Callable[[], outlines_core.Index]) -> outlines_core.Index | None:
    """`build()` run in a forked child with COMPILE_SECONDS and COMPILE_BYTES more memory than this
    process has, its result sent back pickled; None when it raised, ran out of either, or died."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the build, then exit without running any cleanup
        code = 1
        try:
            os.close(read)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # an allocation failure aborts with a message: not ours
            faulthandler.disable()  # nor its traceback
            limit = _address_space() + COMPILE_BYTES
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            data = pickle.dumps(build())
            with os.fdopen(write, "wb") as pipe:
                pipe.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    chunks, deadline = [], time.monotonic() + COMPILE_SECONDS
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([read], [], [], left)[0]:
            chunk = os.read(read, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)  # out of time
    except BaseException:  # interrupted (SIGTERM, Ctrl-C): the child must not outlive the wait below
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    return pickle.loads(b"".join(chunks)) if os.waitstatus_to_exitcode(status) == 0 else None


def _address_space() -> int:
    """This process's virtual memory size in bytes (VmSize)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def _guidance_source(convert: Callable[[], str], kind: str) -> str:
    """llguidance's grammar of a regex or schema; StructuredError with its message when it has none."""
    try:
        return convert()
    except Exception as err:  # ValueError, or its own error types (a schema nested too deep, say)
        raise StructuredError(f"invalid {kind}: {_first_line(err)}") from None


def _outlines_enforces(schema: object) -> bool:
    """Whether outlines-core's regex enforces all of `schema`, at any depth: every keyword is one it
    enforces, and no string pairs a length bound with a pattern (outlines-core then drops the pattern)."""
    if isinstance(schema, list):
        return all(map(_outlines_enforces, schema))
    if not isinstance(schema, dict):
        return True
    if not set(schema) <= OUTLINES_SCHEMA_KEYWORDS or ("pattern" in schema and {"minLength", "maxLength"} & set(schema)):
        return False
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions"):
            if not all(map(_outlines_enforces, value.values() if isinstance(value, dict) else [value])):
                return False
        elif key not in LITERAL_KEYWORDS and not _outlines_enforces(value):
            return False
    return True


def _guidance_grammar(compiler: StructuredCompiler, grammar: str, kind: str) -> str:
    """`grammar` once llguidance has compiled it for the tokenizer and it lets an output start;
    StructuredError with llguidance's message otherwise (it names the problem more precisely than
    outlines-core's, when both failed)."""
    matcher = llguidance.LLMatcher(compiler.guidance, grammar)
    error = matcher.get_error()
    if error:
        raise StructuredError(f"invalid {kind}: {_first_line(error)}")
    if not matcher.is_accepting():
        mask = torch.zeros(1, mask_words(compiler.guidance.vocab_size), dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        allowed = allowed_tokens(mask, compiler.guidance.vocab_size)[0]
        allowed[compiler.eos] = False
        if matcher.is_error() or not allowed.any():
            raise StructuredError(f"invalid {kind}: no output satisfies it")
    return grammar


def _first_line(error: Exception | str) -> str:
    """The line of a compiler's message that says what is wrong: its `error:` line, else its first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    return (said or lines or [type(error).__name__])[0]


def step_masks(rows: list[tuple[Matcher | None, list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """The int32 bitmasks [R, mask_words(vocab_size)] of a step's sampled rows, from its sampling
    chunks in order: (matcher or None, the tokens the chunk's sequence takes before its first sampled
    row that the matcher has not (a token the step in flight is sampling), its draft tokens). A chunk
    has 1 + drafts rows: row j allows what the constraint allows after those tokens and the first j
    drafts; a chunk without a constraint allows everything. The matchers are taken forward to read the
    masks, then back: they end as they began."""
    masks = torch.full((sum(1 + len(drafts) for _, _, drafts in rows), mask_words(vocab_size)), -1, dtype=torch.int32)
    row = 0
    for matcher, pending, drafts in rows:
        if matcher is None:
            row += 1 + len(drafts)
            continue
        taken = 0
        for token in pending:  # a token the constraint does not take finished its sequence: its rows are dropped
            taken += matcher.advance(token)
        matcher.fill_mask(masks[row])
        for j, token in enumerate(drafts):
            taken += matcher.advance(token)
            matcher.fill_mask(masks[row + 1 + j])
        matcher.rollback(taken)
        row += 1 + len(drafts)
    return masks


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from int32 bitmasks [R, words] (on their device)."""
    bits = torch.arange(32, dtype=torch.int32, device=masks.device)
    return ((masks.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]
