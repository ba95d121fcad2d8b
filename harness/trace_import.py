"""Agent conversations in other shapes -> the Chat Completions messages and tools of a trace line.

- Anthropic Messages: a `system` string or text blocks; `messages` whose content is a string or blocks:
  text, `thinking` (-> reasoning_content) and `tool_use` (-> tool_calls) on assistant turns, text and
  `tool_result` (-> tool messages, placed ahead of the user's text) on user turns; `tools` with
  `input_schema`.
- OpenAI Responses: `instructions`, then `input` (a string or items) and optional `output` items:
  messages (developer counts as system), `reasoning`, `function_call` and `function_call_output`;
  `tools` of type function.

Arguments become canonical JSON text; text parts are joined by newlines, as the chat template joins
them. Every error names the field (e.g. `messages[2].content[1].type`) and is a TraceFormatError,
which `harness.traces` prefixes with the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from deepinfer.errors import DeepInferError


class TraceFormatError(DeepInferError, ValueError):
    """A trace line (or one field of it) that does not fit the format."""


def canonical_arguments(arguments: str | dict) -> str:
    """Tool-call arguments (a JSON object, or its text) as compact JSON with sorted keys: how calls are
    matched and how the chat template writes them."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def from_anthropic(obj: dict) -> tuple[list[dict], list[dict] | None]:
    """Anthropic Messages: a `system` string or text blocks; user turns of text and `tool_result`
    blocks (results become tool messages, ahead of the user's text); assistant turns of text,
    `thinking` and `tool_use` blocks."""
    messages: list[dict] = []
    if "system" in obj:
        messages.append({"role": "system", "content": _blocks_text(obj["system"], "system")})
    source = obj.get("messages")
    if not isinstance(source, list) or not source:
        raise TraceFormatError("messages: must be a non-empty list of message objects")
    for i, message in enumerate(source):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise TraceFormatError(f"{where}.role: must be 'user' or 'assistant'")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise TraceFormatError(f"{where}.content: must be a string or a list of content blocks")
        if message["role"] == "user":
            messages.extend(_anthropic_user(blocks, where))
        else:
            messages.append(_anthropic_assistant(blocks, where))
    return messages, _tools(obj, _anthropic_tool)


def _anthropic_user(blocks: list, where: str) -> list[dict]:
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{where}.content[{j}]", ("text", "tool_result"))
        if kind == "text":
            texts.append(_string(block, "text", f"{where}.content[{j}]"))
        else:
            call_id = _string(block, "tool_use_id", f"{where}.content[{j}]")
            content = _blocks_text(block.get("content", ""), f"{where}.content[{j}].content")
            results.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _anthropic_assistant(blocks: list, where: str) -> dict:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at, ("text", "thinking", "tool_use"))
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at))
        else:
            if not isinstance(block.get("input"), dict):
                raise TraceFormatError(f"{at}.input: must be an object")
            calls.append(_call(_string(block, "id", at), _string(block, "name", at), block["input"]))
    return _assistant_message(texts, thoughts, calls)


def _anthropic_tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict):
        raise TraceFormatError(f"{where}: must be an object")
    if "input_schema" not in tool:
        raise TraceFormatError(f"{where}.input_schema: missing (only client tools with a schema are supported)")
    function = {"name": _string(tool, "name", where), "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = _string(tool, "description", where)
    return {"type": "function", "function": function}


def from_responses(obj: dict) -> tuple[list[dict], list[dict] | None]:
    """OpenAI Responses: `instructions`, then `input` and `output` items. Consecutive assistant
    message, reasoning and function_call items form one assistant turn; function_call_output items
    become tool messages; developer messages count as system messages."""
    messages: list[dict] = []
    if "instructions" in obj:
        messages.append({"role": "system", "content": _plain_string(obj["instructions"], "instructions")})
    turn: dict[str, list] | None = None  # the assistant turn being assembled: texts, thoughts, calls
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
            if kind in ("function_call", "reasoning") or (kind == "message" and item.get("role") == "assistant"):
                turn = turn or {"texts": [], "thoughts": [], "calls": []}
                _responses_assistant_item(item, kind, where, turn)
                continue
            if turn is not None:
                messages.append(_assistant_message(turn["texts"], turn["thoughts"], turn["calls"]))
                turn = None
            if kind == "function_call_output":
                output = _string(item, "output", where)
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
            elif kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer"):
                    raise TraceFormatError(f"{where}.role: must be 'user', 'system', 'developer' or 'assistant'")
                content = _parts_text(item.get("content"), f"{where}.content", ("input_text", "text"))
                messages.append({"role": "user" if role == "user" else "system", "content": content})
            else:
                raise TraceFormatError(f"{where}.type: unsupported item type {kind!r}")
    if turn is not None:
        messages.append(_assistant_message(turn["texts"], turn["thoughts"], turn["calls"]))
    if not messages:
        raise TraceFormatError("input: no items")
    return messages, _tools(obj, _responses_tool)


def _responses_assistant_item(item: dict, kind: str, where: str, turn: dict[str, list]) -> None:
    if kind == "function_call":
        arguments = _string(item, "arguments", where)
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            raise TraceFormatError(f"{where}.arguments: not valid JSON") from None
        if not isinstance(value, dict):
            raise TraceFormatError(f"{where}.arguments: must be a JSON object")
        turn["calls"].append(_call(_string(item, "call_id", where), _string(item, "name", where), value))
    elif kind == "reasoning":
        summary = item.get("summary", [])
        turn["thoughts"].append(_parts_text(summary, f"{where}.summary", ("summary_text",)))
    else:
        turn["texts"].append(_parts_text(item.get("content"), f"{where}.content", ("output_text", "text")))


def _responses_tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict):
        raise TraceFormatError(f"{where}: must be an object")
    if tool.get("type") != "function":
        raise TraceFormatError(f"{where}.type: unsupported tool type {tool.get('type')!r} (only 'function')")
    function = {key: value for key, value in tool.items() if key not in ("type", "strict")}
    _string(tool, "name", where)
    return {"type": "function", "function": function}


def _tools(obj: dict, convert: Callable[[Any, str], dict]) -> list[dict] | None:
    if "tools" not in obj:
        return None
    if not isinstance(obj["tools"], list):
        raise TraceFormatError("tools: must be a list")
    return [convert(tool, f"tools[{k}]") for k, tool in enumerate(obj["tools"])]


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": canonical_arguments(arguments)}}


def _assistant_message(texts: list[str], thoughts: list[str], calls: list[dict]) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise TraceFormatError(f"{where}: must be an object")
    kind = block.get("type")
    if kind not in allowed:
        raise TraceFormatError(f"{where}.type: unsupported block type {kind!r} (expected {' or '.join(allowed)})")
    return kind


def _blocks_text(value: Any, where: str) -> str:
    """An Anthropic string-or-text-blocks value as text."""
    return value if isinstance(value, str) else _parts_text(value, where, ("text",))


def _parts_text(value: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of text parts of the given types, joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        _block_type(part, f"{where}[{j}]", kinds)
        texts.append(_string(part, "text", f"{where}[{j}]"))
    return "\n".join(texts)


def _string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise TraceFormatError(f"{where}.{key}: missing")
    return _plain_string(obj[key], f"{where}.{key}")


def _plain_string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TraceFormatError(f"{where}: must be a string")
    return value
