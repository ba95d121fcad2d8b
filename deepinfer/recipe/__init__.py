"""Tokenizer and chat recipe: prompt text and ids for DeepSeek-V4-style models, and completion parsing."""

from deepinfer.recipe.chat import (
    ChatFormatError,
    encode_chat,
    encode_messages,
    parse_completion,
    parse_completion_ids,
)
from deepinfer.recipe.tokenizer import SPECIAL_TOKENS, TextTokenizer, TokenizerError, build_tokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "ChatFormatError",
    "TextTokenizer",
    "TokenizerError",
    "build_tokenizer",
    "encode_chat",
    "encode_messages",
    "parse_completion",
    "parse_completion_ids",
]
