"""The structured-output battery (tests/fixtures/structured/battery.jsonl) and its checker.

Every battery constraint must describe a finite language whose longest sentence fits in the entry's
`max_tokens`, because the model under test has random weights: the constraint alone has to force a
valid, finished output.  Besides examples, reasons and compilation, this checks boundedness twice: a
lexical scan for unbounded quantifiers, and an exact bound on the UTF-8 length of the longest output
(tokens can be one byte long; for schemas, of outlines-core's regex).  Seeded random walks over a
one-token-per-byte vocabulary then play the random model with each compiler that may serve the
constraint: outlines-core for regexes, schemas and choices, llguidance for grammars and for schemas
(compact JSON; the engine sends it schemas using keywords outlines-core ignores, such as `minimum`).
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
import re._constants as sre_constants  # private, but the only parser of Python's regex syntax
import re._parser as sre_parser
from collections import Counter, defaultdict
from pathlib import Path

import llguidance
import outlines_core
import pytest
from jsonschema import Draft202012Validator
from lark import Lark
from lark.lexer import PatternStr
from llguidance.gbnf_to_lark import gbnf_to_lark
from outlines_core.json_schema import build_regex_from_schema

from deepinfer.audit.structured_check import _parser, violation

BATTERY = Path(__file__).parent / "fixtures" / "structured" / "battery.jsonl"
ENTRIES = [json.loads(line) for line in BATTERY.read_text(encoding="utf-8").splitlines() if line.strip()]
BY_ID = {entry["id"]: entry for entry in ENTRIES}
MIN_COUNTS = {"regex": 12, "json_schema": 12, "lark": 6, "ebnf": 3, "choice": 3}
WHITESPACE = r"[ ]?"
MAX_TOKENS_CAP = 160
EOS_SLACK = 4  # max_tokens must exceed the longest output by this much (room for EOS)
WALKS = 6  # random walks per entry: half never choose EOS while anything else is allowed
EOS = 256

# Comments, string literals and regex literals of a Lark grammar.
LARK_LITERAL = re.compile(r'//[^\n]*|"(?:\\.|[^"\\\n])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*')


def kind(structured: dict) -> str:
    """The kind: "regex", "json_schema", "choice", or the grammar syntax ("lark" / "ebnf")."""
    return structured["syntax"] if "grammar" in structured else next(iter(structured))


def entries_of(*kinds: str) -> list[dict]:
    return [entry for entry in ENTRIES if kind(entry["structured"]) in kinds]


def ids(entries: list[dict]) -> list[str]:
    return [entry["id"] for entry in entries]


def schema_text(structured: dict) -> str:
    schema = structured["json_schema"]
    return schema if isinstance(schema, str) else json.dumps(schema)


def regex_of(structured: dict) -> str:
    """The regex of a regex entry, the outlines-core regex of a schema entry, or a choice alternation."""
    if "regex" in structured:
        return structured["regex"]
    if "choice" in structured:
        return "|".join(re.escape(choice) for choice in structured["choice"])
    return build_regex_from_schema(schema_text(structured), whitespace_pattern=WHITESPACE)


def lark_text(structured: dict) -> str:
    """The grammar as llguidance reads it (GBNF converted to its Lark dialect)."""
    grammar = structured["grammar"]
    return gbnf_to_lark(grammar) if structured["syntax"] == "ebnf" else grammar


def unbounded_quantifiers(regex: str) -> list[int]:
    """Positions of `*`, `+`, `{n,}` outside escapes and character classes (where they are literal)."""
    found, i, in_class = [], 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 1
            i += regex.startswith("^", i)
            i += regex.startswith("]", i)  # a leading "]" is a literal
            continue
        elif char in "*+" or re.match(r"\{\d*,\}", regex[i:]):
            found.append(i)
        i += 1
    return found


def utf8_width(code_point: int) -> int:
    return 1 if code_point < 0x80 else 2 if code_point < 0x800 else 3 if code_point < 0x10000 else 4


def class_width(item: tuple) -> int:
    """Widest UTF-8 character of one character-class item (negations and categories: 4)."""
    op, arg = item
    if op is sre_constants.LITERAL:
        return utf8_width(arg)
    if op is sre_constants.RANGE:
        return utf8_width(arg[1])
    return 4


def max_utf8_len(regex: str) -> float:
    """UTF-8 length of the longest full match of ``regex`` (math.inf when unbounded)."""
    return _max_len(sre_parser.parse(regex))


def _max_len(items) -> float:
    total = 0.0
    for op, arg in items:
        if op is sre_constants.LITERAL:
            total += utf8_width(arg)
        elif op in (sre_constants.NOT_LITERAL, sre_constants.ANY):
            total += 4
        elif op is sre_constants.IN:
            total += max(class_width(item) for item in arg)
        elif op is sre_constants.BRANCH:
            total += max(_max_len(branch) for branch in arg[1])
        elif op is sre_constants.SUBPATTERN:
            total += _max_len(arg[-1])
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT):
            _, high, sub = arg
            width = _max_len(sub)
            if width and high == sre_constants.MAXREPEAT:
                return math.inf
            total += high * width if width else 0
        elif op is not sre_constants.AT:
            raise AssertionError(f"unexpected regex construct {op}")
    return total


def grammar_max_len(parser: Lark) -> float:
    """UTF-8 length of the longest sentence of ``parser``'s grammar (math.inf if recursive/unbounded)."""
    widths = {t.name: len(t.pattern.value.encode()) if isinstance(t.pattern, PatternStr)
              else max_utf8_len(t.pattern.to_regexp()) for t in parser.terminals}
    expansions = defaultdict(list)
    for rule in parser.rules:
        expansions[rule.origin.name].append(rule.expansion)
    memo: dict[str, float] = {}

    def longest(name: str, active: frozenset[str]) -> float:
        if name in active:
            return math.inf
        if name not in memo:
            memo[name] = max(sum(widths[s.name] if s.is_term else longest(s.name, active | {name})
                                 for s in expansion) for expansion in expansions[name])
        return memo[name]

    return longest("start", frozenset())


