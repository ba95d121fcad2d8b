"""Agent traces: the JSONL episode format that replay reads, its validation, and the `traces` suite.

One episode per line, in the OpenAI Chat Completions shape:

    {"id": "weather-1", "messages": [...], "tools": [...], "sampling": {...}, "metadata": {...},
     "recorded": {"turns": [...], "outcome": {...}}}

- `messages`: system / developer / user / assistant (with `tool_calls`) / tool (with `tool_call_id`)
  messages, as deepinfer.recipe.chat accepts them (its docstring lists what it renders and what it
  keeps unrendered). Each assistant message is one *turn*; turns count from 1. Legacy shapes are
  converted on reading: an assistant `function_call` becomes one tool call with id `call_<message
  index>` (a message with both `function_call` and `tool_calls` is an error); a `function` message
  becomes a tool message (keeping its `name`) answering the unanswered call of that name in the
  assistant message before it; a tool message's null content becomes "".
- `tools` (optional): Chat Completions tools, or the legacy `functions` list (not both). `sampling`
  (optional): SamplingParams fields; a turn without a `seed` gets one derived from the run seed and
  its request id `<id>/turn-<k>`. `tool_choice` (optional; each format's own shape, kept in the Chat
  Completions one): with `"structured": "tool_call"` in `sampling`, every replayed turn is constrained
  to tool calls of `tools` as it allows ("required" or a named function).
- `id` (optional, default `line-N`) must be unique in the file; `metadata` is any object, carried along.
- `recorded` (optional; what a cassette adds): the engine's outputs per turn with their stream hashes,
  and the episode's outcome as replay reported it.
- `"format": "anthropic"` or `"format": "responses"` lines hold an Anthropic Messages conversation
  (`system`, `messages`, `tools`) or an OpenAI Responses one (`instructions`, `input` and optional
  `output` items, `tools`); harness.trace_import converts them, without losing anything, to the
  shape above, which is how a cassette stores them (harness.trace_export writes them back).
- `response_id` (optional, unique in the file): the id of the response the line holds (a responses
  line's `output`), which a later responses line's `previous_response_id` continues: its episode is
  that line's messages, then its own (the canonical line holds them all, and keeps `response_id`).

Images, audio and files are kept in the messages: such an episode loads, and its turns before the
part are served; a turn whose prompt holds one fails with kind `unsupported_content`.

Every error is one line that names the field; its location `file:line` is kept apart (`where`), so
that what audit rows store (kind and detail) does not depend on the file's path. A malformed line
does not stop the file: `load_traces` returns the good episodes and one error per bad line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from itertools import takewhile
from pathlib import Path
from typing import Any

from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.prompts_file import PromptRequest, json_object, read_jsonl_lines
from deepinfer.recipe.chat import (ChatFormatError, UnsupportedContentError, check_messages, content_text,
                                  render_chat, tool_call_constraint)
from deepinfer.sampling_params import TOOL_CALL, SamplingParams
from deepinfer.harness.suite_base import Suite, SuiteRequest, file_hash
from deepinfer.harness.trace_import import TraceFormatError, canonical_arguments, chat_tool_choice, from_anthropic, from_responses

FORMATS = ("chat", "anthropic", "responses")
_COMMON_FIELDS = {"id", "format", "tools", "tool_choice", "sampling", "metadata", "response_id"}
_FORMAT_FIELDS = {
    "chat": {"messages", "functions", "recorded"},
    "anthropic": {"system", "messages"},
    "responses": {"instructions", "input", "output", "previous_response_id"},
}
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ToolResult:
    """A recorded call and the answer the trace gives it: what a free-running stub can replay."""

    turn: int
    name: str
    arguments: str  # as `canonical_arguments` writes them
    content: str


@dataclass(frozen=True)
class RecordedTurn:
    """One turn as the engine produced it (token ids, fp32 logprobs, top-2 per position) and its hashes."""

    turn: int
    prompt_hash: str
    token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]
    finish_reason: str
    text: str | None
    message: dict
    token_hash: str
    logit_hash: str


@dataclass(frozen=True)
class Recording:
    turns: list[RecordedTurn]
    outcome: dict


@dataclass(frozen=True)
class Episode:
    episode_id: str
    path: str
    line: int
    messages: list[dict]
    tools: list[dict] | None = None
    sampling: dict = field(default_factory=dict)
    metadata: dict | None = None
    recording: Recording | None = None
    tool_results: tuple[ToolResult, ...] = ()
    response_id: str | None = None  # what later responses lines' previous_response_id continues
    tool_choice: str | dict | None = None  # Chat Completions shape (`trace_import.chat_tool_choice`)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def turn_positions(self) -> list[int]:
        """Message index of each assistant turn."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    @property
    def turns(self) -> int:
        return len(self.turn_positions)

    def history(self, turn: int) -> list[dict]:
        """The messages before assistant turn `turn` (from 1): its teacher-forced prompt."""
        return self.messages[: self.turn_positions[turn - 1]]

    def request(self, turn: int) -> SuiteRequest:
        """Teacher-forced turn `turn` as a suite request (the recorded history, then a generation prompt)."""
        return _turn_request(self, turn, self.history(turn))

    def params(self, turn: int, run_seed: int) -> SamplingParams:
        """The sampling params of turn `turn`, as the `traces` suite sets them (also past the trace's turns)."""
        return _turn_request(self, turn, []).params(run_seed)

    def to_json(self) -> dict:
        """The canonical (Chat Completions shaped) line of this episode."""
        line: dict[str, Any] = {"id": self.episode_id, "messages": self.messages}
        if self.tools is not None:
            line["tools"] = self.tools
        if self.sampling:
            line["sampling"] = self.sampling
        if self.metadata is not None:
            line["metadata"] = self.metadata
        if self.response_id is not None:
            line["response_id"] = self.response_id
        if self.tool_choice is not None:
            line["tool_choice"] = self.tool_choice
        if self.recording is not None:
            line["recorded"] = {"turns": [asdict(t) for t in self.recording.turns], "outcome": self.recording.outcome}
        return line


