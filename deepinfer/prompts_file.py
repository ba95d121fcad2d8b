"""JSONL request files: the input of `deepinfer generate --prompts-file` and of the harness's native suite.

One JSON object per line with exactly one of `prompt` (text), `prompt_token_ids` or `messages`
(OpenAI Chat Completions shape, plus optional `tools`, `tool_choice` and DeepSeek's `thinking`), an
optional `sampling` object of `SamplingParams` fields and an optional string `id`. Blank lines are
skipped. Every error names `file:line`. Files are read a line at a time with bounds (`MAX_LINE_BYTES` a
line, `MAX_FILE_BYTES` a file, `MAX_JSON_NESTING` levels of JSON), so an endless input (/dev/zero) or a
hostile line is refused in one line, promptly, and SIGTERM is honoured while reading.

A messages line is a Chat Completions body (`body()`), prompted as DeepSeek's API would prompt it: the
official recipe with the model family's encoding (`recipe.official.Protocol`; thinking on unless
`"thinking": {"type": "disabled"}`, as the API does). Its sampling is the line's `sampling` object over
the caller's defaults (the body's own sampling keys are not read: a request file says them once, in
`sampling`). With `"structured": "tool_call"` in it, the turn is constrained to DSML tool calls of its
`tools` as its `tool_choice` forces them (`recipe.dsml`), made once the engine's protocol is known
(`params(base, llm)`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deepinfer.errors import DeepInferError
from deepinfer.recipe.official import chat_body
from deepinfer.sampling_params import MAX_JSON_NESTING, TOOL_CALL, SamplingParams, json_nesting

if TYPE_CHECKING:
    from deepinfer.engine.llm import LLM
    from deepinfer.outputs import RequestOutput
    from deepinfer.recipe.official import ClientRequest

MAX_LINE_BYTES = 64 << 20  # a request line (a 1M-token prompt is ~4 MB of text)
MAX_FILE_BYTES = 1 << 30
SOURCES = ("prompt", "prompt_token_ids", "messages")
CHAT_FIELDS = ("tools", "tool_choice", "thinking")  # what a messages line's body holds besides its messages
FIELDS = {*SOURCES, *CHAT_FIELDS, "sampling", "id"}


@dataclass
class PromptRequest:
    """One line of a request file; `where` is `file:line` for error messages."""

    where: str
    request_id: str
    source: str
    value: str | list
    tools: list | None = None
    sampling: dict = field(default_factory=dict)
    tool_choice: str | dict | None = None
    thinking: dict | None = None
    format: str = "chat"  # the body's request format (recipe.official.FORMATS)
    _converted: tuple | None = field(default=None, repr=False, compare=False)  # (protocol, its ClientRequest)

    def body(self) -> dict:
        """A messages line's request body (a request file's: Chat Completions)."""
        body = chat_body(self.value, self.tools, self.tool_choice)
        return body if self.thinking is None else {**body, "thinking": self.thinking}

    def client_request(self, llm: LLM) -> ClientRequest:
        """A messages line's body as `llm`'s protocol converts and encodes it (once per protocol: its
        params, prompt and answer all read it)."""
        protocol = llm.host.protocol()
        if self._converted is None or self._converted[0] is not protocol:
            self._converted = (protocol, protocol.request(self.body(), self.format))
        return self._converted[1]

    def params(self, base: dict | None = None, llm: LLM | None = None) -> SamplingParams:
        """`base` defaults overridden by this line's `sampling` object; `structured="tool_call"` is made
        into the DSML constraint of this request's tools when `llm` is given (without it, it is only
        checked: the constraint depends on the engine's encoding and tokenizer)."""
        unknown = set(self.sampling) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise DeepInferError(f"{self.where}: unknown sampling field(s) {sorted(unknown)}")
        try:
            settings = {**(base or {}), **self.sampling}
            if settings.get("structured") == TOOL_CALL:
                if self.source != "messages":
                    raise DeepInferError("structured='tool_call' needs a 'messages' request with tools")
                if llm is not None:
                    settings["structured"] = llm.host.protocol().constraint(self.client_request(llm),
                                                                            tool_calls_only=True)
            return SamplingParams(**settings)
        except DeepInferError as err:
            raise DeepInferError(f"{self.where}: {err}", kind=err.kind) from None

    def message(self, llm: LLM, output: RequestOutput) -> dict:
        """The assistant message a messages line's output answers with, parsed by the recipe."""
        return llm.host.protocol().message(self.client_request(llm), f"chatcmpl-{output.request_id}",
                                           output.token_ids, output.finish_reason)

    def respond(self, llm: LLM, response_id: str, output: RequestOutput) -> dict:
        """The response object, in the body's format, that `output` answers with, parsed by the recipe."""
        return llm.host.protocol().respond(self.client_request(llm), response_id, output.token_ids,
                                           output.finish_reason)

    def prompt_ids(self, llm: LLM) -> list[int]:
        """The prompt as token ids, checked against the engine's limits."""
        try:
            if self.source == "messages":
                return llm.encode(self.client_request(llm).prompt_ids)
            return llm.encode(self.value)
        except DeepInferError as err:
            raise err.at(self.where) from None