def output_bound(structured: dict) -> float:
    """UTF-8 length of the longest output the constraint allows."""
    if "choice" in structured:
        return max(len(choice.encode()) for choice in structured["choice"])
    if "grammar" in structured:
        return grammar_max_len(_parser(structured["grammar"], structured["syntax"]))
    return max_utf8_len(regex_of(structured))


class ByteTokenizer:
    """One token per byte plus EOS: the shortest tokens a model can emit."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [EOS]  # else llguidance reads EOS as the text "<eos>"

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


@functools.cache
def byte_vocabulary() -> outlines_core.Vocabulary:
    return outlines_core.Vocabulary(EOS, {bytes([b]): [b] for b in range(256)})


@functools.cache
def byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))


def pick(allowed: list[int], rng: random.Random, avoid_eos: bool) -> int:
    """A random allowed token (sorted first: outlines-core's order is not guaranteed)."""
    allowed = sorted(allowed)
    choices = [t for t in allowed if t != EOS] if avoid_eos else allowed
    return rng.choice(choices or allowed)


def walk_index(index: outlines_core.Index, rng: random.Random, avoid_eos: bool, cap: int) -> list[int]:
    """Random tokens allowed by an outlines-core index, up to and including EOS."""
    state, tokens = index.get_initial_state(), []
    while len(tokens) <= cap:
        token = pick(index.get_allowed_tokens(state), rng, avoid_eos)
        tokens.append(token)
        if token == EOS:
            return tokens
        state = index.get_next_state(state, token)
    raise AssertionError(f"no EOS after {cap} tokens: {bytes(tokens)!r}")


def walk_matcher(matcher: llguidance.LLMatcher, rng: random.Random, avoid_eos: bool, cap: int) -> list[int]:
    """Random tokens allowed by an llguidance matcher, ending with EOS (counted even if it stopped)."""
    tokens: list[int] = []
    while not matcher.is_stopped() and len(tokens) <= cap:
        mask = int.from_bytes(matcher.compute_bitmask(), "little")
        token = pick([t for t in range(EOS + 1) if mask >> t & 1], rng, avoid_eos)
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    assert matcher.is_stopped() and not matcher.is_error(), (matcher.get_error(), bytes(tokens[:cap]))
    return tokens if tokens and tokens[-1] == EOS else [*tokens, EOS]


# ---------------------------------------------------------------- (a) battery shape and examples

def test_battery_ids_counts_and_fields():
    assert len(BY_ID) == len(ENTRIES), [i for i, n in Counter(ids(ENTRIES)).items() if n > 1]
    counts = Counter(kind(entry["structured"]) for entry in ENTRIES)
    for name, minimum in MIN_COUNTS.items():
        assert counts[name] >= minimum, (name, counts[name])
    assert set(counts) == set(MIN_COUNTS)
    for entry in ENTRIES:
        assert set(entry) == {"id", "structured", "max_tokens", "example"}, entry["id"]
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", entry["id"]), entry["id"]
        assert isinstance(entry["example"], str), entry["id"]
        assert isinstance(entry["max_tokens"], int) and 0 < entry["max_tokens"] <= MAX_TOKENS_CAP, entry["id"]


@pytest.mark.parametrize("entry", ENTRIES, ids=ids(ENTRIES))
def test_example_is_valid(entry):
    assert violation(entry["structured"], entry["example"]) is None


# ---------------------------------------------------------------- (b) reasons for invalid texts

LARK_DIALECT = {"grammar": '%llguidance {}\nstart: "ab"{2,3} X\nX: /[0-9]/{1}', "syntax": "lark"}


@pytest.mark.parametrize("structured, text, reason", [
    (BY_ID["regex-iso-date"]["structured"], "2024-13-01", "does not match the regex"),
    (BY_ID["regex-iso-date"]["structured"], "2024-01-01 ", "does not match the regex"),
    (BY_ID["regex-ipv4-address"]["structured"], "256.1.1.1", "does not match the regex"),
    (BY_ID["regex-hex-color"]["structured"], "#12345", "does not match the regex"),
    (BY_ID["schema-tool-get-weather-args"]["structured"], '{"city": "Paris"', "invalid JSON:"),
    (BY_ID["schema-tool-get-weather-args"]["structured"], "NaN", "invalid JSON: NaN is not valid JSON"),
    (BY_ID["schema-tool-get-weather-args"]["structured"], '{"city": "Paris", "unit": "kelvin"}', "schema: 'kelvin'"),
    (BY_ID["schema-tool-get-weather-args"]["structured"], '{"city": "Paris", "unit": "celsius", "x": 1}',
     "schema: Additional properties"),
    (BY_ID["schema-review-bounded-integers"]["structured"], '{"stars": 6, "would_recommend": true}', "schema: 6"),
    (BY_ID["schema-api-key-uuid"]["structured"],
     '{"id": "0b9e5f2a-7c41-4d2e-9a63-5f1e8d7c6b4", "created": "2025-01-28", "scopes": ["read"]}',
     "schema: '0b9e5f2a-7c41-4d2e-9a63-5f1e8d7c6b4' is not a 'uuid'"),
    (BY_ID["schema-tool-call-envelope-text"]["structured"], '{"name": "delete_event", "arguments": {}}', "schema:"),
    (BY_ID["lark-arithmetic"]["structured"], "1 +", "grammar:"),
    (BY_ID["lark-arithmetic"]["structured"], "1 + 2 + 3 + 4", "grammar:"),
    (BY_ID["lark-sql-select"]["structured"], "SELECT * FROM users", "grammar:"),
    (BY_ID["gbnf-yes-no-reason"]["structured"], "maybe, because why.", "grammar:"),
    (BY_ID["gbnf-date-list"]["structured"], "2024-13-01", "grammar:"),
    (LARK_DIALECT, "abab", "grammar:"),
    (LARK_DIALECT, "abababab1", "grammar:"),
    (BY_ID["choice-sentiment"]["structured"], "Positive", "not one of the choices"),
    (BY_ID["choice-sentiment"]["structured"], "", "not one of the choices"),
])
def test_invalid_text_reason(structured, text, reason):
    found = violation(structured, text)
    assert found is not None and found.startswith(reason), found
    assert "\n" not in found


def test_llguidance_lark_spellings_are_rewritten():
    assert violation(LARK_DIALECT, "ababab7") is None
    assert violation(LARK_DIALECT, "abab7") is None


@pytest.mark.parametrize("structured", [
    None, [], {}, {"regex": "a", "choice": ["a"]}, {"regex": "("}, {"regex": 3}, {"regex": "a", "syntax": "lark"},
    {"json_schema": "{not json"}, {"json_schema": "[1]"}, {"json_schema": {"type": "strin"}},
    {"grammar": 'start: "a"'}, {"grammar": 'start: "a"', "syntax": "peg"}, {"grammar": "start: x", "syntax": "lark"},
    {"grammar": 'root ::= foo', "syntax": "ebnf"}, {"choice": []}, {"choice": "ab"}, {"choices": ["a"]},
])
def test_malformed_structured_raises(structured):
    with pytest.raises(ValueError) as info:
        violation(structured, "a")
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- (c) everything compiles

@pytest.mark.parametrize("entry", entries_of("regex", "json_schema"), ids=ids(entries_of("regex", "json_schema")))
def test_regex_and_schema_compile(entry):
    structured = entry["structured"]
    if "json_schema" in structured:
        Draft202012Validator.check_schema(json.loads(schema_text(structured)))
    re.compile(regex_of(structured))


@pytest.mark.parametrize("entry", entries_of("lark", "ebnf"), ids=ids(entries_of("lark", "ebnf")))
def test_grammar_validates_in_llguidance(entry):
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(
        lark_text(entry["structured"]))) == ""


