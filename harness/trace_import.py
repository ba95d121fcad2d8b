"""Agent conversations in other shapes -> the canonical messages and tools of a trace line.

The canonical form is the Chat Completions shape of a transcript (`harness.transcript`, which checks
it), with what that shape needs so that nothing a client wrote is lost:
- roles `developer` (kept; OpenAI's newer name for system) besides system / user / assistant / tool;
- an assistant `refusal`; a tool message's `is_error` (and `name`, from legacy function messages);
- custom tool calls `{"id", "type": "custom", "custom": {"name", "input"}}` (free-text input, kept
  verbatim) and calls marked `"server": true` (run by the provider, e.g. web search);
- tools that are not functions (custom tools, providers' server tools), kept as given;
- content parts that are not text (images, audio, files, documents), kept as given: a text document
  reads as its text; the others are well-formed, though a text-only model cannot read them;
- `unrendered` on any message: a list of source objects with no Chat Completions equivalent, kept
  verbatim and whole, in source order. A block, part or item goes there when it carries a field the
  canonical message has no place for (a thinking block's signature, citations or cache_control on a
  text block, a Responses item's id, status or encrypted content), and so do redacted thinking blocks
  and server tool result blocks (whose text the tool message holds).

Anthropic Messages: a `system` string or text blocks; `messages` whose content is a string or blocks.
User turns: text, image and document blocks (one user message; a string when all are text) and
`tool_result` blocks (tool messages, placed ahead of it; `is_error` kept). Assistant turns: text
(blocks concatenated as they are, since Claude splits its text around citations), `thinking` (->
reasoning_content), `redacted_thinking`, `tool_use` (-> tool_calls), and server tools:
`server_tool_use` / `mcp_tool_use` become a call marked server, and the result block that follows
(`web_search_tool_result`, any `*_tool_result`) ends that assistant message and becomes a tool
message (the results as text: title and URL per search result, or the error code); blocks after it
form the next assistant message. Tools: with `input_schema` -> function tools; without, server tools
kept as given. A `tool_use` input `{"INVALID_JSON": text}` (how Anthropic's docs suggest sending
invalid arguments back) stands for the arguments `text`.

OpenAI Responses: `instructions`, then `input` (a string or items) and optional `output` items.
Consecutive assistant items (assistant messages, `reasoning`, `function_call`, `custom_tool_call`,
`web_search_call`) form one assistant message; `function_call_output` / `custom_tool_call_output`
(output a string or a list of parts) become tool messages; user, system and developer messages keep
their role. Refusal parts -> `refusal`. Tools: function tools (flat or Chat-style nested) -> Chat
function tools; custom and built-in tools kept as given. (`previous_response_id` is resolved by
harness.traces, which sees the whole file.)

Arguments are canonical JSON when they are a JSON object and otherwise kept verbatim (see
`canonical_arguments`); other text parts are joined by newlines, as `transcript.content_text` joins
them. Every error names the field (e.g. `messages[2].content[1].type`) and is a TraceFormatError, which
harness.traces locates at the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import DeepInferError
from deepinfer.harness.transcript import TEXT_PARTS, canonical_arguments

__all__ = ["TraceFormatError", "from_anthropic", "from_responses"]

INVALID_JSON = "INVALID_JSON"
_ANTHROPIC_KEPT = ("image", "document")
_RESPONSES_KEPT = ("input_image", "input_file", "input_audio")
_ANTHROPIC_SERVER_CALLS = ("server_tool_use", "mcp_tool_use")


class TraceFormatError(DeepInferError, ValueError):
    """A trace line (or one field of it) that does not fit the format."""

    kind = "malformed"


@dataclass
class _Turn:
    """An assistant message being assembled from blocks or items; `separator` joins its texts."""

    separator: str = "\n"
    texts: list[str] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    unrendered: list[dict] = field(default_factory=list)

    def message(self) -> dict:
        has_text = bool(self.texts) or not (self.calls or self.refusals)
        content = self.separator.join(self.texts) if has_text else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.thoughts:
            message["reasoning_content"] = "\n".join(self.thoughts)
        if self.refusals:
            message["refusal"] = "\n".join(self.refusals)
        if self.calls:
            message["tool_calls"] = self.calls
        return _with_unrendered(message, self.unrendered)


# Anthropic Messages ----------------------------------------------------------------------------------


def from_anthropic(obj: dict) -> tuple[list[dict], list[dict] | None]:
    """Anthropic Messages -> canonical messages and tools (see the module docstring)."""
    messages: list[dict] = []
    if "system" in obj:
        content, unrendered = _content(obj["system"], "system", ("text",), ())
        messages.append(_with_unrendered({"role": "system", "content": content}, unrendered))
    source = obj.get("messages")
    if not isinstance(source, list) or not source:
        raise TraceFormatError("messages: must be a non-empty list of message objects")
    for i, message in enumerate(source):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise TraceFormatError(f"{where}.role: must be 'user' or 'assistant'")
        unknown = set(message) - {"role", "content"}
        if unknown:
            raise TraceFormatError(f"{where}: unknown field(s) {sorted(unknown)}")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise TraceFormatError(f"{where}.content: must be a string or a list of content blocks")
        located = [(f"{where}.content[{j}]", block) for j, block in enumerate(blocks)]
        messages.extend(_anthropic_user(located) if message["role"] == "user" else _anthropic_assistant(located))
    return messages, _tools(obj, _anthropic_tool)


def _anthropic_user(blocks: list[tuple[str, Any]]) -> list[dict]:
    """Tool messages for the tool_result blocks, then one user message for the other blocks."""
    results, rest = [], []
    for where, block in blocks:
        if _block_type(block, where, ("text", *_ANTHROPIC_KEPT, "tool_result")) == "tool_result":
            results.append(_tool_result(block, where))
        else:
            rest.append((where, block))
    if not rest:
        return results
    content, unrendered = _parts(rest, ("text",), _ANTHROPIC_KEPT)
    return [*results, _with_unrendered({"role": "user", "content": content}, unrendered)]


def _tool_result(block: dict, where: str) -> dict:
    content, unrendered = _content(block.get("content", ""), f"{where}.content", ("text",), _ANTHROPIC_KEPT)
    message = {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where), "content": content}
    if "is_error" in block:
        message["is_error"] = _bool(block, "is_error", where)
    whole = _has_extra(block, {"type", "tool_use_id", "content", "is_error"})
    return _with_unrendered(message, [block] if whole else unrendered)


def _anthropic_assistant(blocks: list[tuple[str, Any]]) -> list[dict]:
    """One assistant message, or several when server tool results split it (each result becomes a
    tool message between them). Text blocks are concatenated as they are: Claude splits one text into
    blocks around its citations."""
    messages: list[dict] = []
    turn: _Turn | None = _Turn("")
    for where, block in blocks:
        kind = _block_type(block, where, None)
        if kind.endswith("_tool_result"):
            if turn is not None:
                messages.append(turn.message())
            messages.append(_server_result(block, where))
            turn = None
            continue
        turn = turn or _Turn("")
        if kind not in _ANTHROPIC_ASSISTANT_BLOCKS:
            expected = ", ".join(_ANTHROPIC_ASSISTANT_BLOCKS)
            raise TraceFormatError(f"{where}.type: unsupported block type {kind!r} (expected {expected} "
                                   "or a server tool result '*_tool_result')")
        _ANTHROPIC_ASSISTANT_BLOCKS[kind](block, where, turn)
    if turn is not None:
        messages.append(turn.message())
    return messages


def _anthropic_text(block: dict, where: str, turn: _Turn) -> None:
    turn.texts.append(_string(block, "text", where))
    _keep_if_extra(block, {"type", "text"}, turn.unrendered)


def _anthropic_thinking(block: dict, where: str, turn: _Turn) -> None:
    turn.thoughts.append(_string(block, "thinking", where))
    _keep_if_extra(block, {"type", "thinking"}, turn.unrendered)


def _anthropic_redacted(block: dict, where: str, turn: _Turn) -> None:
    turn.unrendered.append(block)


def _anthropic_tool_use(block: dict, where: str, turn: _Turn) -> None:
    if not isinstance(block.get("input"), dict):
        raise TraceFormatError(f"{where}.input: must be an object")
    arguments = block["input"]
    if set(arguments) == {INVALID_JSON} and isinstance(arguments[INVALID_JSON], str):
        arguments = arguments[INVALID_JSON]
    call = _function_call(_string(block, "id", where), _string(block, "name", where), arguments, f"{where}.input")
    if block["type"] in _ANTHROPIC_SERVER_CALLS:
        call["server"] = True
    turn.calls.append(call)
    _keep_if_extra(block, {"type", "id", "name", "input"}, turn.unrendered)


_ANTHROPIC_ASSISTANT_BLOCKS: dict[str, Callable[[dict, str, _Turn], None]] = {
    "text": _anthropic_text, "thinking": _anthropic_thinking, "redacted_thinking": _anthropic_redacted,
    "tool_use": _anthropic_tool_use, "server_tool_use": _anthropic_tool_use, "mcp_tool_use": _anthropic_tool_use,
}


def _server_result(block: dict, where: str) -> dict:
    """A server tool's result block as a tool message: the results as text, the block kept whole."""
    message = {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
               "content": _server_result_text(block.get("content"))}
    if "is_error" in block:
        message["is_error"] = _bool(block, "is_error", where)
    return _with_unrendered(message, [block])


