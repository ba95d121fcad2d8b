"""DeepSeek-V4.1's Engram: hashed n-gram memory added to the residual streams of a few layers.

Four pieces, in the order the engine uses them:

1. `compressed_token_map`: the tokenizer's ids folded onto a smaller vocabulary. Each id is decoded on
   its own and normalised (compatibility forms, accents, case and whitespace runs folded); ids whose
   texts fold to the same key share a compressed id. Built once per checkpoint.
2. `engram_layouts`: per Engram layer, the odd 64-bit hash multipliers and the prime sizes and
   offsets of its (order, head) sub-tables. Pure functions of the config.
3. `ngram_context` and `hash_rows` (in `kernels/ngram.py`: the numerics tables' `engram_rows` op, one
   launch on CUDA): for every token of a step, the compressed ids of the token and the ones before it
   (from the step itself or from the caller's per-row lookback), then one table row per (order,
   head). Fixed shapes and no host reads, so a sequence's rows do not depend on how its tokens were
   split into steps or on what else shares the step.
4. `Engram`: gathers those rows, projects them to one key per stream and a shared value, and adds
   the value to each stream behind a gate that compares the stream with its key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from deepinfer.families.v4.config import ConfigError
from deepinfer.families.v41.config import V41Config
from deepinfer.model.layers import Linear, empty
from deepinfer.kernels import Ops
from deepinfer.kernels.ngram import engram_rows, hash_rows, ngram_context  # noqa: F401  (the family's hashing)
from deepinfer.kernels.quant import QuantizedWeight

REPLACEMENT_CHAR = "\ufffd"
SPACE_SENTINEL = "\ue000"  # private use: stands in for a lone space so that stripping keeps it
GATE_FLOOR = 1e-6  # |dot| is clamped here before the signed square root
SEED_STRIDE = 10007  # layer l's multipliers come from numpy's default_rng(SEED_STRIDE * l)
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # Miller-Rabin bases exact below 3.3e24


def _key_normalizer() -> normalizers.Normalizer:
    """The text folding applied to each decoded token (the Rust normalizers, as the release uses)."""
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(SPACE_SENTINEL, " "),
    ])


def compressed_token_map(tokenizer: Tokenizer) -> tuple[torch.Tensor, int]:
    """Each token id's compressed id (int64 [ids]) and the number of compressed ids.

    `tokenizer` is a `tokenizers.Tokenizer` or a HuggingFace fast tokenizer (its
    `backend_tokenizer` is used); every id it knows, added tokens included, is mapped. A token
    whose lone decoding holds U+FFFD (part of a multi-byte character) is keyed by its vocabulary
    string, so distinct byte tokens stay distinct; other tokens by their folded text, or by the
    decoded text when folding leaves nothing. Compressed ids are numbered by first appearance.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    fold = _key_normalizer()
    numbers: dict[str, int] = {}
    mapping = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR in text:
            key = backend.id_to_token(token_id)
        else:
            key = fold.normalize_str(text) or text
        mapping.append(numbers.setdefault(key, len(numbers)))
    return torch.tensor(mapping, dtype=torch.long), len(numbers)


def vocabulary_map(tokenizer: Tokenizer, vocab_size: int) -> tuple[torch.Tensor, int]:
    """`compressed_token_map` over a model vocabulary of `vocab_size` ids. Ids past the tokenizer's
    (a synthetic checkpoint's tokenizer can be smaller than its vocabulary; a released one is not)
    cannot be decoded, so each gets a compressed id of its own, after the tokenizer's."""
    mapping, size = compressed_token_map(tokenizer)
    missing = vocab_size - mapping.numel()
    if missing <= 0:
        return mapping, size
    return torch.cat([mapping, torch.arange(size, size + missing, dtype=mapping.dtype)]), size + missing