def read_prompts_file(path: str) -> list[PromptRequest]:
    """Parse and validate every line; ids default to `line-N` and must be unique."""
    requests: list[PromptRequest] = []
    seen: dict[str, str] = {}
    for number, line in read_jsonl_lines(path):
        if line.strip():
            request = parse_request_line(line, f"{path}:{number}", f"line-{number}")
            if request.request_id in seen:
                raise DeepInferError(f"{request.where}: duplicate id {request.request_id!r} "
                                     f"(first at {seen[request.request_id]})")
            seen[request.request_id] = request.where
            requests.append(request)
    if not requests:
        raise DeepInferError(f"{path}: no requests")
    return requests


def read_jsonl_lines(path: str | Path) -> list[tuple[int, str]]:
    """The numbered lines (from 1, without their line ends) of a UTF-8 text file, split at newlines
    only (JSON text may hold U+2028 and other Unicode line separators); one-line errors for an
    unreadable file, a line over MAX_LINE_BYTES or a file over MAX_FILE_BYTES."""
    lines: list[tuple[int, str]] = []
    total = 0
    try:
        with open(path, "rb") as file:
            while raw := file.readline(MAX_LINE_BYTES + 1):
                number = len(lines) + 1
                if len(raw) > MAX_LINE_BYTES:
                    raise DeepInferError(f"{path}:{number}: longer than {MAX_LINE_BYTES >> 20} MiB (a request line "
                                         "is at most that)")
                total += len(raw)
                if total > MAX_FILE_BYTES:
                    raise DeepInferError(f"{path}: larger than {MAX_FILE_BYTES >> 30} GiB (split it into several files)")
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DeepInferError(f"{path}:{number}: not UTF-8 text") from None
                lines.append((number, text.removesuffix("\n").removesuffix("\r")))
    except OSError as err:
        raise DeepInferError(f"{path}: cannot read ({err.strerror or err})") from None
    return lines


def json_object(line: str, where: str) -> dict:
    """One JSONL line that must hold a JSON object; errors name `where` (file:line)."""
    try:
        value = json.loads(line)
        too_deep = json_nesting(value) > MAX_JSON_NESTING
    except json.JSONDecodeError as err:
        raise DeepInferError(f"invalid JSON ({err.msg} at column {err.colno})", where=where, kind="malformed") from None
    except RecursionError:  # deeper than Python's parser goes, so deeper than MAX_JSON_NESTING too
        too_deep = True
    if too_deep:
        raise DeepInferError(f"JSON nested more than {MAX_JSON_NESTING} levels deep", where=where, kind="malformed")
    if not isinstance(value, dict):
        raise DeepInferError(f"expected a JSON object, got {type(value).__name__}", where=where, kind="malformed")
    return value


def parse_request_line(line: str, where: str, default_id: str) -> PromptRequest:
    request = json_object(line, where)
    unknown = set(request) - FIELDS
    if unknown:
        raise DeepInferError(f"{where}: unknown field(s) {sorted(unknown)}")
    sources = [key for key in SOURCES if key in request]
    if len(sources) != 1:
        raise DeepInferError(f"{where}: needs exactly one of 'prompt', 'prompt_token_ids', 'messages'")
    source = sources[0]
    value = request[source]
    if source == "prompt" and not isinstance(value, str):
        raise DeepInferError(f"{where}: 'prompt' must be a string (use 'prompt_token_ids' for token ids)")
    if source == "prompt_token_ids" and not isinstance(value, list):
        raise DeepInferError(f"{where}: 'prompt_token_ids' must be a list of token ids")
    if source == "messages" and not isinstance(value, list):
        raise DeepInferError(f"{where}: 'messages' must be a list of message objects")
    for key in CHAT_FIELDS:
        if key in request and source != "messages":
            raise DeepInferError(f"{where}: '{key}' only goes with 'messages'")
    if not isinstance(request.get("sampling", {}), dict):
        raise DeepInferError(f"{where}: 'sampling' must be an object")
    request_id = request.get("id", default_id)
    if not isinstance(request_id, str) or not request_id:
        raise DeepInferError(f"{where}: 'id' must be a non-empty string")
    return PromptRequest(where, request_id, source, value, request.get("tools"), request.get("sampling", {}),
                         request.get("tool_choice"), request.get("thinking"))