# ---------------------------------------------------------------- (d) boundedness

def test_unbounded_quantifier_scan():
    assert unbounded_quantifiers(r"a+b*c{2,}") == [1, 3, 5]
    assert unbounded_quantifiers(r"a*?") == [1]
    assert unbounded_quantifiers(r"\+[+*]{1,3}\*[]*][^]+]\\{2}x{,3}") == []
    assert unbounded_quantifiers(r"\\+") == [2]
    assert max_utf8_len(r"a{2,}") == math.inf
    assert max_utf8_len(r"(ab|c){0,3}[^x]?\.é") == 6 + 4 + 1 + 2


@pytest.mark.parametrize("entry", entries_of("regex", "json_schema"), ids=ids(entries_of("regex", "json_schema")))
def test_regex_is_bounded(entry):
    regex = regex_of(entry["structured"])
    assert unbounded_quantifiers(regex) == [], regex


@pytest.mark.parametrize("entry", entries_of("lark", "ebnf"), ids=ids(entries_of("lark", "ebnf")))
def test_grammar_is_bounded(entry):
    """Approximate lexical check: no `*`/`+` operator outside comments, strings and regex literals,
    no `{n,}`, no `%ignore` (it allows unbounded whitespace), and every regex
    literal free of unbounded quantifiers.  The exact bound is in test_max_tokens_covers_longest_output."""
    text = lark_text(entry["structured"])
    assert "%ignore" not in text
    outside = LARK_LITERAL.sub(" ", text)
    assert re.findall(r"[*+]|\{\d*,\}", outside) == [], outside
    for literal in re.findall(r"/(?:\\.|[^/\\\n])+/", text):
        assert unbounded_quantifiers(literal[1:-1]) == [], literal


