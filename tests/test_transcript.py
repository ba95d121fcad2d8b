"""Tests for harness.transcript: the checks of canonical (Chat Completions shaped) transcripts, each
broken rule's one-line error, the parts a text-only model cannot read collected rather than raised,
content as text, and tool-call arguments in canonical or verbatim form."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.harness.transcript import (
    TranscriptError,
    UnsupportedContentError,
    arguments_object,
    canonical_arguments,
    check_messages,
    content_text,
)

CLOCK_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
USER_MSG = {"role": "user", "content": "hi"}
TOOL_MSG = {"role": "tool", "content": "ok"}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/receipt.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}
PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}


def _call(name: str, arguments, call_id: str = "x") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CALLING = {"role": "assistant", "tool_calls": [_call("f", "{}")]}


def _with_args(arguments) -> list[dict]:
    return [USER_MSG, {"role": "assistant", "content": "", "tool_calls": [_call("f", arguments)]}]


ERROR_CASES = [
    ([], None, "messages must be a non-empty list"),
    ({"role": "user"}, None, "messages must be a non-empty list"),
    (["hi"], None, "message 0: expected an object, got str"),
    ([{"content": "hi"}], None, "message 0: missing 'role'"),
    (
        [USER_MSG, USER_MSG, {"role": "robot", "content": "x"}],
        None,
        "message 2: unknown role 'robot' (expected one of system, developer, user, assistant, tool)",
    ),
    ([{"role": "user"}], None, "message 0: missing 'content'"),
    ([{"role": "user", "content": None}], None, "message 0: content must be a string or a list of content parts"),
    (
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "hologram"}]}],
        None,
        "message 0: content[1].type: unknown content part type 'hologram'",
    ),
    ([{"role": "user", "content": ["hi"]}], None, "message 0: content[0] must be a content part object"),
    (
        [{"role": "user", "content": [{"type": "document", "source": "x"}]}],
        None,
        "message 0: content[0].source must be an object",
    ),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], None, "message 0: content[0].text must be a string"),
    (
        [USER_MSG, {"role": "system", "content": "late"}],
        None,
        "message 1: system message after the conversation started (system and developer messages must come first)",
    ),
    (
        [USER_MSG, {"role": "developer", "content": "late"}],
        None,
        "message 1: developer message after the conversation started (system and developer messages must come first)",
    ),
    (
        [USER_MSG, {"role": "assistant"}],
        None,
        "message 1: assistant message needs 'content', 'refusal' or 'tool_calls'",
    ),
    ([USER_MSG, {"role": "assistant", "refusal": 1}], None, "message 1: refusal must be a string"),
    (
        [USER_MSG, {"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}],
        None,
        "message 1: function_call is the legacy shape of tool_calls (not supported here)",
    ),
    ([USER_MSG, {"role": "assistant", "content": "a", "unrendered": {}}], None, "message 1: unrendered must be a list"),
    (
        [USER_MSG, {"role": "assistant", "content": "a", "reasoning_content": 3}],
        None,
        "message 1: reasoning_content must be a string",
    ),
    (
        [{**USER_MSG, "tool_calls": [_call("f", "{}")]}],
        None,
        "message 0: tool_calls are only allowed on assistant messages",
    ),
    ([USER_MSG, {"role": "assistant", "tool_calls": {"f": "{}"}}], None, "message 1: tool_calls must be a list"),
    ([USER_MSG, {"role": "assistant", "tool_calls": ["f"]}], None, "message 1: tool_calls[0] must be an object"),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"type": "code", "function": {}}]}],
        None,
        "message 1: tool_calls[0].type must be 'function' or 'custom'",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"type": "custom", "custom": {"name": "patch"}}]}],
        None,
        "message 1: tool_calls[0].custom.input must be a string",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{**_call("f", "{}"), "server": "yes"}]}],
        None,
        "message 1: tool_calls[0].server must be true or false",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"type": "function"}]}],
        None,
        "message 1: tool_calls[0].function must be an object",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [_call("", "{}")]}],
        None,
        "message 1: tool_calls[0].function.name must be a non-empty string",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}],
        None,
        "message 1: tool_calls[0].function missing 'arguments'",
    ),
    (_with_args({"a": float("inf")}), None, "message 1: tool_calls[0].function.arguments is not valid JSON"),
    (_with_args({"a": {1, 2}}), None, "message 1: tool_calls[0].function.arguments is not valid JSON"),
    (_with_args(7), None, "message 1: tool_calls[0].function.arguments must be a string or a JSON object"),
    ([USER_MSG, TOOL_MSG], None, "message 1: tool message must follow an assistant message with tool_calls"),
    (
        [USER_MSG, {"role": "assistant", "content": "no calls"}, TOOL_MSG],
        None,
        "message 2: tool message must follow an assistant message with tool_calls",
    ),
    ([USER_MSG, CALLING, {**TOOL_MSG, "tool_call_id": 0}], None, "message 2: tool_call_id must be a string"),
    ([USER_MSG, CALLING, {"role": "tool"}], None, "message 2: missing 'content'"),
    ([USER_MSG, CALLING, {**TOOL_MSG, "is_error": "yes"}], None, "message 2: is_error must be true or false"),
    ([USER_MSG], {"type": "function"}, "tools must be a list"),
    ([USER_MSG], ["f"], "tools[0] must be an object"),
    ([USER_MSG], [CLOCK_TOOL, {"type": 5}], "tools[1].type must be a non-empty string"),
    ([USER_MSG], [{"type": "function"}], "tools[0].function must be an object"),
    (
        [USER_MSG],
        [{"type": "function", "function": {"description": "x"}}],
        "tools[0].function.name must be a non-empty string",
    ),
    (
        [USER_MSG],
        [{"function": {"name": "f", "parameters": {"default": float("nan")}}}],
        "tools[0].function is not valid JSON",
    ),
]


@pytest.mark.parametrize("messages,tools,expected", ERROR_CASES)
def test_transcript_errors(messages, tools, expected):
    with pytest.raises(TranscriptError) as e:
        check_messages(messages, tools)
    assert str(e.value) == expected
    assert e.value.kind == "malformed" and isinstance(e.value, ValueError)


def test_well_formed_transcripts_pass():
    """Everything the shape holds beyond Chat Completions' own passes: tool outputs grouped after calls,
    several leading system and developer messages, the text part kinds, refusals, custom and server
    calls, other tools, `unrendered`, a tool message's `is_error` and `name`, text documents. A call's
    name that spells a special token is text like any other: the recipe encodes it as text (and
    refuses a tool of such a name itself)."""
    calls = [_call("f", "{}"), _call("g", {}), {"id": "c", "type": "custom", "custom": {"name": "patch", "input": "+x"}}]
    document = {"type": "document", "title": "Fare rules", "context": "Basic economy", "citations": {"enabled": True},
                "source": {"type": "text", "media_type": "text/plain", "data": "No refunds."}}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}, document]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": calls,
         "unrendered": [{"type": "redacted_thinking", "data": "opaque"}]},
        TOOL_MSG,
        {**TOOL_MSG, "tool_call_id": "x", "name": "g", "is_error": True},
        {**TOOL_MSG, "unrendered": [{"type": "web_search_tool_result", "content": []}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}],
         "tool_calls": [{**_call("web_search", {"q": "x"}), "server": True}, _call("a<｜tool▁sep｜>b", "{")]},
        {"role": "tool", "tool_call_id": "x", "content": "r"},
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}], "refusal": "Not that."},
    ]
    tools = [CLOCK_TOOL, {"type": "custom", "name": "patch", "description": "Edit files"},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}, {"function": {"name": "g"}}]
    assert check_messages(messages, tools) == []
    assert check_messages(messages, []) == []


def test_content_text_joins_parts_by_line():
    """The text a recorded tool result answers with: parts joined by newlines, a document as its title,
    context and text; errors name the place `where` says."""
    assert content_text("as is") == "as is"
    assert content_text([{"type": "refusal", "refusal": "No."}, {"type": "output_text", "text": "c"}]) == "No.\nc"
    document = {"type": "document", "title": "Fare rules", "context": "Basic economy",
                "source": {"type": "text", "media_type": "text/plain", "data": "No refunds."}}
    refund = [document, {"type": "text", "text": "Refund?"}]
    assert content_text(refund) == "Fare rules\nBasic economy\nNo refunds.\nRefund?"
    nested = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a"}, "b"]}}
    with pytest.raises(TranscriptError) as e:
        content_text([nested], "result")
    assert str(e.value) == "result[0].source.content[1] must be a content part object"


def test_unreadable_parts_are_collected_and_the_rest_still_checked():
    """A part a text-only model cannot read is well-formed: `check_messages` returns one error per such
    part, in order, and `content_text` raises it."""
    messages = [{"role": "user", "content": [IMAGE]}, {"role": "assistant", "content": "Send them."},
                {"role": "user", "content": [{"type": "text", "text": "Here:"}, IMAGE, AUDIO, PDF]}]
    found = check_messages(messages)
    assert [(str(e), e.kind) for e in found] == [
        ("message 0: content[0]: an image ('image_url') cannot be read by a text-only model", "unsupported_content"),
        ("message 2: content[1]: an image ('image_url') cannot be read by a text-only model", "unsupported_content"),
        ("message 2: content[2]: audio ('input_audio') cannot be read by a text-only model", "unsupported_content"),
        ("message 2: content[3]: a document ('document' with a 'base64' source) cannot be read by a text-only model",
         "unsupported_content"),
    ]
    assert all(isinstance(e, TranscriptError) for e in found)
    with pytest.raises(UnsupportedContentError) as e:
        content_text(messages[2]["content"], "message 2: content")
    assert str(e.value) == str(found[1])
    with pytest.raises(TranscriptError) as e:
        check_messages([*messages, {"role": "system", "content": "late"}])
    assert e.value.kind == "malformed"


@pytest.mark.parametrize("arguments", ['{"city": "Os', "", '{"a": NaN}', "null", "[1, 2]", " {} trailing"])
def test_arguments_that_are_not_a_json_object_stay_verbatim(arguments):
    """Models emit empty or cut-off arguments; a transcript keeps them exactly as emitted."""
    assert canonical_arguments(arguments) == arguments
    assert arguments_object(arguments) is None
    assert check_messages(_with_args(arguments)) == []


def test_json_object_arguments_are_canonical():
    expected = '{"a":"é","b":1}'
    assert canonical_arguments('{ "b": 1, "a": "é" }') == canonical_arguments({"b": 1, "a": "é"}) == expected
    assert arguments_object('{ "b": 1, "a": "é" }') == {"a": "é", "b": 1}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), _JSON, max_size=4), indent=st.sampled_from([None, 0, 2]),
       ascii_only=st.booleans())
def test_canonical_arguments_of_any_spelling_of_an_object(value, indent, ascii_only):
    """However a JSON object is spelled (spacing, key order, escapes), its canonical form is one text,
    which reads back as the same object."""
    spelled = json.dumps(dict(reversed(list(value.items()))), indent=indent, ensure_ascii=ascii_only)
    canonical = canonical_arguments(spelled)
    assert canonical == canonical_arguments(value) and json.loads(canonical) == value
    assert canonical_arguments(canonical) == canonical


_TEXT_PART = st.builds(lambda text: {"type": "text", "text": text}, st.text(max_size=6))
_UNREADABLE = st.sampled_from([IMAGE, AUDIO, PDF])
_CONTENT = st.text(max_size=6) | st.lists(_TEXT_PART | _UNREADABLE, max_size=3)
_CALL = st.builds(_call, st.text(min_size=1, max_size=6), st.text(max_size=6) | st.dictionaries(st.text(max_size=3), _JSON))
_EXCHANGE = st.tuples(_CONTENT, st.none() | _CONTENT, st.lists(_CALL, max_size=2), st.lists(_CONTENT, max_size=2))


@settings(max_examples=100, deadline=None)
@given(system=st.none() | _CONTENT, exchanges=st.lists(_EXCHANGE, min_size=1, max_size=3))
def test_well_formed_transcripts_report_exactly_their_unreadable_parts(system, exchanges):
    """Any transcript of the shape (a system message, then user turns each answered by an assistant
    message whose calls are answered by tool messages) passes, and what comes back is one error per
    unreadable part, naming it, in order."""
    messages: list[dict] = [{"role": "system", "content": system}] if system is not None else []
    for user, answer, calls, outputs in exchanges:
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": answer if answer is not None or calls else "",
                         "tool_calls": calls})
        messages += [{"role": "tool", "content": output} for output in outputs[:len(calls)]]
    expected = [f"message {i}: content[{j}]" for i, m in enumerate(messages) if isinstance(m["content"], list)
                for j, part in enumerate(m["content"]) if part in (IMAGE, AUDIO, PDF)]
    assert [str(e).rsplit(": ", 1)[0] for e in check_messages(messages)] == expected