@dataclass(frozen=True)
class TraceError:
    """A line that could not be read as an episode; `message` names the file, line and field,
    `detail` only the field (what an audit row stores)."""

    line: int
    message: str
    detail: str


def turn_request_id(episode_id: str, turn: int) -> str:
    return f"{episode_id}/turn-{turn}"


class TemplateTurn(PromptRequest):
    """A trace turn's request, prompted with the project's V3-era chat template (`recipe.chat`) and its
    tool-call markup, where request files use DeepSeek's official encoding: traces move to the recipe
    next (ARCHITECTURE §5)."""

    def params(self, base: dict | None = None, llm: LLM | None = None) -> SamplingParams:
        settings = {**(base or {}), **self.sampling}
        if settings.get("structured") != TOOL_CALL:
            return super().params(base)
        try:
            constraint = tool_call_constraint(self.tools, self.tool_choice)
        except DeepInferError as err:
            raise DeepInferError(f"{self.where}: {err}") from None
        return replace(super().params(base), structured=constraint)

    def prompt_ids(self, llm: LLM) -> list[int]:
        try:
            if llm.tokenizer is None:
                raise DeepInferError("chat messages need a checkpoint with tokenizer.json")
            return llm.encode(llm.tokenize(render_chat(self.value, self.tools)))
        except DeepInferError as err:
            raise err.at(self.where) from None


def _turn_request(episode: Episode, turn: int, messages: list[dict]) -> SuiteRequest:
    request_id = turn_request_id(episode.episode_id, turn)
    return SuiteRequest(request_id, TemplateTurn(episode.where, request_id, "messages", messages, episode.tools,
                                                 episode.sampling, episode.tool_choice))


# reading files --------------------------------------------------------------------------------------


def load_traces(path: str | Path) -> tuple[list[Episode], list[TraceError]]:
    """Every valid episode of a trace file, and one error per malformed line (blank lines are skipped)."""
    lines = read_jsonl_lines(path)
    if not any(line.strip() for _, line in lines):
        raise DeepInferError(f"{path}: no episodes")
    return parse_trace_lines(str(path), lines)


