"""Canonical messages and tools -> a trace line in the "chat", "anthropic" or "responses" format: the
inverse of harness.trace_import, so one conversation can be written in each shape a client writes.

A chat line holds anything canonical (the canonical form is its shape). The other formats hold, and
`harness.traces` reads back to identical messages and tools, this space:
- a leading system message with text content (Responses: `instructions`); a developer message
  (Responses only: Anthropic has no developer role) and user messages with text content;
- assistant messages with text content or None, `reasoning_content` (a thinking block, a reasoning
  item's summary), `refusal` (Responses only: Anthropic has no refusal field) and function tool calls
  (Responses also custom ones). Arguments that are a JSON object come back as canonical JSON
  (`transcript.canonical_arguments`), so the space holds them in that form; other arguments come back
  verbatim (Anthropic writes them as `{"INVALID_JSON": text}`, the wrapper its docs suggest for invalid
  input);
- tool messages with text content and a `tool_call_id`, and `is_error` (Anthropic only: Responses
  outputs have no error flag);
- no two assistant messages in a row in Responses (its consecutive assistant items form one message),
  and tool messages only right after the calls they answer;
- function tools with `name`, `parameters` (Anthropic's `input_schema`), and optionally `description`
  and `strict` (Anthropic also other keys beside `function`, e.g. cache_control); other tools as given.
Anything outside it (content parts, `unrendered`, server calls, a field a format has no place for)
raises a one-line TraceFormatError naming the field: nothing is dropped silently.
"""

from __future__ import annotations

from typing import Any

from deepinfer.harness.trace_import import INVALID_JSON, TraceFormatError
from deepinfer.harness.transcript import arguments_object, canonical_arguments

EXPORT_FORMATS = ("chat", "anthropic", "responses")


def export_line(messages: list[dict], tools: list[dict] | None, fmt: str, tool_choice: str | dict | None = None
                ) -> dict:
    """The trace line (without id, sampling or metadata) that imports to `messages`, `tools` and
    `tool_choice` (Chat Completions shape, as `trace_import.chat_tool_choice` keeps it)."""
    if fmt not in EXPORT_FORMATS:
        raise TraceFormatError(f"format: unknown {fmt!r} (expected one of {', '.join(EXPORT_FORMATS)})")
    if fmt == "chat":
        line: dict[str, Any] = {"messages": messages}
    else:
        line = {"format": fmt, **(to_anthropic(messages) if fmt == "anthropic" else to_responses(messages))}
    if tools is not None:
        line["tools"] = [_TOOL_EXPORTERS[fmt](tool, f"tools[{k}]") for k, tool in enumerate(tools)]
    if tool_choice is not None:
        line["tool_choice"] = _tool_choice(tool_choice, fmt)
    return line


def _tool_choice(choice: str | dict, fmt: str) -> str | dict:
    """A Chat Completions `tool_choice` in `fmt`'s own spelling."""
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    if fmt == "anthropic":
        return {"type": "tool", "name": named} if named else {"type": {"required": "any"}.get(choice, choice)}
    if fmt == "responses" and named:
        return {"type": "function", "name": named}
    return choice


def _leading_system(messages: list[dict], key: str, fmt: str) -> tuple[dict[str, Any], int]:
    """The line so far (a leading system message's text under `key`) and the index of the next message."""
    if not messages or messages[0]["role"] != "system":
        return {}, 0
    _only(messages[0], {"role", "content"}, "messages[0]", fmt)
    return {key: _text(messages[0], "messages[0]")}, 1


# Anthropic -------------------------------------------------------------------------------------------


def to_anthropic(messages: list[dict]) -> dict:
    """`system` and `messages`: tool results and the user text after them share one user message."""
    line, start = _leading_system(messages, "system", "anthropic")
    out: list[dict] = []
    for i in range(start, len(messages)):
        message, where = messages[i], f"messages[{i}]"
        role = message["role"]
        if role == "assistant":
            out.append(_anthropic_assistant(message, where))
        elif role == "tool":
            _anthropic_result(message, where, out)
        elif role == "user":
            _only(message, {"role", "content"}, where, "anthropic")
            _anthropic_user_text(_text(message, where), out)
        else:
            raise _no_place(f"{where}.role", "anthropic")
    line["messages"] = out
    return line


def _anthropic_assistant(message: dict, where: str) -> dict:
    _only(message, {"role", "content", "reasoning_content", "tool_calls"}, where, "anthropic")
    blocks: list[dict] = []
    if message.get("reasoning_content") is not None:
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"]})
    if message.get("content") is not None:
        blocks.append({"type": "text", "text": _text(message, where)})
    for j, call in enumerate(message.get("tool_calls") or []):
        name, arguments = _function_call(call, f"{where}.tool_calls[{j}]", "anthropic")
        blocks.append({"type": "tool_use", "id": call["id"], "name": name, "input": _anthropic_input(arguments)})
    return {"role": "assistant", "content": blocks}


def _anthropic_input(arguments: str | dict) -> dict:
    value = arguments_object(arguments)
    return value if value is not None else {INVALID_JSON: arguments}


