"""OpenAI Chat Completions messages -> DeepSeek-V3.x/V4-style prompt text, and generated text -> message.

Prompt format (special tokens written out literally, `{...}` is message text):

    <｜begin▁of▁sentence｜>{system}
    user        <｜User｜>{content}
    assistant   <｜Assistant｜>{think}{content}{calls}<｜end▁of▁sentence｜>
    tool(s)     <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>...
                <｜tool▁outputs▁end｜>
    generation  <｜Assistant｜><think>      when thinking
                <｜Assistant｜></think>     otherwise

- {system}: the contents of the leading system messages, then (when tools are given) the tools block,
  joined by a blank line ("\\n\\n"); empty parts are left out. The tools block lists one function per
  line as canonical JSON (compact, sorted keys) and says how to call them.
- {think}: `<think>{reasoning_content}</think>` when thinking is on and the message has a
  `reasoning_content` (not None); otherwise `</think>`. So a completion generated after the
  generation prompt, parsed by `parse_completion` with the same `thinking`, re-encodes to exactly
  the prompt plus the generated text.
- {calls}: `<｜tool▁calls▁begin｜>` + per call `<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}
  <｜tool▁call▁end｜>` (no line break) + `<｜tool▁calls▁end｜>`; absent without tool calls. Arguments
  are canonical JSON: compact, sorted keys, non-ASCII kept.
- Consecutive tool messages share one `<｜tool▁outputs▁begin｜>...<｜tool▁outputs▁end｜>` group.
- Content is a string or a list of `{"type": "text", "text": ...}` parts, joined with "\\n".

Rules (each broken one raises a one-line `ChatFormatError` naming the message index and field):
system messages come first; tool messages follow an assistant message with tool calls (or another
tool message); `tool_calls` only on assistant messages; an assistant message needs content or tool
calls; arguments must be a JSON object; `tool_call_id`, when given, is a string; and no text field
may contain a special token, so that the encoding is unambiguous and can be parsed back.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deepinfer.errors import DeepInferError
from deepinfer.recipe.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    SPECIAL_TOKENS,
    THINK_BEGIN,
    THINK_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_SEP,
    USER,
    TextTokenizer,
)

ROLES = ("system", "user", "assistant", "tool")
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_INVALID = object()

TOOLS_HEADER = "## Tools\n\nYou can call these functions. Each line is one function's JSON schema:\n"
TOOLS_FOOTER = (
    f"\n\nTo call functions, reply with {TOOL_CALLS_BEGIN}, then for each call "
    f"{TOOL_CALL_BEGIN}NAME{TOOL_SEP}ARGUMENTS{TOOL_CALL_END} where ARGUMENTS is a JSON object, "
    f"then {TOOL_CALLS_END}."
)


class ChatFormatError(DeepInferError, ValueError):
    """Messages or tools that do not fit the chat format."""


def encode_messages(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
) -> str:
    """Prompt text for `messages` (see the module docstring for the format and the rules)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    system_parts: list[str] = []
    out: list[str] = []
    prev_role = None
    takes_outputs = False  # the previous message was an assistant tool call or a tool output
    for i, msg in enumerate(messages):
        role = _role(msg, i)
        if msg.get("tool_calls") and role != "assistant":
            raise ChatFormatError(f"message {i}: tool_calls are only allowed on assistant messages")
        if prev_role == "tool" and role != "tool":
            out.append(TOOL_OUTPUTS_END)
        if role == "system":
            if prev_role not in (None, "system"):
                raise ChatFormatError(
                    f"message {i}: system message after the conversation started (system messages must come first)"
                )
            system_parts.append(_content(msg, i))
        elif role == "user":
            out.append(USER + _content(msg, i))
        elif role == "assistant":
            out.append(_assistant(msg, i, thinking))
        else:
            if not takes_outputs:
                raise ChatFormatError(f"message {i}: tool message must follow an assistant message with tool_calls")
            out.append(_tool_output(msg, i, first=prev_role != "tool"))
        takes_outputs = role == "tool" or bool(msg.get("tool_calls"))
        prev_role = role
    if prev_role == "tool":
        out.append(TOOL_OUTPUTS_END)
    if tools is not None:
        system_parts.append(_tools_block(tools))
    if add_generation_prompt:
        out.append(ASSISTANT + (THINK_BEGIN if thinking else THINK_END))
    return BOS + "\n\n".join(p for p in system_parts if p) + "".join(out)