def parse_trace_lines(path: str, lines: Iterable[tuple[int, str]]) -> tuple[list[Episode], list[TraceError]]:
    """Episodes and errors from numbered lines of `path`, read in order (a line can continue an
    earlier line's response); ids and response ids must be unique (the first one wins)."""
    episodes: list[Episode] = []
    errors: list[TraceError] = []
    seen: dict[str, Episode] = {}
    responses: dict[str, Episode] = {}
    for number, line in lines:
        if not line.strip():
            continue
        try:
            episode = parse_trace_line(line, path, number, responses)
            _check_unique(episode, seen, responses)
        except TraceFormatError as err:
            errors.append(TraceError(number, str(err), err.detail))
            continue
        seen[episode.episode_id] = episode
        if episode.response_id is not None:
            responses[episode.response_id] = episode
        episodes.append(episode)
    return episodes, errors


def _check_unique(episode: Episode, seen: dict[str, Episode], responses: dict[str, Episode]) -> None:
    if episode.episode_id in seen:
        first = seen[episode.episode_id].line
        raise TraceFormatError(f"id: duplicate {episode.episode_id!r} (first at line {first})", where=episode.where)
    if episode.response_id in responses:
        first = responses[episode.response_id].line
        raise TraceFormatError(f"response_id: duplicate {episode.response_id!r} (first at line {first})",
                               where=episode.where)


def parse_trace_line(text: str, path: str, line: int, responses: dict[str, Episode] | None = None) -> Episode:
    """One validated episode; TraceFormatError located at `path:line`, naming the field, otherwise.
    `responses` maps the response ids of earlier lines to their episodes, which a responses line's
    `previous_response_id` continues."""
    where = f"{path}:{line}"
    try:
        obj = json_object(text, where)
    except DeepInferError as err:
        detail = err.detail.removeprefix(f"{where}: ")  # json_object writes `where` into its messages
        raise TraceFormatError(detail, where=where) from None
    try:
        return _episode(obj, path, line, responses or {})
    except (TraceFormatError, ChatFormatError) as err:
        raise TraceFormatError(err.detail, where=where) from None


def _episode(obj: dict, path: str, line: int, responses: dict[str, Episode]) -> Episode:
    kind = obj.get("format", "chat")
    if kind not in FORMATS:
        raise TraceFormatError(f"format: unknown {kind!r} (expected one of {', '.join(FORMATS)})")
    unknown = set(obj) - _COMMON_FIELDS - _FORMAT_FIELDS[kind]
    if unknown:
        raise TraceFormatError(f"unknown field(s) {sorted(unknown)} for format {kind!r}")
    episode_id = obj.get("id", f"line-{line}")
    if not isinstance(episode_id, str) or not episode_id:
        raise TraceFormatError("id: must be a non-empty string")
    messages, tools = _IMPORTERS[kind](obj)
    messages = _continued(obj, messages, responses)
    check_messages(messages, tools)  # the chat template's own checks name the message and field
    if not any(m["role"] == "assistant" for m in messages):
        raise TraceFormatError("messages: no assistant turn to replay")
    metadata = obj.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise TraceFormatError("metadata: must be an object")
    sampling = _sampling(obj.get("sampling", {}))
    tool_choice = chat_tool_choice(obj.get("tool_choice"), kind)
    if sampling.get("structured") == TOOL_CALL:
        tool_call_constraint(tools, tool_choice)  # the turns' constraint can be made: one-line errors now
    recording = _recording(obj["recorded"]) if "recorded" in obj else None
    return Episode(episode_id, path, line, messages, tools, sampling, metadata, recording, _tool_results(messages),
                   _response_id(obj, "response_id"), tool_choice)


def _continued(obj: dict, messages: list[dict], responses: dict[str, Episode]) -> list[dict]:
    """The line's messages, after those of the earlier line its `previous_response_id` names.
    Its `instructions`, when given, must be the earlier conversation's (a system message cannot
    change mid-conversation)."""
    previous = _response_id(obj, "previous_response_id")
    if previous is None:
        return messages
    if previous not in responses:
        raise TraceFormatError(f"previous_response_id: {previous!r} is not the response_id of an earlier valid "
                               "line in this file")
    earlier = responses[previous].messages
    if "instructions" in obj:
        if earlier[0] != messages[0]:
            raise TraceFormatError("instructions: differ from those of the conversation previous_response_id "
                                   "continues (a system message cannot change mid-conversation)")
        messages = messages[1:]
    return earlier + messages