@pytest.mark.parametrize("entry", ENTRIES, ids=ids(ENTRIES))
def test_max_tokens_covers_longest_output(entry):
    bound = output_bound(entry["structured"])
    assert bound + EOS_SLACK <= entry["max_tokens"], (bound, entry["max_tokens"])


# ---------------------------------------------------------------- random model

def random_outputs(structured: dict, rng: random.Random, cap: int) -> list[list[int]]:
    """WALKS token sequences from each compiler that may serve the constraint: llguidance for grammars
    and schemas (compact JSON), outlines-core for regexes, schemas and choices."""
    modes = [i % 2 == 0 for i in range(WALKS)]
    outputs = []
    if "grammar" in structured or "json_schema" in structured:
        grammar = (llguidance.LLMatcher.grammar_from_lark(lark_text(structured)) if "grammar" in structured
                   else llguidance.LLMatcher.grammar_from_json_schema(
                       schema_text(structured), defaults={"whitespace_flexible": False}))
        outputs += [walk_matcher(llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0), rng, avoid_eos, cap)
                    for avoid_eos in modes]
    if "grammar" not in structured:
        index = outlines_core.Index(regex_of(structured), byte_vocabulary())
        outputs += [walk_index(index, rng, avoid_eos, cap) for avoid_eos in modes]
    return outputs


@pytest.mark.parametrize("entry", ENTRIES, ids=ids(ENTRIES))
def test_random_walks_finish_valid_within_max_tokens(entry):
    structured, max_tokens = entry["structured"], entry["max_tokens"]
    for tokens in random_outputs(structured, random.Random(entry["id"]), max_tokens):
        text = bytes(tokens[:-1]).decode("utf-8")
        assert len(tokens) <= max_tokens, text
        assert violation(structured, text) is None, text
