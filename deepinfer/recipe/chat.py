"""OpenAI Chat Completions messages -> DeepSeek-V3.x/V4-style prompt text, and generated text -> message.

Prompt format (special tokens written out literally, `{...}` is message text):

    <｜begin▁of▁sentence｜>{system}
    user        <｜User｜>{content}
    assistant   <｜Assistant｜>{think}{content}{calls}<｜end▁of▁sentence｜>
    tool(s)     <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>...
                <｜tool▁outputs▁end｜>
    generation  <｜Assistant｜><think>      when thinking
                <｜Assistant｜></think>     otherwise

- {system}: the contents of the leading system and developer messages (a developer message is a
  system message by OpenAI's newer name), then (when tools are given) the tools block, joined by a
  blank line ("\\n\\n"); empty parts are left out. The tools block lists one tool per line: a function
  tool as its `function` object's canonical JSON (compact, sorted keys), any other tool (a custom tool,
  a provider's server tool such as web search) as its whole definition's canonical JSON.
- {think}: `<think>{reasoning_content}</think>` when thinking is on and the message has a
  `reasoning_content` (not None); otherwise `</think>`. So a completion generated after the
  generation prompt, parsed by `parse_completion` with the same `thinking`, re-encodes to exactly
  the prompt plus the generated text.
- {content} of an assistant message: its content, then its `refusal` (when given), joined by "\\n".
- {calls}: `<｜tool▁calls▁begin｜>` + per call `<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}
  <｜tool▁call▁end｜>` (no line break) + `<｜tool▁calls▁end｜>`; absent without tool calls. Arguments
  are written as `canonical_arguments` gives them: canonical JSON (compact, sorted keys, non-ASCII
  kept) when they are a JSON object, otherwise verbatim, as the model emitted them (empty or cut-off
  arguments happen). A custom tool call (`{"type": "custom", "custom": {"name", "input"}}`) writes its
  free-text input verbatim. A call marked `"server": true` (run by the provider, e.g. web search) is
  written like any other.
- Consecutive tool messages share one `<｜tool▁outputs▁begin｜>...<｜tool▁outputs▁end｜>` group.
- Content is a string or a list of parts, joined with "\\n": text parts (`text`, `input_text`,
  `output_text`; their other fields, such as annotations, are not rendered), `refusal` parts, and
  `document` parts with a text source (Anthropic's shape: title, context and text, one per line).
  Image, audio and file parts (`image_url`, `input_image`, `image`, `input_audio`, `file`,
  `input_file`, a document with a base64, URL or file source) are well-formed but cannot be read by
  this text-only model: rendering them raises `UnsupportedContentError` naming the message, the part
  and its type. `check_messages` runs every other check without rendering them, so a conversation can
  be validated whole and its turns before such a part still be served.

Kept in the data, never rendered: a tool message's `is_error` and `name` (the template has no marker
for a failed call), a call's `server` flag, and `unrendered` on any message: source objects with no
Chat Completions equivalent (e.g. Anthropic thinking signatures, redacted thinking, citations, server
tool results; see harness.trace_import), kept verbatim so nothing imported is lost.

Rules (each broken one raises a one-line `ChatFormatError` naming the message index and field):
system and developer messages come first; tool messages follow an assistant message with tool calls
(or another tool message); `tool_calls` only on assistant messages (the legacy `function_call` is
rejected: harness.traces converts it); an assistant message needs content, a refusal or tool calls;
arguments are a string or a JSON object; `tool_call_id`, when given, is a string; and a function's
name may not contain a special token.

Text a client sent is encoded as the characters it is, even where it spells a special token (a pasted
`<｜end▁of▁sentence｜>` in a message, a tool description or arguments): the rendered prompt is a
`ChatPrompt`, the template's own special tokens kept apart from the text between them, and only the
former become special ids. Nothing a client sent is refused or lost for its spelling; its display text
(`encode_messages`) shows it verbatim.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
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
SYSTEM_ROLES = ("system", "developer")
TEXT_PARTS = ("text", "input_text", "output_text")
UNREADABLE_PARTS = {
    "image_url": "an image", "input_image": "an image", "image": "an image", "input_audio": "audio",
    "file": "a file", "input_file": "a file",
}
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_INVALID = object()

class Special(str):
    """A special token the template writes, as opposed to client text that happens to spell one."""


_Pieces = list[str]  # a prompt fragment: `Special` tokens and text, in order


TOOLS_HEADER = "## Tools\n\nYou can call these functions. Each line is one function's JSON schema:\n"
TOOLS_FOOTER: _Pieces = [
    "\n\nTo call functions, reply with ", Special(TOOL_CALLS_BEGIN), ", then for each call ",
    Special(TOOL_CALL_BEGIN), "NAME", Special(TOOL_SEP), "ARGUMENTS", Special(TOOL_CALL_END),
    " where ARGUMENTS is a JSON object, then ", Special(TOOL_CALLS_END), ".",
]


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered prompt: the template's special tokens and the text between them, in order (no two
    texts adjacent, no empty text)."""

    pieces: tuple[str, ...]

    @classmethod
    def of(cls, pieces: _Pieces) -> ChatPrompt:
        merged: _Pieces = []
        for piece in pieces:
            if merged and not isinstance(piece, Special) and not isinstance(merged[-1], Special):
                merged[-1] += piece
            elif piece:
                merged.append(piece)
        return cls(tuple(merged))

    @property
    def text(self) -> str:
        """The prompt as text: what a reader sees (a client's special-token spelling included)."""
        return "".join(self.pieces)

    def token_ids(self, tokenizer: TextTokenizer) -> list[int]:
        """Special tokens as their ids, text as text (a special token's spelling in it included)."""
        ids: list[int] = []
        for piece in self.pieces:
            ids.extend([tokenizer.special_id(piece)] if isinstance(piece, Special) else tokenizer.encode_literal(piece))
        return ids

    def after(self, head: ChatPrompt) -> ChatPrompt:
        """The pieces that follow `head`, which must be this prompt's first pieces."""
        if self.pieces[: len(head.pieces)] != head.pieces:
            raise ValueError("the head is not where this prompt starts")
        return ChatPrompt(self.pieces[len(head.pieces):])