def _anthropic_result(message: dict, where: str, out: list[dict]) -> None:
    _only(message, {"role", "content", "tool_call_id", "is_error"}, where, "anthropic")
    block = {"type": "tool_result", "tool_use_id": _call_id(message, where), "content": _text(message, where)}
    if "is_error" in message:
        block["is_error"] = message["is_error"]
    if _open_results(out):
        out[-1]["content"].append(block)
    else:
        out.append({"role": "user", "content": [block]})


def _anthropic_user_text(text: str, out: list[dict]) -> None:
    if _open_results(out):
        out[-1]["content"].append({"type": "text", "text": text})
    else:
        out.append({"role": "user", "content": text})


def _open_results(out: list[dict]) -> bool:
    """Whether the last message is a user message of tool results only (more results or the user's
    text join it)."""
    last = out[-1] if out else {}
    blocks = last.get("content") if last.get("role") == "user" else None
    return isinstance(blocks, list) and blocks[-1]["type"] == "tool_result"


def _anthropic_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        return tool
    function = tool["function"]
    _only(function, {"name", "description", "parameters", "strict"}, f"{where}.function", "anthropic")
    if "parameters" not in function:
        raise TraceFormatError(f"{where}.function.parameters: missing (an Anthropic tool needs input_schema)")
    exported = {"name": function["name"], "input_schema": function["parameters"]}
    exported.update({key: function[key] for key in ("description", "strict") if key in function})
    return {**exported, **{k: v for k, v in tool.items() if k not in ("type", "function")}}


# OpenAI Responses ------------------------------------------------------------------------------------


def to_responses(messages: list[dict]) -> dict:
    """`instructions` and `input` items."""
    line, start = _leading_system(messages, "instructions", "responses")
    items: list[dict] = []
    custom_calls: set[str] = set()
    for i in range(start, len(messages)):
        message, where = messages[i], f"messages[{i}]"
        role = message["role"]
        if role == "assistant":
            if i > 0 and messages[i - 1]["role"] == "assistant":
                raise TraceFormatError(f"{where}: a second assistant message in a row (Responses would merge them)")
            items += _responses_assistant(message, where, custom_calls)
        elif role == "tool":
            _only(message, {"role", "content", "tool_call_id"}, where, "responses")
            call_id = _call_id(message, where)
            kind = "custom_tool_call_output" if call_id in custom_calls else "function_call_output"
            items.append({"type": kind, "call_id": call_id, "output": _text(message, where)})
        else:
            _only(message, {"role", "content"}, where, "responses")
            items.append({"role": role, "content": _text(message, where)})
    line["input"] = items
    return line


def _responses_assistant(message: dict, where: str, custom_calls: set[str]) -> list[dict]:
    _only(message, {"role", "content", "reasoning_content", "refusal", "tool_calls"}, where, "responses")
    items: list[dict] = []
    if message.get("reasoning_content") is not None:
        items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": message["reasoning_content"]}]})
    parts = [{"type": "output_text", "text": _text(message, where)}] if message.get("content") is not None else []
    if message.get("refusal") is not None:
        parts.append({"type": "refusal", "refusal": message["refusal"]})
    if parts:
        items.append({"type": "message", "role": "assistant", "content": parts})
    for j, call in enumerate(message.get("tool_calls") or []):
        items.append(_responses_call(call, f"{where}.tool_calls[{j}]", custom_calls))
    return items


def _responses_call(call: dict, where: str, custom_calls: set[str]) -> dict:
    if call.get("type") == "custom":
        _only(call, {"id", "type", "custom"}, where, "responses")
        custom_calls.add(call["id"])
        return {"type": "custom_tool_call", "call_id": call["id"], **call["custom"]}
    name, arguments = _function_call(call, where, "responses")
    return {"type": "function_call", "call_id": call["id"], "name": name,
            "arguments": arguments if isinstance(arguments, str) else canonical_arguments(arguments)}


def _responses_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        return tool
    _only(tool, {"type", "function"}, where, "responses")
    return {"type": "function", **tool["function"]}


# shared ----------------------------------------------------------------------------------------------

_TOOL_EXPORTERS = {"chat": lambda tool, where: tool, "anthropic": _anthropic_tool, "responses": _responses_tool}


def _function_call(call: dict, where: str, fmt: str) -> tuple[str, str | dict]:
    _only(call, {"id", "type", "function"}, where, fmt)
    if call.get("type", "function") != "function":
        raise _no_place(f"{where}.type", fmt)
    _only(call["function"], {"name", "arguments"}, f"{where}.function", fmt)
    return call["function"]["name"], call["function"]["arguments"]


def _call_id(message: dict, where: str) -> str:
    if "tool_call_id" not in message:
        raise TraceFormatError(f"{where}.tool_call_id: missing (a result names the call it answers)")
    return message["tool_call_id"]


def _text(message: dict, where: str) -> str:
    if not isinstance(message.get("content"), str):
        raise TraceFormatError(f"{where}.content: only text content is exported")
    return message["content"]


def _only(obj: dict, allowed: set[str], where: str, fmt: str) -> None:
    """Every field of `obj` has a place in `fmt`; the first that has none is named."""
    extra = sorted(set(obj) - allowed)
    if extra:
        raise _no_place(f"{where}.{extra[0]}", fmt)


def _no_place(where: str, fmt: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: no place for it in the {fmt} format")
