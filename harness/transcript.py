"""Transcripts: agent conversations as canonical Chat Completions shaped messages and tools, and their
checks.

A trace line is read into this shape (`harness.trace_import` reads Anthropic Messages and OpenAI
Responses lines; `harness.traces` converts a chat line's legacy function calling) and written back out
of it (`harness.trace_export`). It is never rendered: each turn is served as the request body its
client sent, which DeepSeek's official recipe converts and renders (`recipe.official`). Nor is it the
recipe's reading: the recipe reads request bodies and refuses or drops what DeepSeek's API has no
place for (a provider's server tools, an assistant's refusal), while a transcript keeps everything its
client wrote and recorded. The reading is used for checking a line whole when it is loaded, for the
text of a recorded tool result (`content_text`), and for tool-call arguments in the form a
free-running stub matches them (`canonical_arguments`).

The shape, Chat Completions' own with what a transcript needs so that nothing is lost:
- roles system, developer (OpenAI's newer name for system), user, assistant and tool;
- content: a string or a list of parts: text (`text`, `input_text`, `output_text`), `refusal`,
  Anthropic `document` with a text or content source, and parts a text-only model cannot read
  (`UNREADABLE_PARTS`, a document with a base64, URL or file source);
- an assistant's `refusal` and `reasoning_content`; its `tool_calls`, function calls (arguments a JSON
  object or any text, as the model emitted them) or custom calls `{"id", "type": "custom", "custom":
  {"name", "input"}}`, either marked `"server": true` when the provider ran it;
- a tool message's `tool_call_id`, `is_error` and `name`;
- `unrendered` on any message: source objects with no place in this shape, kept verbatim;
- tools: function tools, and any other tool (custom, a provider's server tool) kept as given.

Rules (`check_messages`; each broken one is a one-line `TranscriptError` naming the message index and
field): system and developer messages come first; tool messages follow an assistant message with tool
calls (or another tool message); `tool_calls` only on assistant messages (the legacy `function_call`
is refused: harness.traces converts it); an assistant message needs content, a refusal or tool calls;
arguments are a string or a JSON object that JSON can write (no NaN), a custom call's input a string,
`server` and `is_error` true or false; `tool_call_id`, when given, is a string; `unrendered` is a list;
names are non-empty strings; every part, tool and field has the shape above. A part a text-only model
cannot read is well-formed: `check_messages` returns it (an `UnsupportedContentError`) rather than
raising, and `content_text` raises it.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.errors import DeepInferError

ROLES = ("system", "developer", "user", "assistant", "tool")
SYSTEM_ROLES = ("system", "developer")
TEXT_PARTS = ("text", "input_text", "output_text")
UNREADABLE_PARTS = {
    "image_url": "an image", "input_image": "an image", "image": "an image", "input_audio": "audio",
    "file": "a file", "input_file": "a file",
}
_INVALID = object()


class TranscriptError(DeepInferError, ValueError):
    """Messages or tools that do not fit the transcript shape."""

    kind = "malformed"


class UnsupportedContentError(TranscriptError):
    """Well-formed content that a text-only model cannot read (an image, audio)."""

    kind = "unsupported_content"


_Unreadable = list[UnsupportedContentError] | None  # where unreadable parts are collected; None: raise them


def check_messages(messages: list[dict], tools: list[dict] | None = None) -> list[UnsupportedContentError]:
    """Check a transcript against the rules (see the module docstring); the parts a text-only model
    cannot read are returned, one error per part in order, so that a line is validated whole."""
    if not isinstance(messages, list) or not messages:
        raise TranscriptError("messages must be a non-empty list")
    unreadable: list[UnsupportedContentError] = []
    prev_role = None
    takes_outputs = False  # the previous message was an assistant tool call or a tool output
    for i, msg in enumerate(messages):
        role = _role(msg, i)
        if msg.get("tool_calls") and role != "assistant":
            raise TranscriptError(f"message {i}: tool_calls are only allowed on assistant messages")
        if "function_call" in msg:
            raise TranscriptError(f"message {i}: function_call is the legacy shape of tool_calls (not supported here)")
        if not isinstance(msg.get("unrendered", []), list):
            raise TranscriptError(f"message {i}: unrendered must be a list")
        if role in SYSTEM_ROLES and prev_role not in (None, *SYSTEM_ROLES):
            raise TranscriptError(f"message {i}: {role} message after the conversation started "
                                  "(system and developer messages must come first)")
        if role == "assistant":
            _check_assistant(msg, i, unreadable)
        else:
            if role == "tool":
                _check_tool_output(msg, i, takes_outputs)
            _content(msg, i, unreadable)
        takes_outputs = role == "tool" or bool(msg.get("tool_calls"))
        prev_role = role
    if tools is not None:
        _check_tools(tools)
    return unreadable


def content_text(content: Any, where: str = "content") -> str:
    """Message content (a string or a list of parts) as text, parts joined by newlines (a document as
    its title, context and text, one per line); `where` names it in errors. UnsupportedContentError
    for a part a text-only model cannot read."""
    return _content_text(content, where, None)


def canonical_arguments(arguments: str | dict) -> str:
    """Tool-call arguments as recorded calls are matched: canonical JSON (compact, sorted keys,
    non-ASCII kept) of a JSON object, given as a dict or as its text; any other text verbatim (models
    emit empty, cut-off or otherwise invalid arguments)."""
    value = arguments_object(arguments)
    return _canonical(value) if value is not None else arguments


def arguments_object(arguments: str | dict) -> dict | None:
    """Tool-call arguments as a JSON object (given as a dict or as strict JSON text); None for text
    that is not one."""
    value = arguments if isinstance(arguments, dict) else _loads(arguments)
    return value if isinstance(value, dict) else None


def _loads(text: str) -> Any:
    """Strict JSON (no NaN/Infinity); `_INVALID` when the text is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return _INVALID


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _check_json(value: Any, where: str) -> None:
    """A one-line error when `value` (arguments, a tool) cannot be written as JSON."""
    try:
        _canonical(value)
    except (TypeError, ValueError):
        raise TranscriptError(f"{where} is not valid JSON") from None


