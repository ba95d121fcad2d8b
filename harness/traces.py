"""Agent traces: the JSONL episode format that replay reads, its validation, and the `traces` suite.

One episode per line, in the shape its client wrote (`format`: "chat", the default, "anthropic" or
"responses"), with the request fields of that client's API and what a trace adds:

    {"id": "weather-1", "messages": [...], "tools": [...], "tool_choice": ..., "thinking": {...},
     "sampling": {...}, "metadata": {...}, "recorded": {"turns": [...], "outcome": {...}}}

- chat: `messages` (system / developer / user / assistant with `tool_calls` / tool), `tools`,
  `tool_choice`, DeepSeek's `thinking`. Legacy shapes are read as their modern equivalents: an
  assistant `function_call` becomes one tool call with id `call_<message index>` (a message with both
  `function_call` and `tool_calls` is an error); a `function` message becomes a tool message (keeping
  its `name`) answering the unanswered call of that name in the assistant message before it; the
  legacy `functions` list becomes `tools`; a tool message's null content becomes "".
- anthropic: Anthropic Messages `system`, `messages`, `tools`, `tool_choice`, `thinking`.
- responses: OpenAI Responses `instructions`, `input`, optional `output` items (the turns the line
  records), `tools`, `tool_choice`, `reasoning`; `response_id` (unique in the file) names the response
  the line holds, which a later line's `previous_response_id` continues: its episode is that line's
  conversation, then its own.

Each assistant turn (`harness.trace_bodies`) is served as the request body its client sent for it, the
conversation cut before it, through DeepSeek's official recipe with the model family's encoding
(`TraceTurn`, a `PromptRequest`): the prompt DeepSeek's API would serve, thinking on unless the line
turns it off. What the recipe refuses (a provider's server tools, a strict tool beside a custom one)
fails that turn with the recipe's reason; images are rendered as the recipe marks them.
`sampling` (optional): SamplingParams fields (the body's own sampling keys are not read); a turn
without a `seed` gets one derived from the run seed and its request id `<id>/turn-<k>`. With
`"structured": "tool_call"`, every turn is constrained to the DSML tool calls its `tool_choice` forces
(which needs thinking off, as DeepSeek's API forces no call while thinking).
`id` (optional, default `line-N`) must be unique in the file; `metadata` is any object, carried along;
`recorded` (what a cassette adds): the engine's outputs per turn with their stream hashes, and the
episode's outcome as replay reported it.

Each line is also read into a transcript: canonical Chat Completions shaped messages
(`harness.trace_import`), checked whole by `harness.transcript`, in which each recorded tool result is
paired with its call for free-running replay's stub.

Every error is one line that names the field; its location `file:line` is kept apart (`where`), so
that what audit rows store (kind and detail) does not depend on the file's path. A malformed line
does not stop the file: `load_traces` returns the good episodes and one error per bad line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from itertools import takewhile
from pathlib import Path
from typing import Any

from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.prompts_file import PromptRequest, json_object, read_jsonl_lines
from deepinfer.sampling_params import TOOL_CALL, SamplingParams
from deepinfer.harness.suite_base import Suite, SuiteRequest, file_hash
from deepinfer.harness.trace_bodies import FORMATS, REQUEST_FIELDS, ClientConversation
from deepinfer.harness.trace_import import TraceFormatError, chat_tool_choice, from_anthropic, from_responses
from deepinfer.harness.transcript import TranscriptError, UnsupportedContentError, canonical_arguments, check_messages, content_text

_COMMON_FIELDS = {"id", "format", "sampling", "metadata", "response_id", "recorded"}
_FORMAT_FIELDS = {
    "chat": {"messages", "functions", *REQUEST_FIELDS["chat"]},
    "anthropic": {"messages", *REQUEST_FIELDS["anthropic"]},
    "responses": {"input", "output", "previous_response_id", *REQUEST_FIELDS["responses"]},
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
    """One trace line: its conversation as its client's request bodies (`conversation`, which turns are
    served from), the same conversation read into canonical messages (`messages`, which the recorded
    tool results come from), and what the line sets besides."""

    episode_id: str
    path: str
    line: int
    conversation: ClientConversation
    messages: list[dict]
    tools: list[dict] | None = None  # as the canonical messages' tools (function tools in the Chat shape)
    sampling: dict = field(default_factory=dict)
    metadata: dict | None = None
    recording: Recording | None = None
    tool_results: tuple[ToolResult, ...] = ()
    response_id: str | None = None  # what later responses lines' previous_response_id continues
    tool_choice: str | dict | None = None  # in the Chat Completions shape (`trace_import.chat_tool_choice`)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def format(self) -> str:
        return self.conversation.format

    @property
    def turns(self) -> int:
        return self.conversation.turns

    def request(self, turn: int, body: dict | None = None) -> SuiteRequest:
        """Turn `turn` as a suite request: the body its client sent (teacher-forced), or `body`."""
        request_id = turn_request_id(self.episode_id, turn)
        body = self.conversation.before(turn) if body is None else body
        return SuiteRequest(request_id, TraceTurn(self.where, request_id, "messages", [], sampling=self.sampling,
                                                  format=self.conversation.recipe_format, client_body=body))

    def to_json(self) -> dict:
        """The line as a cassette stores it: its format, its conversation as one request body (a
        continued Responses conversation whole, its output items after its input), and the rest."""
        line: dict[str, Any] = {"id": self.episode_id}
        if self.format != "chat":
            line["format"] = self.format
        line.update(self.conversation.body)
        if self.sampling:
            line["sampling"] = self.sampling
        if self.metadata is not None:
            line["metadata"] = self.metadata
        if self.response_id is not None:
            line["response_id"] = self.response_id
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


@dataclass
class TraceTurn(PromptRequest):
    """A trace turn's request: the body its client sent (`harness.trace_bodies`), in the client's format,
    prompted and constrained through the engine's protocol like any client request."""

    client_body: dict = field(default_factory=dict)

    def body(self) -> dict:
        return self.client_body


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
    except (TraceFormatError, TranscriptError) as err:
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
    obj = _continued(obj, responses)
    messages, tools = _IMPORTERS[kind](obj)
    check_messages(messages, tools)  # the transcript's own checks name the message and field
    conversation = _conversation(kind, obj, messages, tools)
    if not conversation.turns:
        raise TraceFormatError("messages: no assistant turn to replay")
    metadata = obj.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise TraceFormatError("metadata: must be an object")
    sampling = _sampling(obj.get("sampling", {}))
    tool_choice = chat_tool_choice(obj.get("tool_choice"), kind)
    if sampling.get("structured") == TOOL_CALL and not (tools and (tool_choice == "required" or isinstance(tool_choice, dict))):
        raise TraceFormatError("sampling: structured='tool_call' needs tools and a tool_choice that forces a call "
                               "('required' or a named function)")
    recording = _recording(obj["recorded"]) if "recorded" in obj else None
    return Episode(episode_id, path, line, conversation, messages, tools, sampling, metadata, recording,
                   _tool_results(messages), _response_id(obj, "response_id"), tool_choice)