def _response_id(obj: dict, key: str) -> str | None:
    if key in obj and (not isinstance(obj[key], str) or not obj[key]):
        raise TraceFormatError(f"{key}: must be a non-empty string")
    return obj.get(key)


def _chat(obj: dict) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools of a chat line, with legacy shapes converted (see the module docstring)."""
    if "messages" not in obj:
        raise TraceFormatError("messages: missing")
    if not isinstance(obj["messages"], list) or not obj["messages"]:
        raise TraceFormatError("messages: must be a non-empty list of message objects")
    messages: list[Any] = []
    for i, message in enumerate(obj["messages"]):
        messages.append(_chat_message(message, i, messages) if isinstance(message, dict) else message)
    return messages, _chat_tools(obj)


def _chat_message(message: dict, i: int, before: list[Any]) -> dict:
    """Message `i` with its legacy shape converted; `before` holds the messages before it, converted.
    A null field is an absent one (SDK dumps write `"function_call": null` beside `tool_calls`), except
    `content`, whose null is what an assistant message with only tool calls has."""
    message = {key: value for key, value in message.items() if value is not None or key == "content"}
    if "function_call" in message:
        if "tool_calls" in message:
            raise TraceFormatError(f"message {i}: has both function_call and tool_calls (use one)")
        call = {"id": f"call_{i}", "type": "function", "function": message["function_call"]}
        message = {**{k: v for k, v in message.items() if k != "function_call"}, "tool_calls": [call]}
    if message.get("role") == "function":
        name = message.get("name")
        message = {**message, "role": "tool", "tool_call_id": _answered_call(name, before, i)}
    if message.get("role") == "tool" and message.get("content", "") is None:
        message = {**message, "content": ""}
    return message


def _answered_call(name: Any, before: list[Any], i: int) -> str:
    """The id of the first call named `name`, not yet answered, of the assistant message that the
    tool messages before message `i` follow."""
    tools = list(takewhile(lambda m: isinstance(m, dict) and m.get("role") == "tool", reversed(before)))
    answered = {m.get("tool_call_id") for m in tools}
    previous = before[len(before) - len(tools) - 1] if len(before) > len(tools) else {}
    calls = previous.get("tool_calls") if isinstance(previous, dict) and previous.get("role") == "assistant" else None
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and function.get("name") == name and call.get("id") not in answered:
            return call["id"]
    raise TraceFormatError(f"message {i}: function message {name!r} answers no unanswered call of that name "
                           "in the assistant message before it")


def _chat_tools(obj: dict) -> list[dict] | None:
    if "functions" not in obj:
        return obj.get("tools")
    if "tools" in obj:
        raise TraceFormatError("functions: given together with tools (use one)")
    if not isinstance(obj["functions"], list):
        raise TraceFormatError("functions: must be a list")
    return [{"type": "function", "function": function} for function in obj["functions"]]


_IMPORTERS: dict[str, Callable[[dict], tuple[list[dict], list[dict] | None]]] = {
    "chat": _chat, "anthropic": from_anthropic, "responses": from_responses,
}


def _sampling(sampling: Any) -> dict:
    if not isinstance(sampling, dict):
        raise TraceFormatError("sampling: must be an object")
    unknown = set(sampling) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise TraceFormatError(f"sampling: unknown field(s) {sorted(unknown)}")
    try:
        SamplingParams(**sampling)
    except DeepInferError as err:
        raise TraceFormatError(f"sampling: {err}") from None
    return sampling


def _tool_results(messages: list[dict]) -> tuple[ToolResult, ...]:
    """Pair each tool message with a call of the assistant message before it: by `tool_call_id`,
    or with the first unanswered call when it has none. A result the model cannot read (an image)
    is paired but not offered: a free-running stub could not feed it to a text-only model."""
    results = []
    pending: list[dict] = []
    turn = 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            turn += 1
            pending = list(message.get("tool_calls") or [])
        elif message["role"] == "tool":
            call_id = message.get("tool_call_id")
            match = next((c for c in pending if call_id is None or c.get("id") == call_id), None)
            if match is None:
                what = f"tool_call_id {call_id!r} matches no" if call_id is not None else "there is no"
                raise TraceFormatError(f"message {i}: {what} unanswered tool call of the assistant message before it")
            pending.remove(match)
            try:
                results.append(ToolResult(turn, *_call_key(match), content_text(message["content"])))
            except UnsupportedContentError:
                continue
        else:
            pending = []
    return tuple(results)


def _call_key(call: dict) -> tuple[str, str]:
    """A call's name and arguments (a custom call's input) as a free-running stub matches them."""
    if call.get("type") == "custom":
        name, arguments = call["custom"]["name"], call["custom"]["input"]
    else:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    return name, canonical_arguments(arguments)


# recorded outputs -----------------------------------------------------------------------------------


def _recording(value: Any) -> Recording:
    if not isinstance(value, dict) or set(value) != {"turns", "outcome"}:
        raise TraceFormatError("recorded: must be an object with 'turns' and 'outcome'")
    if not isinstance(value["outcome"], dict):
        raise TraceFormatError("recorded.outcome: must be an object")
    if not isinstance(value["turns"], list):
        raise TraceFormatError("recorded.turns: must be a list")
    turns = [_recorded_turn(t, f"recorded.turns[{i}]") for i, t in enumerate(value["turns"])]
    for i, turn in enumerate(turns):
        if turn.turn != i + 1:
            raise TraceFormatError(f"recorded.turns[{i}].turn: expected {i + 1}, got {turn.turn}")
    return Recording(turns, value["outcome"])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v)


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and all(_is_number(x) for x in v)


_TURN_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "turn": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "prompt_hash": (lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)), "64 lower-case hex digits"),
    "token_ids": (_ints, "a list of token ids"),
    "logprobs": (_numbers, "a list of numbers"),
    "top_token_ids": (lambda v: isinstance(v, list) and all(_ints(x) for x in v), "a list of lists of token ids"),
    "top_logprobs": (lambda v: isinstance(v, list) and all(_numbers(x) for x in v), "a list of lists of numbers"),
    "finish_reason": (lambda v: isinstance(v, str), "a string"),
    "text": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "message": (lambda v: isinstance(v, dict), "an object"),
    "token_hash": (lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)), "64 lower-case hex digits"),
    "logit_hash": (lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)), "64 lower-case hex digits"),
}


def _recorded_turn(value: Any, where: str) -> RecordedTurn:
    if not isinstance(value, dict):
        raise TraceFormatError(f"{where}: must be an object")
    missing = [name for name in _TURN_CHECKS if name not in value]
    if missing:
        raise TraceFormatError(f"{where}: missing {', '.join(missing)}")
    unknown = set(value) - set(_TURN_CHECKS)
    if unknown:
        raise TraceFormatError(f"{where}: unknown field(s) {sorted(unknown)}")
    for name, (check, expected) in _TURN_CHECKS.items():
        if not check(value[name]):
            raise TraceFormatError(f"{where}.{name}: must be {expected}")
    count = len(value["token_ids"])
    for name in ("logprobs", "top_token_ids", "top_logprobs"):
        if len(value[name]) != count:
            raise TraceFormatError(f"{where}.{name}: has {len(value[name])} entries for {count} token ids")
    return RecordedTurn(**value)


# the `traces` suite kind ----------------------------------------------------------------------------


@dataclass
class MalformedTraceLine(SuiteRequest):
    """A trace line that failed validation. Its prompt never resolves, so the harness records it as an
    error row (kind `malformed`, the detail without the file's path) at the line's place in the suite,
    and every other line is still served."""

    detail: str

    def prompt_ids(self, llm: LLM) -> list[int]:
        raise TraceFormatError(self.detail, where=self.request.where)


def load_traces_suite(path: Path) -> Suite:
    """Every assistant turn of every episode as a teacher-forced request `<id>/turn-<k>`, in file order;
    a malformed line becomes a request `line-<N>` that fails with the line's error."""
    episodes, errors = load_traces(path)
    items: list[tuple[int, list[SuiteRequest]]] = [
        (e.line, [e.request(k) for k in range(1, e.turns + 1)]) for e in episodes
    ]
    for error in errors:
        request_id = f"line-{error.line}"
        items.append((error.line, [MalformedTraceLine(request_id, PromptRequest(f"{path}:{error.line}", request_id,
                                                                                  "messages", []), error.detail)]))
    requests = [request for _, group in sorted(items, key=lambda item: item[0]) for request in group]
    return Suite("traces", Path(path), file_hash(Path(path)), requests)