def _role(msg: Any, i: int) -> str:
    if not isinstance(msg, dict):
        raise TranscriptError(f"message {i}: expected an object, got {type(msg).__name__}")
    if "role" not in msg:
        raise TranscriptError(f"message {i}: missing 'role'")
    if msg["role"] not in ROLES:
        raise TranscriptError(f"message {i}: unknown role {msg['role']!r} (expected one of {', '.join(ROLES)})")
    return msg["role"]


def _content(msg: dict, i: int, unreadable: _Unreadable) -> str:
    if "content" not in msg:
        raise TranscriptError(f"message {i}: missing 'content'")
    return _content_text(msg["content"], f"message {i}: content", unreadable)


def _content_text(content: Any, where: str, unreadable: _Unreadable) -> str:
    if isinstance(content, list):
        texts = [_part_text(part, f"{where}[{j}]", unreadable) for j, part in enumerate(content)]
        return "\n".join(text for text in texts if text is not None)
    if not isinstance(content, str):
        raise TranscriptError(f"{where} must be a string or a list of content parts")
    return content


def _part_text(part: Any, where: str, unreadable: _Unreadable) -> str | None:
    """A part's text; None for a part the model cannot read when `unreadable` collects those."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS or kind == "refusal":
        return _string_field(part, "text" if kind in TEXT_PARTS else "refusal", where)
    if kind == "document":
        text = _document_text(part, where, unreadable)
        if text is not None:
            return text
        what = f"a document ('document' with a {part['source'].get('type')!r} source)"
    elif kind in UNREADABLE_PARTS:
        what = f"{UNREADABLE_PARTS[kind]} ({kind!r})"
    elif isinstance(part, dict):
        raise TranscriptError(f"{where}.type: unknown content part type {kind!r}")
    else:
        raise TranscriptError(f"{where} must be a content part object")
    error = UnsupportedContentError(f"{where}: {what} cannot be read by a text-only model")
    if unreadable is None:
        raise error
    unreadable.append(error)
    return None


def _document_text(part: dict, where: str, unreadable: _Unreadable) -> str | None:
    """An Anthropic document's title, context and text, one per line; None for a source that is not
    text (base64 PDF, URL, file)."""
    source = part.get("source")
    if not isinstance(source, dict):
        raise TranscriptError(f"{where}.source must be an object")
    if source.get("type") == "text":
        body = _string_field(source, "data", f"{where}.source")
    elif source.get("type") == "content":
        body = _content_text(source.get("content"), f"{where}.source.content", unreadable)
    else:
        return None
    heading = [_string_field(part, key, where) for key in ("title", "context") if part.get(key) is not None]
    return "\n".join([*heading, body])


def _string_field(obj: dict, key: str, where: str) -> str:
    if not isinstance(obj.get(key), str):
        raise TranscriptError(f"{where}.{key} must be a string")
    return obj[key]


def _check_assistant(msg: dict, i: int, unreadable: list[UnsupportedContentError]) -> None:
    calls = msg.get("tool_calls")
    refusal = msg.get("refusal")
    if refusal is not None and not isinstance(refusal, str):
        raise TranscriptError(f"message {i}: refusal must be a string")
    if msg.get("content") is None and refusal is None and not calls:
        raise TranscriptError(f"message {i}: assistant message needs 'content', 'refusal' or 'tool_calls'")
    if msg.get("content") is not None:
        _content(msg, i, unreadable)
    reasoning = msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise TranscriptError(f"message {i}: reasoning_content must be a string")
    if calls is not None and not isinstance(calls, list):
        raise TranscriptError(f"message {i}: tool_calls must be a list")
    for j, call in enumerate(calls or []):
        _check_call(call, f"message {i}: tool_calls[{j}]")


def _check_call(call: Any, where: str) -> None:
    """A function call (name, arguments a string or a JSON object) or a custom call (name, free-text
    input)."""
    if not isinstance(call, dict):
        raise TranscriptError(f"{where} must be an object")
    if not isinstance(call.get("server", False), bool):
        raise TranscriptError(f"{where}.server must be true or false")
    if call.get("type") == "custom":
        custom = call.get("custom")
        if not isinstance(custom, dict):
            raise TranscriptError(f"{where}.custom must be an object")
        _check_name(custom.get("name"), f"{where}.custom.name")
        _string_field(custom, "input", f"{where}.custom")
        return
    if call.get("type", "function") != "function":
        raise TranscriptError(f"{where}.type must be 'function' or 'custom'")
    function = call.get("function")
    if not isinstance(function, dict):
        raise TranscriptError(f"{where}.function must be an object")
    _check_name(function.get("name"), f"{where}.function.name")
    if "arguments" not in function:
        raise TranscriptError(f"{where}.function missing 'arguments'")
    arguments = function["arguments"]
    if not isinstance(arguments, (str, dict)):
        raise TranscriptError(f"{where}.function.arguments must be a string or a JSON object")
    _check_json(arguments, f"{where}.function.arguments")


def _check_name(name: Any, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise TranscriptError(f"{where} must be a non-empty string")


def _check_tool_output(msg: dict, i: int, takes_outputs: bool) -> None:
    if not takes_outputs:
        raise TranscriptError(f"message {i}: tool message must follow an assistant message with tool_calls")
    if "tool_call_id" in msg and not isinstance(msg["tool_call_id"], str):
        raise TranscriptError(f"message {i}: tool_call_id must be a string")
    if not isinstance(msg.get("is_error", False), bool):
        raise TranscriptError(f"message {i}: is_error must be true or false")


def _check_tools(tools: Any) -> None:
    """Tools: a list of function tools (a `function` object with a name) and other tools (a non-empty
    `type`), each writable as JSON."""
    if not isinstance(tools, list):
        raise TranscriptError("tools must be a list")
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise TranscriptError(f"{where} must be an object")
        kind = tool.get("type", "function")
        if kind == "function":
            described, where = tool.get("function"), f"{where}.function"
            if not isinstance(described, dict):
                raise TranscriptError(f"{where} must be an object")
            _check_name(described.get("name"), f"{where}.name")
        elif isinstance(kind, str) and kind:
            described = tool
        else:
            raise TranscriptError(f"{where}.type must be a non-empty string")
        _check_json(described, where)