def _conversation(kind: str, obj: dict, messages: list[dict], tools: list[dict] | None) -> ClientConversation:
    """The line's conversation as its client's request bodies hold it: a chat line's messages and tools
    with the legacy shapes converted (as `messages` and `tools` have them), a responses line's input
    items then its output items, an anthropic line's messages as they are."""
    if kind == "chat":
        return ClientConversation.of(kind, {**obj, "tools": tools} if tools is not None else obj, messages)
    if kind == "responses":
        return ClientConversation.of(kind, obj, _input_items(obj) + obj.get("output", []))
    return ClientConversation.of(kind, obj, obj["messages"])


def _input_items(obj: dict) -> list:
    items = obj.get("input", [])
    return [{"role": "user", "content": items}] if isinstance(items, str) else items


def _continued(obj: dict, responses: dict[str, Episode]) -> dict:
    """The line with the conversation of the earlier line its `previous_response_id` names before its
    own (and that line's instructions). Its `instructions`, when given, must be the earlier
    conversation's (a system message cannot change mid-conversation)."""
    previous = _response_id(obj, "previous_response_id")
    if previous is None:
        return obj
    if previous not in responses:
        raise TraceFormatError(f"previous_response_id: {previous!r} is not the response_id of an earlier valid "
                               "line in this file")
    earlier = responses[previous].conversation
    if "instructions" in obj and obj["instructions"] != earlier.body.get("instructions"):
        raise TraceFormatError("instructions: differ from those of the conversation previous_response_id "
                               "continues (a system message cannot change mid-conversation)")
    if not isinstance(obj.get("input", []), (str, list)):
        raise TraceFormatError("input: must be a list of items")
    continued = {key: value for key, value in obj.items() if key != "previous_response_id"}
    continued["input"] = earlier.entries + _input_items(obj)
    if "instructions" in earlier.body:
        continued["instructions"] = earlier.body["instructions"]
    return continued


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