def engram_token_map(config: V41Config, tokenizer: Tokenizer) -> tuple[torch.Tensor, int]:
    """`vocabulary_map` checked against the config; returns the map and the pad's compressed id."""
    mapping, size = vocabulary_map(tokenizer, config.vocab_size)
    if size != config.engram_compressed_vocab_size:
        raise ConfigError(
            f"Engram: the vocabulary folds to {size} compressed token ids with this tokenizer but "
            f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size} (the hash multipliers depend on it)"
        )
    return mapping, int(mapping[config.engram_pad_token_id])


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n below 3.3e24, so for every int64)."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_above(n: int) -> Iterator[int]:
    candidate = n + 1
    while True:
        if is_prime(candidate):
            yield candidate
        candidate += 1


def layer_multipliers(layer: int, max_ngram_size: int, compressed_vocab_size: int) -> tuple[int, ...]:
    """Layer `layer`'s odd multipliers, one per n-gram position (index k: the token k steps back).

    Drawn below (int64 max // compressed_vocab_size) / 2 so that no product overflows int64.
    """
    bound = (np.iinfo(np.int64).max // compressed_vocab_size) // 2
    draws = np.random.default_rng(SEED_STRIDE * layer).integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in draws)


@dataclass(frozen=True)
class EngramLayout:
    """One Engram layer's hashing constants.

    `primes[j]`, `offsets[j]`: size and first row of sub-table j, j = (order - 2) * n_heads + head;
    the layer's table is the concatenation of its sub-tables.
    """

    layer: int
    multipliers: tuple[int, ...]
    primes: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.offsets[-1] + self.primes[-1]

    def tensors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(multipliers, primes, offsets) as int64 tensors, the constants `hash_rows` takes."""
        return tuple(torch.tensor(v, dtype=torch.long, device=device)
                     for v in (self.multipliers, self.primes, self.offsets))


def engram_layouts(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int, compressed_vocab_size: int
) -> list[EngramLayout]:
    """The layouts of the Engram layers `layer_ids`, in order.

    Sub-table sizes are the primes from `vocab_size` up, each used once across all layers, handed
    out in (layer, order, head) order.
    """
    primes = _primes_above(vocab_size - 1)
    per_layer = (max_ngram_size - 1) * n_heads
    layouts = []
    for layer in layer_ids:
        sizes = tuple(next(primes) for _ in range(per_layer))
        offsets = tuple(int(v) for v in np.cumsum((0,) + sizes[:-1]))
        multipliers = layer_multipliers(layer, max_ngram_size, compressed_vocab_size)
        layouts.append(EngramLayout(layer, multipliers, sizes, offsets))
    return layouts


def config_layouts(config: V41Config) -> list[EngramLayout]:
    """`engram_layouts` for a config, checked against its table row counts."""
    layouts = engram_layouts(config.engram_layer_ids, config.engram_max_ngram_size, config.engram_n_heads,
                             config.engram_vocab_size, config.engram_compressed_vocab_size)
    for layout, rows in zip(layouts, config.engram_num_embeddings):
        if layout.rows > rows:
            raise ConfigError(
                f"Engram layer {layout.layer} hashes into {layout.rows} table rows but engram_num_embeddings "
                f"gives it {rows}"
            )
    return layouts


@dataclass(frozen=True)
class EngramTokens:
    """What a step needs for Engram besides the model: each token id's compressed id (int64 [vocab],
    on the host), the pad's compressed id, and how many earlier tokens an n-gram reaches back."""

    compressed: torch.Tensor
    pad: int
    lookback: int

    def step_inputs(self, input_ids: torch.Tensor, histories: list[list[int]], rows: int, width: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's compressed ids [T] (of `input_ids`, padding included) and lookback [rows, width]
        (default `lookback`): per row, the compressed ids of the tokens before its first token this step
        (`histories[b]`, the row's earlier tokens, of which the last `width` are read; pad rows and
        missing tokens get the pad). Placeholders (negative ids, tokens the device is still sampling)
        stay as they are. Every row is compressed at once: a step has up to hundreds."""
        width = width or self.lookback
        tails = [history[max(len(history) - width, 0):] for history in histories]
        tails += [[]] * (rows - len(tails))
        shape = (rows, width)
        ids = torch.tensor([lookback_ids(tail, width, 0) for tail in tails], dtype=torch.long).reshape(shape)
        lengths = torch.tensor([len(tail) for tail in tails], dtype=torch.long)
        present = torch.arange(width) >= width - lengths.unsqueeze(1)  # the last len(tail) columns
        return self.compress(input_ids), torch.where(present, self.compress(ids), self.pad)

    def compress(self, ids: torch.Tensor) -> torch.Tensor:
        """The compressed id of each token id, placeholders kept."""
        return torch.where(ids < 0, ids, self.compressed[ids.clamp(min=0)])


def lookback_ids(previous: Sequence[int], width: int, pad_id: int) -> list[int]:
    """The last `width` (>= 1) of `previous` (a sequence's ids before a step), most recent last, `pad_id`
    before them where there are fewer: a row of `ngram_context`'s lookback."""
    kept = list(previous[-width:])
    return [pad_id] * (width - len(kept)) + kept


class EngramTable(nn.Module):
    """The layer's memory table, [rows, head_dim], read by row id. Kept as stored (a `QuantizedWeight`,
    FP8 with a scale per row and 32 columns), only the rows read are decoded."""

    def __init__(self, rows: int, head_dim: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = empty(rows, head_dim, dtype=dtype, device=device)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] row ids -> [T, K * head_dim], the K rows side by side."""
        if isinstance(self.weight, QuantizedWeight):
            ids = row_ids.flatten()
            rows = replace(self.weight, data=self.weight.data[ids], scale=self.weight.scale[ids]).decode()
            return rows.view(row_ids.shape[0], -1)
        return F.embedding(row_ids, self.weight).flatten(1)


class Engram(nn.Module):
    """Adds the gated memory value to every residual stream of layer `layer`.

    From the K looked-up rows, `wkv` makes one key per stream and one value shared by the streams.
    Stream s gets gate * value, where gate = sigmoid(signed sqrt(dot)) and dot is the
    (q_weight * k_weight)-weighted dot product of the stream with its key, each RMS-normalised
    (eps = rms_norm_eps) and scaled by hidden_size^-1/2. All of it in fp32; sums over the hidden
    dimension go through `ops.ordered_sum`, so a row's bits depend only on that row (`ops.engram_mix`,
    two launches on CUDA). (With the batch-invariant ops that order differs from a library sum's, and
    near dot = 0 the signed square root magnifies the last-bit difference: a few 1e-6 in the output
    against NeMo at worst.)
    `q_weight` and `k_weight` are kept in fp32 (the release's bf16 widens exactly).
    """

    def __init__(self, config: V41Config, layer: int, ops: Ops, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.hc_mult, self.hidden = config.hc_mult, config.hidden_size
        self.eps = config.rms_norm_eps
        rows = config.engram_num_embeddings[config.engram_layer_ids.index(layer)]
        width = (config.engram_max_ngram_size - 1) * config.engram_n_heads * config.engram_head_dim
        self.embed = EngramTable(rows, config.engram_head_dim, dtype, device)
        self.wkv = Linear(width, (self.hc_mult + 1) * self.hidden, ops, dtype, device)
        self.q_weight = empty(self.hc_mult, self.hidden, dtype=torch.float32, device=device)
        self.k_weight = empty(self.hc_mult, self.hidden, dtype=torch.float32, device=device)

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, hc_mult, hidden], row_ids [T, K] -> the streams with the memory added."""
        return self.mix(streams, self.embed(row_ids))

    def mix(self, streams: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """`forward` from the table rows already read, memory [T, K * head_dim] (tables in host memory
        are read by the runner)."""
        return self.ops.engram_mix(streams, self.wkv(memory), self.q_weight, self.k_weight, self.eps, GATE_FLOOR)
