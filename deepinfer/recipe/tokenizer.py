"""Byte-level BPE tokenizer with DeepSeek-style special tokens.

`build_tokenizer` trains a small tokenizer on the bundled `corpus.txt`, so test models and synthetic
checkpoints get a real tokenizer without downloading one. `TextTokenizer` wraps any `tokenizer.json`
(ours or a real DeepSeek one) behind the few calls the engine needs.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.errors import DeepInferError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
PAD = "<｜▁pad▁｜>"

# The position in this list is the token id: model configs rely on bos_token_id=0, eos_token_id=1.
SPECIAL_TOKENS: list[str] = [
    BOS,
    EOS,
    USER,
    ASSISTANT,
    THINK_BEGIN,
    THINK_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    PAD,
]

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
_BYTE_ALPHABET = pre_tokenizers.ByteLevel.alphabet()
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(_BYTE_ALPHABET)


class TokenizerError(DeepInferError, ValueError):
    """A tokenizer that cannot be loaded or built."""


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on `corpus.txt` with `SPECIAL_TOKENS` at ids 0..15.

    The result has min(vocab_size, what the corpus supports) tokens; the full byte alphabet is always
    included, so every string is encodable. Training is deterministic (merge ties are broken by token
    id, and the byte alphabet is inserted in sorted order), which the tests check across processes
    and thread counts.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size {vocab_size} is below the {MIN_VOCAB_SIZE} ids needed for "
            f"{len(SPECIAL_TOKENS)} special tokens and the 256-byte alphabet"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=_BYTE_ALPHABET,
        show_progress=False,
    )
    # One item holding the whole corpus: newline and indentation runs stay inside the training text.
    tok.train_from_iterator([CORPUS_PATH.read_text(encoding="utf-8")], trainer)
    return tok


class TextTokenizer:
    """Text <-> token ids. Never adds specials implicitly: BOS only when asked for."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextTokenizer:
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json; pass token-id prompts or add a tokenizer")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # the Rust side raises a bare Exception with a multi-line message
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{path}: cannot load: {first_line}") from None

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self._tok.to_str(), encoding="utf-8")
        return path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self.special_id(BOS)

    @property
    def eos_id(self) -> int:
        return self.special_id(EOS)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes one token covers (its vocabulary string's length in bytes,
        which for byte-level tokens is at least the bytes it stands for): a text of n bytes has at
        least n // max_token_bytes tokens."""
        return max(len(token.encode("utf-8")) for token in self._tok.get_vocab(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (V4.1's Engram builds its token map from it)."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def encode_literal(self, text: str) -> list[int]:
        """Token ids of `text` read as characters only: a special token's spelling in it is encoded as
        text, never as that token (client text, see `recipe.chat.ChatPrompt`)."""
        return self._literal.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _literal(self) -> Tokenizer:
        literal = Tokenizer.from_str(self._tok.to_str())
        literal.encode_special_tokens = True
        return literal

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids the tokenizer does not have are skipped: a model's vocab may be larger than ours."""
        known = [i for i in ids if i >= 0 and self._tok.id_to_token(i) is not None]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def special_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"tokenizer has no {token!r} token")
        return token_id