def _server_result_text(content: Any) -> str:
    """Search results as title and URL (a blank line between results), an error as its code, text as
    itself; anything else as its JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict) and "error_code" in content:
        return f"error: {content['error_code']}"
    if isinstance(content, list):
        return "\n\n".join(_server_result_entry(entry) for entry in content)
    return _json(content)


def _server_result_entry(entry: Any) -> str:
    if isinstance(entry, dict) and "url" in entry:
        return "\n".join(str(entry[key]) for key in ("title", "url") if entry.get(key) is not None)
    if isinstance(entry, dict) and entry.get("type") == "text":
        return str(entry.get("text"))
    return _json(entry)


def _anthropic_tool(tool: Any, where: str) -> dict:
    """A client tool (with `input_schema`) as a function tool, its fields without a function
    counterpart (e.g. cache_control) beside `function`, where they are not rendered; a server tool
    as given."""
    if not isinstance(tool, dict):
        raise TraceFormatError(f"{where}: must be an object")
    if "input_schema" not in tool:
        if not isinstance(tool.get("type"), str):
            raise TraceFormatError(f"{where}: needs input_schema (a client tool) or type (a server tool)")
        return tool
    if tool.get("type", "custom") != "custom":
        raise TraceFormatError(f"{where}.type: a tool with input_schema has type 'custom', got {tool['type']!r}")
    function = {"name": _string(tool, "name", where), "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = _string(tool, "description", where)
    if "strict" in tool:
        function["strict"] = _bool(tool, "strict", where)
    rest = {k: v for k, v in tool.items() if k not in ("type", "name", "description", "input_schema", "strict")}
    return {"type": "function", "function": function, **rest}


# OpenAI Responses ------------------------------------------------------------------------------------


def from_responses(obj: dict) -> tuple[list[dict], list[dict] | None]:
    """OpenAI Responses -> canonical messages and tools (see the module docstring)."""
    messages: list[dict] = []
    if "instructions" in obj:
        messages.append({"role": "system", "content": _plain_string(obj["instructions"], "instructions")})
    turn: _Turn | None = None
    for key in ("input", "output"):
        items = obj.get(key, [])
        if isinstance(items, str) and key == "input":
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list):
            raise TraceFormatError(f"{key}: must be a list of items")
        for i, item in enumerate(items):
            where = f"{key}[{i}]"
            if not isinstance(item, dict):
                raise TraceFormatError(f"{where}: must be an object")
            kind = item.get("type", "message")
            assistant = kind == "message" and item.get("role") == "assistant"
            handler = _responses_message if assistant else _RESPONSES_ASSISTANT_ITEMS.get(kind)
            if handler is not None:
                turn = turn or _Turn()
                handler(item, where, turn)
                continue
            if turn is not None:
                messages.append(turn.message())
                turn = None
            messages.append(_responses_item(item, kind, where))
    if turn is not None:
        messages.append(turn.message())
    if not messages:
        raise TraceFormatError("input: no items")
    return messages, _tools(obj, _responses_tool)


def _responses_item(item: dict, kind: str, where: str) -> dict:
    """A user, system or developer message, or a tool output, as a canonical message."""
    if kind in ("function_call_output", "custom_tool_call_output"):
        content, unrendered = _content(item.get("output"), f"{where}.output", TEXT_PARTS, _RESPONSES_KEPT)
        message = {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": content}
        mapped = {"type", "call_id", "output"}
    elif kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer"):
            raise TraceFormatError(f"{where}.role: must be 'user', 'system', 'developer' or 'assistant'")
        content, unrendered = _content(item.get("content"), f"{where}.content", TEXT_PARTS, _RESPONSES_KEPT)
        message = {"role": role, "content": content}
        mapped = {"type", "role", "content"}
    else:
        raise TraceFormatError(f"{where}.type: unsupported item type {kind!r}")
    return _with_unrendered(message, [item] if _has_extra(item, mapped) else unrendered)


def _responses_message(item: dict, where: str, turn: _Turn) -> None:
    """An assistant message item: output text and refusal parts."""
    content = item.get("content")
    kept: list[dict] = []
    if isinstance(content, str):
        turn.texts.append(content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            _responses_output_part(part, f"{where}.content[{j}]", turn, kept)
    else:
        raise TraceFormatError(f"{where}.content: must be a string or a list of parts")
    turn.unrendered.extend([item] if _has_extra(item, {"type", "role", "content"}) else kept)


def _responses_output_part(part: Any, where: str, turn: _Turn, kept: list[dict]) -> None:
    if _block_type(part, where, (*TEXT_PARTS, "refusal")) == "refusal":
        turn.refusals.append(_string(part, "refusal", where))
        _keep_if_extra(part, {"type", "refusal"}, kept)
    else:
        turn.texts.append(_string(part, "text", where))
        _keep_if_extra(part, {"type", "text"}, kept)


def _responses_reasoning(item: dict, where: str, turn: _Turn) -> None:
    summary, kept = _content(item.get("summary", []), f"{where}.summary", ("summary_text",), ())
    turn.thoughts.append(summary)
    turn.unrendered.extend([item] if _has_extra(item, {"type", "summary"}) else kept)


def _responses_function_call(item: dict, where: str, turn: _Turn) -> None:
    turn.calls.append(_function_call(_string(item, "call_id", where), _string(item, "name", where),
                                     _string(item, "arguments", where), f"{where}.arguments"))
    _keep_if_extra(item, {"type", "call_id", "name", "arguments"}, turn.unrendered)


def _responses_custom_call(item: dict, where: str, turn: _Turn) -> None:
    custom = {"name": _string(item, "name", where), "input": _string(item, "input", where)}
    turn.calls.append({"id": _string(item, "call_id", where), "type": "custom", "custom": custom})
    _keep_if_extra(item, {"type", "call_id", "name", "input"}, turn.unrendered)


def _responses_web_search(item: dict, where: str, turn: _Turn) -> None:
    """A web search the provider ran: a server call whose arguments are its action."""
    action = item.get("action", {})
    if not isinstance(action, dict):
        raise TraceFormatError(f"{where}.action: must be an object")
    call = _function_call(_string(item, "id", where), "web_search", action, f"{where}.action")
    turn.calls.append({**call, "server": True})
    _keep_if_extra(item, {"type", "id", "action"}, turn.unrendered)


_RESPONSES_ASSISTANT_ITEMS: dict[str, Callable[[dict, str, _Turn], None]] = {
    "reasoning": _responses_reasoning,
    "function_call": _responses_function_call, "custom_tool_call": _responses_custom_call,
    "web_search_call": _responses_web_search,
}


def _responses_tool(tool: Any, where: str) -> dict:
    """A function tool (flat, or Chat-style nested) as a Chat function tool; custom and built-in
    tools as given."""
    if not isinstance(tool, dict):
        raise TraceFormatError(f"{where}: must be an object")
    kind = tool.get("type")
    if not isinstance(kind, str) or not kind:
        raise TraceFormatError(f"{where}.type: must be a non-empty string")
    if kind != "function" or "function" in tool:
        return tool
    _string(tool, "name", where)
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


# shared ----------------------------------------------------------------------------------------------


def _tools(obj: dict, convert: Callable[[Any, str], dict]) -> list[dict] | None:
    if "tools" not in obj:
        return None
    if not isinstance(obj["tools"], list):
        raise TraceFormatError("tools: must be a list")
    return [convert(tool, f"tools[{k}]") for k, tool in enumerate(obj["tools"])]


def _function_call(call_id: str, name: str, arguments: str | dict, where: str) -> dict:
    try:
        text = canonical_arguments(arguments)
    except ValueError:  # a dict holding NaN or Infinity
        raise TraceFormatError(f"{where}: not valid JSON") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _content(value: Any, where: str, text_kinds: tuple[str, ...], kept_kinds: tuple[str, ...]) -> tuple[Any, list]:
    """A string, or a list of parts (see `_parts`)."""
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: must be a string or a list of content blocks")
    return _parts([(f"{where}[{j}]", part) for j, part in enumerate(value)], text_kinds, kept_kinds)


def _parts(parts: list[tuple[str, Any]], text_kinds: tuple[str, ...], kept_kinds: tuple[str, ...]) -> tuple[Any, list]:
    """Content from located parts: their texts joined by newlines when every part is text, else the
    parts (text parts as `{"type", "text"}`, the kept kinds as given); and the text parts that carry
    more than their text, to keep in `unrendered`."""
    content: list[dict] = []
    unrendered: list[dict] = []
    for where, part in parts:
        kind = _block_type(part, where, (*text_kinds, *kept_kinds))
        if kind in kept_kinds:
            content.append(part)
            continue
        content.append({"type": kind, "text": _string(part, "text", where)})
        _keep_if_extra(part, {"type", "text"}, unrendered)
    if all(part["type"] in text_kinds for part in content):
        return "\n".join(part["text"] for part in content), unrendered
    return content, unrendered


def _with_unrendered(message: dict, unrendered: list[dict]) -> dict:
    if unrendered:
        message["unrendered"] = unrendered
    return message


def _has_extra(obj: dict, mapped: set[str]) -> bool:
    return not set(obj) <= mapped


def _keep_if_extra(obj: dict, mapped: set[str], unrendered: list[dict]) -> None:
    """Keep `obj` whole when it has fields beyond those the canonical message holds."""
    if _has_extra(obj, mapped):
        unrendered.append(obj)


def _block_type(block: Any, where: str, allowed: tuple[str, ...] | None) -> str:
    if not isinstance(block, dict):
        raise TraceFormatError(f"{where}: must be an object")
    kind = block.get("type")
    if not isinstance(kind, str) or (allowed is not None and kind not in allowed):
        expected = f" (expected {', '.join(allowed)})" if allowed is not None else ""
        raise TraceFormatError(f"{where}.type: unsupported block type {kind!r}{expected}")
    return kind


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise TraceFormatError(f"{where}.{key}: missing")
    return _plain_string(obj[key], f"{where}.{key}")


def _bool(obj: dict, key: str, where: str) -> bool:
    if not isinstance(obj[key], bool):
        raise TraceFormatError(f"{where}.{key}: must be true or false")
    return obj[key]


def _plain_string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TraceFormatError(f"{where}: must be a string")
    return value


def chat_tool_choice(value: Any, kind: str) -> str | dict | None:
    """A line's `tool_choice` in the Chat Completions shape ("auto", "none", "required" or {"type":
    "function", "function": {"name": ...}}) from its format's own: Anthropic's {"type": "auto" | "any" |
    "none"} and {"type": "tool", "name": ...}, Responses' "auto" | "none" | "required" and {"type":
    "function", "name": ...}. None when absent."""
    if value is None:
        return None
    if kind == "anthropic" and isinstance(value, dict) and value.get("type") in ("auto", "any", "none", "tool"):
        named = value.get("name") if value["type"] == "tool" else None
        value = {"any": "required", "tool": {"type": "function", "function": {"name": named}}}.get(value["type"], value["type"])
    elif kind == "responses" and isinstance(value, dict) and value.get("type") == "function" and "function" not in value:
        value = {"type": "function", "function": {"name": value.get("name")}}
    if value in ("auto", "none", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise TraceFormatError(f"tool_choice: expected auto, none, required or a named function, got {value!r}")
    return {"type": "function", "function": {"name": function["name"]}}