class ChatFormatError(DeepInferError, ValueError):
    """Messages or tools that do not fit the chat format."""

    kind = "malformed"


class UnsupportedContentError(ChatFormatError):
    """Well-formed content that a text-only model cannot read (an image, audio)."""

    kind = "unsupported_content"


_Unreadable = list[UnsupportedContentError] | None  # where unreadable parts are collected; None: raise them


def render_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
) -> ChatPrompt:
    """The prompt for `messages` (see the module docstring for the format and the rules)."""
    return ChatPrompt.of(_encode(messages, tools, thinking, add_generation_prompt, None))


def encode_messages(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt's text for `messages` (`render_chat(...).text`)."""
    return render_chat(messages, tools, thinking, add_generation_prompt).text


def check_messages(messages: list[dict], tools: list[dict] | None = None) -> list[UnsupportedContentError]:
    """Every check `encode_messages` makes, except that content a text-only model cannot read is
    returned (one error per such part, in order) rather than raised: a trace is validated whole when
    it is loaded, and only the prompts that hold such a part fail when they are rendered."""
    unreadable: list[UnsupportedContentError] = []
    _encode(messages, tools, False, False, unreadable)
    return unreadable


def content_text(content: Any, where: str = "content") -> str:
    """Message content (a string or a list of parts) as the template renders it; `where` names it in
    errors."""
    return _content_text(content, where, None)


def canonical_arguments(arguments: str | dict) -> str:
    """Tool-call arguments as the template writes them and as recorded calls are matched: canonical
    JSON (compact, sorted keys, non-ASCII kept) of a JSON object, given as a dict or as its text; any
    other text verbatim (models emit empty, cut-off or otherwise invalid arguments)."""
    value = arguments_object(arguments)
    return _canonical(value) if value is not None else arguments


def arguments_object(arguments: str | dict) -> dict | None:
    """Tool-call arguments as a JSON object (given as a dict or as strict JSON text); None for text
    that is not one."""
    value = arguments if isinstance(arguments, dict) else _loads(arguments)
    return value if isinstance(value, dict) else None


def _encode(messages: Any, tools: Any, thinking: bool, add_generation_prompt: bool,
            unreadable: _Unreadable) -> _Pieces:
    """The prompt's pieces; unreadable content raises, or (with a list) is collected there and left out."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    system_parts: list[_Pieces] = []
    out: _Pieces = []
    prev_role = None
    takes_outputs = False  # the previous message was an assistant tool call or a tool output
    for i, msg in enumerate(messages):
        role = _role(msg, i)
        if msg.get("tool_calls") and role != "assistant":
            raise ChatFormatError(f"message {i}: tool_calls are only allowed on assistant messages")
        if "function_call" in msg:
            raise ChatFormatError(f"message {i}: function_call is the legacy shape of tool_calls (not supported here)")
        _check_unrendered(msg, i)
        if prev_role == "tool" and role != "tool":
            out.append(Special(TOOL_OUTPUTS_END))
        if role in SYSTEM_ROLES:
            if prev_role not in (None, *SYSTEM_ROLES):
                raise ChatFormatError(f"message {i}: {role} message after the conversation started "
                                      "(system and developer messages must come first)")
            system_parts.append([_content(msg, i, unreadable)])
        elif role == "user":
            out += [Special(USER), _content(msg, i, unreadable)]
        elif role == "assistant":
            out += _assistant(msg, i, thinking, unreadable)
        else:
            if not takes_outputs:
                raise ChatFormatError(f"message {i}: tool message must follow an assistant message with tool_calls")
            out += _tool_output(msg, i, prev_role != "tool", unreadable)
        takes_outputs = role == "tool" or bool(msg.get("tool_calls"))
        prev_role = role
    if prev_role == "tool":
        out.append(Special(TOOL_OUTPUTS_END))
    if tools is not None:
        system_parts.append(_tools_block(tools))
    if add_generation_prompt:
        out += [Special(ASSISTANT), Special(THINK_BEGIN if thinking else THINK_END)]
    system: _Pieces = []
    for part in (p for p in system_parts if any(p)):
        system += ["\n\n", *part] if system else part
    return [Special(BOS), *system, *out]


def encode_chat(
    tokenizer: TextTokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `render_chat(...)`, which starts with BOS."""
    return render_chat(messages, tools, thinking, add_generation_prompt).token_ids(tokenizer)


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
    if role not in ROLES and role not in SYSTEM_ROLES:
        known = ", ".join(dict.fromkeys((*SYSTEM_ROLES, *ROLES)))
        raise ChatFormatError(f"message {i}: unknown role {role!r} (expected one of {known})")
    return role


def _check_unrendered(msg: dict, i: int) -> None:
    if not isinstance(msg.get("unrendered", []), list):
        raise ChatFormatError(f"message {i}: unrendered must be a list")


def _content(msg: dict, i: int, unreadable: _Unreadable) -> str:
    if "content" not in msg:
        raise ChatFormatError(f"message {i}: missing 'content'")
    return _content_text(msg["content"], f"message {i}: content", unreadable)


def _content_text(content: Any, where: str, unreadable: _Unreadable) -> str:
    if isinstance(content, list):
        texts = [_part_text(part, f"{where}[{j}]", unreadable) for j, part in enumerate(content)]
        content = "\n".join(text for text in texts if text is not None)
    elif not isinstance(content, str):
        raise ChatFormatError(f"{where} must be a string or a list of content parts")
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
        raise ChatFormatError(f"{where}.type: unknown content part type {kind!r}")
    else:
        raise ChatFormatError(f"{where} must be a content part object")
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
        raise ChatFormatError(f"{where}.source must be an object")
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
        raise ChatFormatError(f"{where}.{key} must be a string")
    return obj[key]


def _assistant(msg: dict, i: int, thinking: bool, unreadable: _Unreadable) -> _Pieces:
    calls = msg.get("tool_calls")
    refusal = msg.get("refusal")
    if refusal is not None and not isinstance(refusal, str):
        raise ChatFormatError(f"message {i}: refusal must be a string")
    if msg.get("content") is None and refusal is None and not calls:
        raise ChatFormatError(f"message {i}: assistant message needs 'content', 'refusal' or 'tool_calls'")
    content = "" if msg.get("content") is None else _content(msg, i, unreadable)
    text = "\n".join(t for t in (content, refusal) if t)
    reasoning = msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError(f"message {i}: reasoning_content must be a string")
    think = [Special(THINK_BEGIN), reasoning] if thinking and reasoning is not None else []
    return [Special(ASSISTANT), *think, Special(THINK_END), text, *_tool_calls(calls, i), Special(EOS)]


def _tool_calls(calls: Any, i: int) -> _Pieces:
    if calls is None or calls == []:
        return []
    if not isinstance(calls, list):
        raise ChatFormatError(f"message {i}: tool_calls must be a list")
    out = [Special(TOOL_CALLS_BEGIN)]
    for j, call in enumerate(calls):
        name, arguments = _call(call, f"message {i}: tool_calls[{j}]")
        out += [Special(TOOL_CALL_BEGIN), name, Special(TOOL_SEP), arguments, Special(TOOL_CALL_END)]
    out.append(Special(TOOL_CALLS_END))
    return out


def _call(call: Any, where: str) -> tuple[str, str]:
    """A call's name and its arguments as written: a function call's (see `canonical_arguments`) or a
    custom call's free-text input."""
    if not isinstance(call, dict):
        raise ChatFormatError(f"{where} must be an object")
    if not isinstance(call.get("server", False), bool):
        raise ChatFormatError(f"{where}.server must be true or false")
    if call.get("type") == "custom":
        custom = call.get("custom")
        if not isinstance(custom, dict):
            raise ChatFormatError(f"{where}.custom must be an object")
        name = _name(custom.get("name"), f"{where}.custom.name")
        return name, _string_field(custom, "input", f"{where}.custom")
    if call.get("type", "function") != "function":
        raise ChatFormatError(f"{where}.type must be 'function' or 'custom'")
    function = call.get("function")
    if not isinstance(function, dict):
        raise ChatFormatError(f"{where}.function must be an object")
    name = _name(function.get("name"), f"{where}.function.name")
    if "arguments" not in function:
        raise ChatFormatError(f"{where}.function missing 'arguments'")
    return name, _arguments(function["arguments"], f"{where}.function.arguments")


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{where} must be a non-empty string")
    found = _SPECIAL_RE.search(name)
    if found:
        raise ChatFormatError(f"{where} contains special token {found.group()!r}")
    return name


def _arguments(arguments: Any, where: str) -> str:
    if not isinstance(arguments, (str, dict)):
        raise ChatFormatError(f"{where} must be a string or a JSON object")
    return _json_text(canonical_arguments, arguments, where)


def _json_text(encode: Callable[[Any], str], value: Any, where: str) -> str:
    """`encode(value)` as prompt text: a one-line error when it is not JSON."""
    try:
        return encode(value)
    except (TypeError, ValueError):
        raise ChatFormatError(f"{where} is not valid JSON") from None


def _tool_output(msg: dict, i: int, first: bool, unreadable: _Unreadable) -> _Pieces:
    if "tool_call_id" in msg and not isinstance(msg["tool_call_id"], str):
        raise ChatFormatError(f"message {i}: tool_call_id must be a string")
    if not isinstance(msg.get("is_error", False), bool):
        raise ChatFormatError(f"message {i}: is_error must be true or false")
    opening = [Special(TOOL_OUTPUTS_BEGIN)] if first else []
    return [*opening, Special(TOOL_OUTPUT_BEGIN), _content(msg, i, unreadable), Special(TOOL_OUTPUT_END)]


def _tools_block(tools: Any) -> _Pieces:
    """The tools part of the system text; empty for an empty list."""
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list")
    if not tools:
        return []
    lines = "\n".join(_tool_line(tool, f"tools[{k}]") for k, tool in enumerate(tools))
    return [TOOLS_HEADER + lines, *TOOLS_FOOTER]


def _tool_line(tool: Any, where: str) -> str:
    """A function tool's `function` object, or any other tool's whole definition, as canonical JSON."""
    if not isinstance(tool, dict):
        raise ChatFormatError(f"{where} must be an object")
    kind = tool.get("type", "function")
    if kind == "function":
        described, where = tool.get("function"), f"{where}.function"
        if not isinstance(described, dict):
            raise ChatFormatError(f"{where} must be an object")
        _name(described.get("name"), f"{where}.name")
    elif isinstance(kind, str) and kind:
        described = tool
    else:
        raise ChatFormatError(f"{where}.type must be a non-empty string")
    return _json_text(_canonical, described, where)


MAX_CONSTRAINED_CALLS = 8  # tool calls a constrained assistant turn may make (`tool_call_constraint`)
REASONING_BYTES = 4096  # the reasoning a constrained thinking turn may write before its calls


def tool_call_constraint(tools: Any, tool_choice: Any, thinking: bool = False) -> dict:
    """A Lark constraint (`SamplingParams.structured`, compiled by llguidance, which reads a special
    token's text in a grammar as that token) that makes the assistant turn 1 to MAX_CONSTRAINED_CALLS
    tool calls in this format, each naming a function tool and carrying arguments valid under its
    `parameters` schema (compact JSON): `tool_choice` "required" (OpenAI, Responses; Anthropic's
    {"type": "any"}) takes any function tool, a named one ({"type": "function", "function": {"name":
    ...}}, Responses' {"type": "function", "name": ...}, Anthropic's {"type": "tool", "name": ...})
    exactly one call of it. With thinking the turn starts with up to REASONING_BYTES of reasoning."""
    functions = _constrained_functions(tools, tool_choice)
    calls = "call" if isinstance(tool_choice, dict) and tool_choice.get("type") != "any" else f"call~1..{MAX_CONSTRAINED_CALLS}"
    lines = [f"start: {'REASONING ' + THINK_END + ' ' if thinking else ''}{TOOL_CALLS_BEGIN} {calls} {TOOL_CALLS_END}",
             "call: " + " | ".join(f"call_{k}" for k in range(len(functions)))]
    if thinking:
        lines.append(f"REASONING: /(?s:.{{0,{REASONING_BYTES}}})/")
    for k, (name, parameters) in enumerate(functions):
        compact = {**parameters, "x-guidance": {"whitespace_flexible": False}}  # as `json_schema` constraints
        lines.append(f"call_{k}: {TOOL_CALL_BEGIN} {json.dumps(name)} {TOOL_SEP} args_{k} {TOOL_CALL_END}")
        lines.append(f"args_{k}: %json {json.dumps(compact, sort_keys=True)}")
    return {"grammar": "\n".join(lines) + "\n", "syntax": "lark"}


def _constrained_functions(tools: Any, tool_choice: Any) -> list[tuple[str, dict]]:
    """(name, parameters schema) of the function tools `tool_choice` allows."""
    if not isinstance(tools, list) or not tools:
        raise ChatFormatError("structured='tool_call' needs tools")
    functions = []
    for k, tool in enumerate(tools):
        _tool_line(tool, f"tools[{k}]")  # the checks encoding makes
        if tool.get("type", "function") == "function":
            described = tool["function"]
            parameters = described.get("parameters", {"type": "object"})
            if not isinstance(parameters, dict):
                raise ChatFormatError(f"tools[{k}].function.parameters must be a JSON Schema object")
            functions.append((described["name"], parameters))
    if tool_choice in ("required", {"type": "any"}):
        wanted = None
    elif isinstance(tool_choice, dict) and tool_choice.get("type") in ("function", "tool"):
        function = tool_choice.get("function")
        wanted = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if not isinstance(wanted, str) or not wanted:
            raise ChatFormatError("tool_choice names no function")
    else:
        raise ChatFormatError(f"structured='tool_call' needs tool_choice 'required' or a named function, got "
                              f"{tool_choice!r}")
    chosen = [(name, parameters) for name, parameters in functions if wanted in (None, name)]
    if not chosen:
        raise ChatFormatError(f"tool_choice names {wanted!r}, which is not a function tool" if wanted
                              else "structured='tool_call' needs a function tool")
    return chosen
