"""Prompts for DeepSeek-V4-style models: the tokenizers (`tokenizer`), DeepSeek's official encodings
through `deepseek-recipe` (`official`: request bodies in, prompt ids and parsed responses out), and tool
calls in DSML markup as a structured-output constraint (`dsml`)."""

from deepinfer.recipe.tokenizer import SPECIAL_TOKENS, TextTokenizer, TokenizerError, build_tokenizer

__all__ = ["SPECIAL_TOKENS", "TextTokenizer", "TokenizerError", "build_tokenizer"]
