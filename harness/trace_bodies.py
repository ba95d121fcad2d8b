"""A trace's conversation as the request bodies its client sent, one per assistant turn.

A trace line holds a whole conversation in its client's shape (Chat Completions, Anthropic Messages or
OpenAI Responses). Turn `k` is served as the body the client sent for it: the line's own request fields
(`tools`, `tool_choice`, the thinking setting; `system` or `instructions`), its conversation cut before
the turn. The official recipe converts and encodes that body (`recipe.official.Protocol`), so a turn's
prompt is the one DeepSeek's API would have served.

Turns, in each shape's conversation list:
- chat (`messages`) and anthropic (`messages`): each assistant message;
- responses (`input`, after which the line's `output` items follow): each run of consecutive assistant
  items (assistant messages, `reasoning`, `function_call`, `custom_tool_call`, `web_search_call`).

What a transcript holds and a request body cannot is converted on reading (`ClientConversation.of`);
the rest goes to the recipe as the client wrote it, and what the recipe refuses (a provider's server
tools, say) fails the turns that send it, with the recipe's reason:
- chat: the legacy `function_call` / `function` / `functions` shapes (harness.traces converts them to
  tool calls, tool messages and tools); `input_text` and `output_text` parts (a Responses client's part
  names) are `text` parts; a null tool content is "";
- anthropic: `redacted_thinking` blocks are dropped (their content is encrypted for another provider:
  no model can read it);
- responses: a string `input` is one user message; the `output` items follow the `input` ones; a line
  that continues another (`previous_response_id`) holds the earlier conversation before its own.

Free-running replay extends a conversation with the model's own response in the client's shape
(`response_entries`), the answers to its tool calls (`tool_outputs`) or the trace's next user entries
(`user_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

FORMATS = ("chat", "anthropic", "responses")
RECIPE_FORMAT = {"chat": "chat", "anthropic": "messages", "responses": "responses"}
CONVERSATION = {"chat": "messages", "anthropic": "messages", "responses": "input"}
REQUEST_FIELDS = {  # a line's fields that are part of its request bodies, besides the conversation
    "chat": ("tools", "tool_choice", "thinking"),
    "anthropic": ("system", "tools", "tool_choice", "thinking"),
    "responses": ("instructions", "tools", "tool_choice", "reasoning"),
}
_ASSISTANT_ITEMS = ("reasoning", "function_call", "custom_tool_call", "web_search_call")
_TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class Call:
    """A tool call as a free-running stub matches it: its id, its tool's name, and its arguments (a
    custom tool's free-text input)."""

    call_id: str
    name: str
    arguments: str | dict


@dataclass(frozen=True)
class ClientConversation:
    """A trace's whole conversation in its client's format, as the line holds it (`body`: its request
    fields and its conversation entries), and where in its entries each assistant turn starts. The
    bodies it makes (`before`, `through`, `with_entries`) hold their entries as a request holds them."""

    format: str
    body: dict

    @classmethod
    def of(cls, format: str, fields: dict, entries: list[Any]) -> ClientConversation:
        """The conversation of a line's request `fields` and its conversation `entries`."""
        body = {key: fields[key] for key in REQUEST_FIELDS[format] if key in fields}
        body[CONVERSATION[format]] = entries
        return cls(format, body)

    @property
    def recipe_format(self) -> str:
        return RECIPE_FORMAT[self.format]

    @property
    def entries(self) -> list[Any]:
        return self.body[CONVERSATION[self.format]]

    @cached_property
    def turn_starts(self) -> list[int]:
        """The index in `entries` at which each assistant turn starts."""
        assistant = [_is_assistant(self.format, entry) for entry in self.entries]
        return [i for i, mine in enumerate(assistant) if mine and (i == 0 or not assistant[i - 1]
                                                                    or self.format != "responses")]

    @property
    def turns(self) -> int:
        return len(self.turn_starts)

    def with_entries(self, entries: list[Any]) -> dict:
        """A request body: this conversation's request fields and `entries`, with what a request cannot
        hold converted (see the module docstring)."""
        return {**self.body, CONVERSATION[self.format]: [_as_request(self.format, entry) for entry in entries]}

    def before(self, turn: int) -> dict:
        """The body the client sent for turn `turn` (from 1): the conversation before it."""
        return self.with_entries(self.entries[: self.turn_starts[turn - 1]])

    def through(self, turn: int) -> dict:
        """The conversation up to turn `turn`'s end and the tool outputs that answer it: a body whose
        encoding holds the turn as the model wrote it. Calls the trace leaves unanswered (its last turn)
        get empty outputs, since the recipe refuses a call without one; they follow the turn's end."""
        entries = self.entries
        start = end = self.turn_starts[turn - 1]
        end += 1
        while end < len(entries) and self.format == "responses" and _is_assistant(self.format, entries[end]):
            end += 1
        calls = [call for entry in entries[start:end] for call in entry_calls(self.format, entry)]
        while end < len(entries) and _is_tool_output(self.format, entries[end]):
            end += 1
        answered = {call_id for entry in entries[start:end] for call_id in _answered(self.format, entry)}
        unanswered = [call for call in calls if call.call_id not in answered]
        after = tool_outputs(self.format, unanswered, [""] * len(unanswered), self.custom_tools)
        return self.with_entries([*entries[:end], *after])

    @property
    def custom_tools(self) -> set[str]:
        """The names of the Responses custom tools (free-text input) the body offers."""
        tools = self.body.get("tools") if self.format == "responses" else None
        return {t.get("name") for t in tools or [] if isinstance(t, dict) and t.get("type") == "custom"}

    def user_blocks(self) -> list[list[tuple[int, Any]]]:
        """The runs of user entries after the first turn (what the user says next), each entry with its
        index; an Anthropic user message loses its tool results (they answer recorded calls, which a
        free-running turn may not have made) and is left out when nothing else remains."""
        blocks: list[list[tuple[int, Any]]] = []
        previous_user = False
        for index in range(self.turn_starts[0], len(self.entries)):
            entry = _user_part(self.format, self.entries[index])
            if entry is not None and not previous_user:
                blocks.append([])
            if entry is not None:
                blocks[-1].append((index, entry))
            previous_user = entry is not None or (previous_user and _is_tool_output(self.format, self.entries[index]))
        return blocks


