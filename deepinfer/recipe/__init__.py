"""Tokenizer and chat recipe: prompt text and ids for DeepSeek-V4-style models, and completion parsing."""

from deepinfer.recipe.chat import (
    ChatFormatError,
    ChatPrompt,
    encode_chat,
    encode_messages,
    parse_completion,
    parse_completion_ids,
    render_chat,
)
from deepinfer.recipe.tokenizer import SPECIAL_TOKENS, TextTokenizer, TokenizerError, build_tokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "ChatFormatError",
    "ChatPrompt",
    "TextTokenizer",
    "TokenizerError",
    "build_tokenizer",
    "encode_chat",
    "encode_messages",
    "parse_completion",
    "parse_completion_ids",
    "render_chat",
]
