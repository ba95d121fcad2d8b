"""Check a generated text against a structured-output constraint.

``violation(structured, text)`` returns None when ``text`` satisfies the
constraint and otherwise a one-line reason.  ``structured`` is a dict with
exactly one of these forms:

* ``{"regex": pattern}``: ``re.fullmatch`` (write patterns in the subset that
  Python's ``re`` and Rust's ``regex`` crate read identically).
* ``{"json_schema": dict, bool or JSON text}``: ``json.loads`` (NaN/Infinity
  rejected) then ``jsonschema`` validation with format checking on; the
  draft is taken from ``$schema``, defaulting to 2020-12.
* ``{"grammar": text, "syntax": "lark"}``: parsed with the ``lark`` package
  (Earley, start rule ``start``).
* ``{"grammar": text, "syntax": "ebnf"}``: GBNF, converted with llguidance's
  ``gbnf_to_lark`` (start rule ``root`` becomes ``start``), then as Lark.
* ``{"choice": [str, ...]}``: membership.

Supported Lark subset: plain Lark as read by the ``lark`` package, plus two
llguidance spellings that are rewritten first: a ``%llguidance {...}`` line is
dropped, and ``{n}`` / ``{m,n}`` repetition after an item becomes ``~ n`` /
``~ m..n``.  Other llguidance extensions (``%json``, ``%regex``, token
attributes, lazy lexemes, ``{m,}``) are not supported, and since the Earley
dynamic lexer rejects terminals that can match the empty string, GBNF rules
made only of terminals must not match the empty string.  Lark's language is
at least llguidance's (llguidance's lexer only narrows how a text splits into
terminals), so every text llguidance can produce is accepted.

Malformed ``structured`` values raise ``ValueError`` with a one-line message.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
from jsonschema.exceptions import best_match
from lark import Lark
from lark.exceptions import LarkError
from llguidance.gbnf_to_lark import gbnf_to_lark

_KINDS = ("regex", "json_schema", "grammar", "choice")

# Comments, string literals and regex literals are kept as they are; a
# `{n}` / `{m,n}` quantifier outside them is captured.
_LARK_TOKEN = re.compile(
    r'//[^\n]*|"(?:\\.|[^"\\\n])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*'
    r"|\{(\d+)(?:,(\d+))?\}"
)


def violation(structured: dict, text: str) -> str | None:
    """Return None when ``text`` satisfies ``structured``, else a one-line reason."""
    kind = _kind(structured)
    if kind == "regex":
        return None if _regex(structured["regex"]).fullmatch(text) else "does not match the regex"
    if kind == "json_schema":
        return _schema_violation(structured["json_schema"], text)
    if kind == "grammar":
        try:
            _parser(structured["grammar"], structured["syntax"]).parse(text)
        except LarkError as exc:
            return f"grammar: {_first_line(exc)}"
        return None
    return None if text in structured["choice"] else "not one of the choices"


def _kind(structured: object) -> str:
    """Validate the shape of ``structured`` and return its kind."""
    if not isinstance(structured, dict):
        raise ValueError(f"structured must be a dict, got {type(structured).__name__}")
    kinds = [k for k in _KINDS if k in structured]
    if len(kinds) != 1:
        raise ValueError(f"structured needs exactly one of {', '.join(_KINDS)}; got keys {sorted(structured)}")
    kind = kinds[0]
    allowed = {kind, "syntax"} if kind == "grammar" else {kind}
    if set(structured) != allowed:
        raise ValueError(f"unexpected keys for {kind}: {sorted(set(structured) - allowed)}")
    value = structured[kind]
    if kind == "grammar":
        if not isinstance(value, str) or structured.get("syntax") not in ("lark", "ebnf"):
            raise ValueError('grammar needs a string grammar and syntax "lark" or "ebnf"')
    elif kind == "choice":
        if not value or not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ValueError("choice must be a non-empty list of strings")
    elif kind == "regex" and not isinstance(value, str):
        raise ValueError("regex must be a string")
    elif kind == "json_schema" and not isinstance(value, (dict, bool, str)):
        raise ValueError("json_schema must be a dict, a bool or a JSON string")
    return kind


def _first_line(exc: Exception) -> str:
    """First non-empty line of an exception's message."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


@functools.lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str]:
    """Compile a regex constraint."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid regex: {exc}") from None


def _schema_violation(schema: dict | bool | str, text: str) -> str | None:
    """Reason ``text`` is not one JSON value valid under ``schema``, or None."""
    validator = _validator(schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))
    try:
        instance = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        return f"invalid JSON: {_first_line(exc)}"
    error = best_match(validator.iter_errors(instance))
    return None if error is None else f"schema: {_first_line(error)}"


def _reject_constant(name: str) -> None:
    """Refuse the non-JSON constants NaN, Infinity and -Infinity."""
    raise ValueError(f"{name} is not valid JSON")


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> jsonschema.protocols.Validator:
    """Build a format-checking validator for a schema given as JSON text."""
    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        raise ValueError(f"json_schema is not valid JSON: {_first_line(exc)}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema must be a JSON object or boolean")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"invalid json_schema: {_first_line(exc)}") from None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@functools.lru_cache(maxsize=256)
def _parser(grammar: str, syntax: str) -> Lark:
    """Compile a Lark (``syntax="lark"``) or GBNF (``syntax="ebnf"``) grammar."""
    try:
        text = gbnf_to_lark(grammar) if syntax == "ebnf" else grammar
    except Exception as exc:  # the converter raises several exception types
        raise ValueError(f"invalid ebnf grammar: {_first_line(exc)}") from None
    try:
        return Lark(_plain_lark(text), start="start", parser="earley")
    except LarkError as exc:
        raise ValueError(f"invalid {syntax} grammar: {_first_line(exc)}") from None


def _plain_lark(text: str) -> str:
    """Rewrite llguidance-only spellings (see module docstring) into plain Lark."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("%llguidance")]

    def repetition(match: re.Match[str]) -> str:
        low, high = match.group(1), match.group(2)
        if low is None:
            return match.group(0)
        return f" ~ {low}" if high is None else f" ~ {low}..{high}"

    return _LARK_TOKEN.sub(repetition, "\n".join(lines))