def encode_chat(
    tokenizer: TextTokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `encode_messages(...)`; the text already starts with BOS."""
    return tokenizer.encode(encode_messages(messages, tools, thinking, add_generation_prompt))


def parse_completion(text: str, thinking: bool = False) -> dict:
    """Assistant message from text generated after the generation prompt.

    Text after the first EOS is ignored. Reasoning is the text before the first `</think>` (a
    leading `<think>` is dropped); with no `</think>`, all the text is reasoning when `thinking` (the
    generation prompt opened the block, so it was cut off while thinking) or when the text opens
    with `<think>`, and `reasoning_content` is None otherwise. After the reasoning, content runs up to
    `<｜tool▁calls▁begin｜>`. Calls are parsed in order; from the first one that is truncated or
    malformed (no end marker, no separator, empty name, special tokens inside, arguments not a JSON
    object), the rest of the text is appended verbatim to content, as is anything after
    `<｜tool▁calls▁end｜>`: the calls that did parse are kept and no generated text is lost. When no
    call parses, the content is the whole text after the reasoning, markers included.
    """
    eos = text.find(EOS)
    if eos >= 0:
        text = text[:eos]
    in_think = thinking
    if text.startswith(THINK_BEGIN):
        text, in_think = text[len(THINK_BEGIN) :], True
    reasoning = None
    close = text.find(THINK_END)
    if close >= 0:
        reasoning, text = text[:close], text[close + len(THINK_END) :]
    elif in_think:
        reasoning, text = text, ""
    calls: list[dict] = []
    start = text.find(TOOL_CALLS_BEGIN)
    if start >= 0:
        calls, rest = _parse_calls(text[start + len(TOOL_CALLS_BEGIN) :])
        if calls:
            text = text[:start] + rest
    message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": reasoning}
    if calls:
        message["tool_calls"] = calls
    return message


def parse_completion_ids(tokenizer: TextTokenizer, ids: list[int], thinking: bool = False) -> dict:
    """`parse_completion` of the decoded ids (specials kept, out-of-vocab ids skipped)."""
    return parse_completion(tokenizer.decode(ids), thinking)


def _parse_calls(text: str) -> tuple[list[dict], str]:
    """Tool calls at the start of `text` (just after calls-begin), and the text left unparsed."""
    calls: list[dict] = []
    pos = 0
    while text.startswith(TOOL_CALL_BEGIN, pos):
        end = text.find(TOOL_CALL_END, pos)
        if end < 0:
            break
        name, sep, arguments = text[pos + len(TOOL_CALL_BEGIN) : end].partition(TOOL_SEP)
        if not sep or not name or _SPECIAL_RE.search(name) or _SPECIAL_RE.search(arguments):
            break
        if not isinstance(_loads(arguments), dict):
            break
        function = {"name": name, "arguments": arguments}
        calls.append({"id": f"call_{len(calls)}", "type": "function", "function": function})
        pos = end + len(TOOL_CALL_END)
    if text.startswith(TOOL_CALLS_END, pos):
        pos += len(TOOL_CALLS_END)
    return calls, text[pos:]


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


def _role(msg: Any, i: int) -> str:
    if not isinstance(msg, dict):
        raise ChatFormatError(f"message {i}: expected an object, got {type(msg).__name__}")
    if "role" not in msg:
        raise ChatFormatError(f"message {i}: missing 'role'")
    role = msg["role"]
    if role not in ROLES:
        raise ChatFormatError(f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    return role


def _content(msg: dict, i: int) -> str:
    if "content" not in msg:
        raise ChatFormatError(f"message {i}: missing 'content'")
    content = msg["content"]
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ChatFormatError(f"message {i}: content[{j}] is not a text part (only 'text' parts are supported)")
            if not isinstance(part.get("text"), str):
                raise ChatFormatError(f"message {i}: content[{j}].text must be a string")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise ChatFormatError(f"message {i}: content must be a string or a list of text parts")
    return _plain(content, f"message {i}: content")


def _plain(text: str, where: str) -> str:
    found = _SPECIAL_RE.search(text)
    if found:
        raise ChatFormatError(f"{where} contains special token {found.group()!r}")
    return text


def _assistant(msg: dict, i: int, thinking: bool) -> str:
    calls = msg.get("tool_calls")
    if msg.get("content") is None and not calls:
        raise ChatFormatError(f"message {i}: assistant message needs 'content' or 'tool_calls'")
    content = "" if msg.get("content") is None else _content(msg, i)
    reasoning = msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError(f"message {i}: reasoning_content must be a string")
    if thinking and reasoning is not None:
        think = THINK_BEGIN + _plain(reasoning, f"message {i}: reasoning_content") + THINK_END
    else:
        think = THINK_END
    return ASSISTANT + think + content + _tool_calls(calls, i) + EOS


def _tool_calls(calls: Any, i: int) -> str:
    if calls is None or calls == []:
        return ""
    if not isinstance(calls, list):
        raise ChatFormatError(f"message {i}: tool_calls must be a list")
    out = [TOOL_CALLS_BEGIN]
    for j, call in enumerate(calls):
        where = f"message {i}: tool_calls[{j}]"
        function = _function_entry(call, where)
        name = _name(function.get("name"), f"{where}.function.name")
        if "arguments" not in function:
            raise ChatFormatError(f"{where}.function missing 'arguments'")
        arguments = _arguments(function["arguments"], f"{where}.function.arguments")
        out.append(TOOL_CALL_BEGIN + name + TOOL_SEP + arguments + TOOL_CALL_END)
    out.append(TOOL_CALLS_END)
    return "".join(out)


def _function_entry(entry: Any, where: str) -> dict:
    """The `function` object of a tool call or a tool definition (`{"type": "function", "function": {...}}`)."""
    if not isinstance(entry, dict):
        raise ChatFormatError(f"{where} must be an object")
    if entry.get("type", "function") != "function":
        raise ChatFormatError(f"{where}.type must be 'function'")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise ChatFormatError(f"{where}.function must be an object")
    return function


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{where} must be a non-empty string")
    return _plain(name, where)


def _arguments(arguments: Any, where: str) -> str:
    """Canonical JSON of a JSON object given as a dict or as a JSON string."""
    if isinstance(arguments, str):
        arguments = _loads(arguments)
        if arguments is _INVALID:
            raise ChatFormatError(f"{where} is not valid JSON")
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"{where} must be a JSON object")
    try:
        text = _canonical(arguments)
    except (TypeError, ValueError):
        raise ChatFormatError(f"{where} is not valid JSON") from None
    return _plain(text, where)


def _tool_output(msg: dict, i: int, first: bool) -> str:
    if "tool_call_id" in msg and not isinstance(msg["tool_call_id"], str):
        raise ChatFormatError(f"message {i}: tool_call_id must be a string")
    return (TOOL_OUTPUTS_BEGIN if first else "") + TOOL_OUTPUT_BEGIN + _content(msg, i) + TOOL_OUTPUT_END


def _tools_block(tools: Any) -> str:
    """The tools part of the system text; empty for an empty list."""
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list")
    if not tools:
        return ""
    lines = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        function = _function_entry(tool, where)
        _name(function.get("name"), f"{where}.function.name")
        try:
            line = _canonical(function)
        except (TypeError, ValueError):
            raise ChatFormatError(f"{where}.function is not valid JSON") from None
        lines.append(_plain(line, f"{where}.function"))
    return TOOLS_HEADER + "\n".join(lines) + TOOLS_FOOTER
