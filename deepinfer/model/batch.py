"""What one forward step needs besides weights: token ids, positions and the paged caches' block tables.

The step metadata has fixed capacity: every tensor's shape depends only on the step's buckets
(tokens, sequences, blocks per pool; see `bucket`) and the model config, never on the values it
holds, so a step of a given bucket can be captured as a CUDA graph and replayed with new values.
The runner builds a `StepBatch` on the host; the model turns it into cache addresses on the device,
once per step (`CacheAddresses.of`): the slot arithmetic is its numerics table's `paged_slots` (one
launch per address on CUDA), the rest plain torch ops.

Padding. Tokens past the real ones (from `query_start[-1]` on) have id 0 and position 0, and their
cache writes go to the null block. Sequence rows past the real ones have empty token ranges and
tables of null blocks. Block 0 of every pool is the null block: never handed to a sequence, it is
what freed and unallocated table entries point at and where masked writes land; a real token only
ever reads it as an invalid (masked) key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from deepinfer.transfer import upload

if TYPE_CHECKING:  # the parallel package imports the model: no import back at run time
    from deepinfer.kernels import Ops
    from deepinfer.parallel.context import ContextSplit

NULL_BLOCK = 0


def bucket(n: int) -> int:
    """The padded size of a step dimension holding n: the next power of two up to 8, then the next
    multiple of 8 (so padding costs at most 7 rows on a large step)."""
    n = max(n, 1)
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def graph_bucket(n: int) -> int:
    """The padded width of a block table in a step replayed from a CUDA graph: the next power of two,
    so a sequence growing to L blocks meets log2(L) table widths (log2(L) graphs per batch size)
    rather than one per 8 blocks. Padding costs reads of at most as many null entries as real ones."""
    return 1 << (max(n, 1) - 1).bit_length()


# The most bytes an attention call may gather for its queries at once (keys and their fp32 copies,
# index keys, scores): a step's queries attend in row chunks that fit, so memory stays bounded
# whatever the step's size and context length. Rows are independent, so chunking changes no bits.
READ_BUDGET_BYTES = 1 << 32


def gather_bytes(keys: int, head_dim: int, index_entries: int = 0, index_dim: int = 0) -> int:
    """Bytes one query's attention gathers: `keys` keys of `head_dim` (cache dtype, an fp32 copy, a
    masked one), and the index keys of `index_entries` entries of `index_dim` as fp32 with their scores."""
    return 12 * keys * head_dim + index_entries * (12 * index_dim + 16)


def query_chunks(tokens: int, row_bytes: int) -> list[slice]:
    """Row ranges of a step's `tokens` queries, each gathering at most `READ_BUDGET_BYTES` at
    `row_bytes` per query (one range when all fit: a decode step is never split)."""
    rows = max(1, READ_BUDGET_BYTES // max(row_bytes, 1))
    return [slice(start, min(start + rows, tokens)) for start in range(0, max(tokens, 1), rows)]


def close_capacity(tokens: int, seqs: int, ratio: int) -> int:
    """How many compression windows a step of `tokens` tokens over `seqs` sequences can close: a
    sequence's n consecutive tokens close at most n // ratio + 1 windows."""
    return min(tokens, tokens // ratio + seqs)


@dataclass(frozen=True)
class PoolSpec:
    """One cache pool: `kind` "window" (one row per token), "state" (a compressor's per-token
    projections) or "entries" (one row per closed window of `ratio` tokens); `layers` own a slice
    of it each. A compressor's two pools are named `{prefix}_state` and `{prefix}_entries`."""

    name: str
    kind: str
    layers: tuple[int, ...]
    width: int
    ratio: int = 1
    window: int = 0
    overlap: bool = False

    @property
    def prefix(self) -> str:
        return self.name.rsplit("_", 1)[0]

    def rows_for(self, end: int) -> int:
        """Rows that exist once tokens [0, end) are computed."""
        return end // self.ratio if self.kind == "entries" else end

    def first_kept_row(self, next_pos: int) -> int:
        """Oldest row a step starting at token `next_pos` can still read."""
        if self.kind == "window":
            return max(0, next_pos - self.window + 1)
        if self.kind == "state":
            start = (next_pos // self.ratio) * self.ratio
            return max(0, start - (self.ratio if self.overlap else 0))
        return 0

    def max_blocks_per_seq(self, max_model_len: int, max_step_tokens: int, block_size: int) -> int:
        if self.kind == "entries":
            return math.ceil(self.rows_for(max_model_len) / block_size) + 1
        back = self.window - 1 if self.kind == "window" else self.ratio * (2 if self.overlap else 1)
        return math.ceil((back + min(max_step_tokens, max_model_len)) / block_size) + 1


@dataclass
class StepBatch:
    """One engine step, flattened over its sequences: T tokens (a bucket), B sequence rows (a bucket).

    input_ids [T], positions [T]; query_start [B + 1]: row b's tokens are [query_start[b],
    query_start[b + 1]); block_tables: per pool, [B, M] physical block of each logical block (M a
    bucket of the step's longest table); sample_index [R]: the tokens whose final hidden states the
    forward returns (a bucket; None returns all T). Models with Engram (V4.1) also get
    engram_ids [T], the compressed token ids, and engram_lookback [B, n-gram order - 1], each row's
    compressed ids just before its first token (`deepinfer.families.v41.engram`); with the Engram tables in
    host memory, engram_memory holds per Engram layer the table rows its tokens read, [T, K * head_dim],
    gathered on the host.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    block_size: int
    sample_index: torch.Tensor | None = None
    engram_ids: torch.Tensor | None = None
    engram_lookback: torch.Tensor | None = None
    engram_memory: dict[int, torch.Tensor] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, by name: two batches with equal shapes share a captured graph."""
        return {name: tuple(t.shape) for name, t in self.tensors().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the batch by name (block tables as `table/{pool}`, Engram memory as
        `engram/{layer}`)."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        memory = {f"engram/{layer}": rows for layer, rows in (self.engram_memory or {}).items()}
        return {**flat, **{f"table/{pool}": table for pool, table in self.block_tables.items()}, **memory}

    def to(self, device: torch.device, extra: dict[str, torch.Tensor] | None = None
           ) -> tuple["StepBatch", dict[str, torch.Tensor]]:
        """This batch, and the `extra` host tensors, on `device` in one copy (`deepinfer.transfer`)."""
        extra = extra or {}
        moved = upload({**self.tensors(), **{f"extra/{name}": tensor for name, tensor in extra.items()}}, device)
        own = {f.name: moved.get(f.name) for f in fields(self)
               if f.name not in ("block_tables", "block_size", "engram_memory")}
        memory = None if self.engram_memory is None else {
            layer: moved[f"engram/{layer}"] for layer in self.engram_memory}
        batch = StepBatch(**own, block_tables={pool: moved[f"table/{pool}"] for pool in self.block_tables},
                          block_size=self.block_size, engram_memory=memory)
        return batch, {name: moved[f"extra/{name}"] for name in extra}


@dataclass
class CompressorAddresses:
    """Cache rows one compressor touches in one step; C = `close_capacity`.

    close_token [C]: the step's tokens that close a window, first, in token order (then tokens
    that do not, as padding); close_write [C]: each window's entry slot (the null block for the
    padding); close_position [C]: the entry's rope position (its window's first token).
    entry_read [T, E] / entry_valid [T, E]: the entries each token may attend to (or score).
    With a state pool (a compressor that pools more than one token): state_write [T], where each
    token's projections go; close_read [C, S] / close_valid [C, S], the state rows pooled into each
    window (S = 2 * ratio with overlap, else ratio).
    """

    close_token: torch.Tensor
    close_write: torch.Tensor
    close_position: torch.Tensor
    entry_read: torch.Tensor
    entry_valid: torch.Tensor
    state_write: torch.Tensor | None = None
    close_read: torch.Tensor | None = None
    close_valid: torch.Tensor | None = None


@dataclass
class CacheAddresses:
    """Physical cache rows (`block * block_size + offset`) of one step, computed on the device from a
    `StepBatch`: window_write [T]; window_read / window_valid [T, sliding_window]; per compressor
    (keyed by its pools' prefix) a `CompressorAddresses`."""

    window_write: torch.Tensor
    window_read: torch.Tensor
    window_valid: torch.Tensor
    compressors: dict[str, CompressorAddresses] = field(default_factory=dict)
    context: ContextSplit | None = None

    @classmethod
    def of(cls, batch: StepBatch, pools: list[PoolSpec], ops: Ops, context: ContextSplit | None = None
           ) -> "CacheAddresses":
        """The addresses of every pool in `pools` (a model's `pool_specs()`), by `ops.paged_slots`;
        compressors are keyed by their pools' prefix. With a `context` split
        (`deepinfer.parallel.context`), what each query reads is that of this rank's rows only; writes
        stay the whole step's."""
        rows_of = batch.query_start.shape[0] - 1
        pos = batch.positions
        paged = Paged.of(batch, ops)
        window = next(spec.window for spec in pools if spec.kind == "window")
        window_read, window_valid = paged.slots("window", paged.seq, pos, window, offset=1 - window)
        addresses = cls(window_write=paged.write("window", pos), window_read=window_read, window_valid=window_valid)
        for spec in pools:
            if spec.kind == "entries":
                addresses.compressors[spec.prefix] = _compressor_addresses(paged, spec, rows_of)
        if context is not None:
            own = context.own
            addresses.window_read, addresses.window_valid = addresses.window_read[own], addresses.window_valid[own]
            for step in addresses.compressors.values():
                step.entry_read, step.entry_valid = step.entry_read[own], step.entry_valid[own]
            addresses.context = context
        return addresses

    def everyone(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token rows [T_r, ...] of this rank's tokens as the whole step's [T, ...] (the rows every
        rank computed, gathered, under a context split; `rows` itself otherwise)."""
        return rows if self.context is None else self.context.gather(rows)


class Paged:
    """Slot arithmetic over one step's block tables, by a numerics table's `paged_slots`: `seq` [T]
    each token's sequence row, `real` [T] whether it is a real token (not padding)."""

    def __init__(self, batch: StepBatch, seq: torch.Tensor, real: torch.Tensor, ops: Ops) -> None:
        self.batch, self.seq, self.real, self.ops = batch, seq, real, ops
        self.null_slot = NULL_BLOCK * batch.block_size

    @classmethod
    def of(cls, batch: StepBatch, ops: Ops) -> "Paged":
        index = torch.arange(batch.positions.shape[0], device=batch.positions.device)
        rows_of = batch.query_start.shape[0] - 1
        seq = (torch.searchsorted(batch.query_start, index, right=True) - 1).clamp(0, rows_of - 1)
        return cls(batch, seq, index < batch.query_start[-1], ops)

    def slots(self, pool: str, seq: torch.Tensor, first: torch.Tensor | None, width: int, offset: int = 0,
              keep: torch.Tensor | None = None, limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical rows [N, width] of the logical rows `first[n] + offset + j` (j < width; `first` None
        counts as 0) of sequence rows `seq` [N], and whether each is in [0, limit[n]) (`kernels.paging`).
        Rows outside the table are clamped into it: callers mask what they read there and never write
        there; rows n where `keep` is false get the null block's first slot."""
        return self.ops.paged_slots(self.batch.block_tables[pool], self.batch.block_size, seq, first, offset, width,
                                    keep, self.null_slot, limit)

    def write(self, pool: str, rows: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Slots where each token writes logical row `rows[t]`; padding tokens (and, with `keep`, the
        tokens it masks out) write to the null block."""
        keep = self.real if keep is None else keep & self.real
        return self.slots(pool, self.seq, rows, 1, keep=keep)[0].squeeze(1)


def _compressor_addresses(paged: Paged, entries: PoolSpec, rows_of: int) -> CompressorAddresses:
    """Addresses of one compressor (its entries pool, and its state pool when it has one)."""
    state, ratio, overlap = f"{entries.prefix}_state", entries.ratio, entries.overlap
    pos = paged.batch.positions
    token, used, window = paged.ops.closing_tokens(pos, paged.real, ratio, close_capacity(pos.shape[0], rows_of, ratio))
    token_seq = paged.seq[token]
    width = paged.batch.block_tables[entries.name].shape[1] * paged.batch.block_size
    entry_read, entry_valid = paged.slots(entries.name, paged.seq, None, width, limit=(pos + 1) // ratio)
    addresses = CompressorAddresses(
        close_token=token,
        close_write=paged.slots(entries.name, token_seq, window, 1, keep=used)[0].squeeze(1),
        close_position=window * ratio,
        entry_read=entry_read,
        entry_valid=entry_valid,
    )
    if state in paged.batch.block_tables:
        close_read, in_table = paged.slots(state, token_seq, addresses.close_position,
                                           2 * ratio if overlap else ratio, offset=-ratio if overlap else 0)
        addresses.state_write = paged.write(state, pos)
        addresses.close_read, addresses.close_valid = close_read, in_table & used.unsqueeze(1)
    return addresses