def response_entries(format: str, response: dict) -> list[dict]:
    """The conversation entries a response object (as `Protocol.respond` writes it) adds to a history."""
    if format == "chat":
        message = response["choices"][0]["message"]
        calls = [{k: v for k, v in call.items() if k != "index"} for call in message.get("tool_calls") or []]
        return [{**{k: v for k, v in message.items() if k != "tool_calls"}, **({"tool_calls": calls} if calls else {})}]
    if format == "anthropic":
        return [{"role": "assistant", "content": response["content"]}]
    return list(response["output"])


def response_calls(format: str, response: dict) -> list[Call]:
    """The tool calls a response object makes."""
    return [call for entry in response_entries(format, response) for call in entry_calls(format, entry)]


def entry_calls(format: str, entry: Any) -> list[Call]:
    """The tool calls an assistant entry makes (none for any other entry)."""
    if not _is_assistant(format, entry):
        return []
    if format == "chat":
        return [Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in entry.get("tool_calls") or []
                if isinstance(c, dict) and isinstance(c.get("function"), dict)]
    if format == "anthropic":
        content = entry.get("content")
        return [Call(b.get("id"), b.get("name"), b.get("input")) for b in content if isinstance(b, dict)
                and b.get("type") == "tool_use"] if isinstance(content, list) else []
    if entry.get("type") in ("function_call", "custom_tool_call"):
        return [Call(entry.get("call_id"), entry.get("name"),
                     entry.get("input") if entry["type"] == "custom_tool_call" else entry.get("arguments"))]
    return []


def tool_outputs(format: str, calls: list[Call], contents: list[str], custom: set[str]) -> list[dict]:
    """The entries that answer `calls` with `contents` (`custom`: the names of custom tools, whose
    Responses outputs are custom tool outputs)."""
    if format == "chat":
        return [{"role": "tool", "tool_call_id": c.call_id, "content": text} for c, text in zip(calls, contents)]
    if format == "anthropic":
        return [] if not calls else [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.call_id, "content": text}
                                             for c, text in zip(calls, contents)]}]
    return [{"type": "custom_tool_call_output" if c.name in custom else "function_call_output", "call_id": c.call_id,
             "output": text} for c, text in zip(calls, contents)]


def recorded_message(format: str, response: dict) -> dict:
    """What a recorded turn keeps of its response: the entries it adds to the conversation (the rest of
    a response object, e.g. a Responses timestamp, is not the model's)."""
    return {"format": format, "entries": response_entries(format, response)}


def _answered(format: str, entry: Any) -> list[str]:
    """The ids of the calls a tool-output entry answers."""
    if not _is_tool_output(format, entry):
        return []
    if format == "chat":
        return [entry.get("tool_call_id")]
    if format == "anthropic":
        return [b.get("tool_use_id") for b in entry["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]
    return [entry.get("call_id")]


def _is_assistant(format: str, entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    if format != "responses":
        return entry.get("role") == "assistant"
    kind = entry.get("type", "message")
    return (kind == "message" and entry.get("role") == "assistant") or kind in _ASSISTANT_ITEMS


def _is_tool_output(format: str, entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    if format == "chat":
        return entry.get("role") == "tool"
    if format == "anthropic":
        content = entry.get("content")
        return (entry.get("role") == "user" and isinstance(content, list)
                and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content))
    return entry.get("type") in ("function_call_output", "custom_tool_call_output")


def _user_part(format: str, entry: Any) -> Any:
    """`entry` when it is something the user says, an Anthropic user message without its tool results,
    or None."""
    if not isinstance(entry, dict) or entry.get("role") != "user" or entry.get("type", "message") != "message":
        return None
    content = entry.get("content")
    if format == "anthropic" and isinstance(content, list):
        said = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_result")]
        return {**entry, "content": said} if said else None
    return entry


def _as_request(format: str, entry: Any) -> Any:
    """A transcript's entry as a request body holds it (see the module docstring)."""
    if not isinstance(entry, dict):
        return entry
    content = entry.get("content")
    if format == "chat":
        if entry.get("role") == "tool" and content is None:
            return {**entry, "content": ""}
        if isinstance(content, list):
            return {**entry, "content": [{**p, "type": "text"} if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                         else p for p in content]}
    if format == "anthropic" and isinstance(content, list):
        return {**entry, "content": [b for b in content if not (isinstance(b, dict) and b.get("type") == "redacted_thinking")]}
    return entry
