"""Paged cache pools and per-sequence block tables.

Three kinds of rows are cached, each kind in pools of fixed-size blocks; which pools exist is the
model's call (`pool_specs()`, see `deepinfer.model.batch.PoolSpec`):

- `window`: every layer's sliding-window KV, one row per token; rows older than the window are freed.
- `state`: a compressor's per-token projections (its partial state), kept only until the windows
  they feed are closed (an overlapping compressor keeps one extra window).
- `entries`: compressed rows (KV, and the indexer's key where there is one), one per closed
  window, kept for the life of the sequence.

V4 has `window`, `csa_state`/`csa_entries` and `hca_state`/`hca_entries` (one row per CSA or HCA
layer); V4.1 has `window` and, per KV-source layer s, `src{s}_entries` and (ratio 2) `src{s}_state`.

A block table maps a sequence's logical block i (rows [i*B, (i+1)*B) of that kind) to a physical
block; freed entries point at the null block (block 0 of every pool, never handed out: see
`deepinfer.model.batch`). All pools share the block size.

The compressed-entry pools grow with max_model_len (one row per compression window, kept for the
life of the sequence), so a model's full context can need far more memory than its weights:
`default_max_model_len` is the one rule that caps the engine's default context to what fits.

Blocks are reference-counted: a block may sit in several sequences' tables and be pinned by prefix
cache entries (`deepinfer.engine.prefix`); it returns to its pool's free list when the last holder
drops it. A sequence never writes into a block it shares: the one shared block it would write into
(the last, partly filled block of a cached prefix's compressed rows) is copied first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy
import torch

from deepinfer.errors import DeepInferError
from deepinfer.model import NULL_BLOCK, PoolSpec
CACHE_MEMORY_FRACTION = 0.5  # of the memory left once the weights are loaded (see `cache_memory`)


def step_budget(max_num_batched_tokens: int, max_model_len: int, chunked_prefill: bool) -> int:
    """Tokens one engine step may process. Without chunked prefill a prompt cannot be split, so the
    budget grows to max_model_len: every prompt the engine accepts fits one step."""
    return max_num_batched_tokens if chunked_prefill else max(max_num_batched_tokens, max_model_len)


def cache_bytes(specs: list[PoolSpec], *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                chunked_prefill: bool, block_size: int, itemsize: int) -> int:
    """Bytes of the default cache: every pool sized for `max_num_seqs` sequences of `max_model_len`."""
    step = step_budget(max_num_batched_tokens, max_model_len, chunked_prefill)
    rows = sum((spec.max_blocks_per_seq(max_model_len, step, block_size) * max_num_seqs + 1) * block_size
               * len(spec.layers) * spec.width for spec in specs)  # + 1: the null block
    return rows * itemsize


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape), whose memory on CPU is only committed as it is first written: numpy's
    calloc takes a large block as fresh anonymous pages, which the kernel hands out zeroed when first
    touched, so a default cache sized for max_position_embeddings costs RAM as sequences fill it
    (torch.zeros writes every byte at once)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(numpy.zeros(nbytes, dtype=numpy.uint8)).view(dtype).view(shape)


def cache_memory(device: torch.device, weight_bytes: int) -> int:
    """Bytes the default cache may take: CACHE_MEMORY_FRACTION of the memory left once the weights are
    loaded. On CUDA that is the device's free memory plus what PyTorch's allocator holds unused (the
    weights' build leaves freed blocks cached); on CPU, physical RAM minus the weights (not the
    momentarily free RAM, so one machine resolves the same default on every run)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        left = torch.cuda.mem_get_info(device)[0] + cached
    else:
        left = physical_memory() - weight_bytes
    return int(max(left, 0) * CACHE_MEMORY_FRACTION)


def physical_memory() -> int:
    """This machine's RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_max_model_len(specs: list[PoolSpec], max_position_embeddings: int, memory: int, *, max_num_seqs: int,
                          max_num_batched_tokens: int, chunked_prefill: bool, block_size: int,
                          itemsize: int) -> int:
    """The engine's max_model_len when none is given: the model's max_position_embeddings if its
    default cache (see `cache_bytes`) fits in `memory` bytes, else the largest multiple of block_size
    whose default cache does."""
    def fits(max_model_len: int) -> bool:
        return cache_bytes(specs, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=chunked_prefill,
                           block_size=block_size, itemsize=itemsize) <= memory

    if fits(max_position_embeddings):
        return max_position_embeddings
    # blocks: low's fit (0 trivially), high's do not (past max_position_embeddings, which does not fit)
    low, high = 0, max_position_embeddings // block_size + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * block_size) else (low, mid)
    if low == 0:
        raise DeepInferError(
            f"the cache for max_num_seqs={max_num_seqs} sequences of even {block_size} tokens does not fit in "
            f"the {memory} bytes set aside for it ({CACHE_MEMORY_FRACTION:g} of the memory left after the "
            "weights): lower max_num_seqs or pass max_model_len"
        )
    return low * block_size


@dataclass
class BlockTables:
    """One sequence's block tables, one per pool; `released[pool]`: how many leading entries have been
    handed back (set to the null block), so a step looks only at what became releasable since;
    `copy_on_write`: pools whose last block the sequence shares but will write rows into, so its next
    `CacheManager.grow` gives it a copy of its own first."""

    tables: dict[str, list[int]] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)
    copy_on_write: set[str] = field(default_factory=set)

    def table(self, pool: str) -> list[int]:
        return self.tables.setdefault(pool, [])


class CacheManager:
    """Owns the pool storage and hands out blocks; the scheduler decides who gets them.

    Each pool gets room for `max_num_seqs` sequences of `max_model_len`, or, when `num_blocks` is
    given, `num_blocks` blocks raised to what one sequence of `max_model_len` needs in that pool (a
    pool that cannot hold one sequence could never finish it). Pools differ in rows per token, so one
    small `num_blocks` squeezes every pool whose one-sequence need is below it (forcing preemption)
    and leaves the others one sequence's worth. `self.num_blocks` records what each pool got, not
    counting its null block; `self.refs[pool][block]` how many tables and prefix entries hold it."""

    def __init__(
        self,
        specs: list[PoolSpec],
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_step_tokens: int,
        num_blocks: int | None,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.specs = {spec.name: spec for spec in specs}
        self.storage: dict[str, torch.Tensor] = {}
        self.free_blocks: dict[str, list[int]] = {}
        self.refs: dict[str, list[int]] = {}
        self.num_blocks: dict[str, int] = {}
        for spec in self.specs.values():
            one_seq = spec.max_blocks_per_seq(max_model_len, max_step_tokens, block_size)
            count = max(num_blocks, one_seq) if num_blocks is not None else one_seq * max_num_seqs
            self.num_blocks[spec.name] = count
            self.storage[spec.name] = zeroed((len(spec.layers), (count + 1) * block_size, spec.width), dtype, device)
            self.free_blocks[spec.name] = [b for b in range(count, -1, -1) if b != NULL_BLOCK]
            self.refs[spec.name] = [0] * (count + 1)
        self.layer_views = self._layer_views()

    def _layer_views(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, its rows of each pool it owns, by pool kind."""
        views: list[dict[str, torch.Tensor]] = [{} for _ in range(1 + max(max(s.layers) for s in self.specs.values()))]
        for spec in self.specs.values():
            for slot, layer in enumerate(spec.layers):
                views[layer][spec.kind] = self.storage[spec.name][slot]
        return views

    def _growth(self, blocks: BlockTables, end: int) -> dict[str, int]:
        """New blocks per pool that tokens up to `end` need, copies of shared blocks included."""
        growth = {}
        for name, spec in self.specs.items():
            wanted = math.ceil(spec.rows_for(end) / self.block_size)
            growth[name] = max(0, wanted - len(blocks.table(name))) + (name in blocks.copy_on_write)
        return growth

    def can_grow(self, blocks: BlockTables, end: int, reserve: int = 0) -> bool:
        """Whether tokens up to `end` can be given rows without evicting anyone, leaving at least
        `reserve` blocks free in every pool."""
        return all(n + reserve <= len(self.free_blocks[name]) for name, n in self._growth(blocks, end).items())

    def grow(self, blocks: BlockTables, end: int) -> None:
        """Give tokens up to `end` rows, after replacing each shared block the sequence will write into
        (`copy_on_write`) with a copy of its own."""
        for name in blocks.copy_on_write:
            table = blocks.table(name)
            shared, table[-1] = table[-1], self.copy_block(name, table[-1])
            self.drop(name, [shared])
        blocks.copy_on_write.clear()
        for name, n in self._growth(blocks, end).items():
            blocks.table(name).extend(self._take(name) for _ in range(n))

    def _take(self, pool: str) -> int:
        block = self.free_blocks[pool].pop()
        self.refs[pool][block] = 1
        return block

    def hold(self, pool: str, blocks: list[int]) -> None:
        """One more holder (a table or a prefix entry) for each of `blocks` (null blocks are skipped)."""
        refs = self.refs[pool]
        for block in blocks:
            if block != NULL_BLOCK:
                refs[block] += 1

    def drop(self, pool: str, blocks: Iterable[int]) -> None:
        """One holder fewer for each of `blocks`; a block nothing holds any more is free again."""
        refs, free = self.refs[pool], self.free_blocks[pool]
        for block in blocks:
            if block != NULL_BLOCK:
                refs[block] -= 1
                if refs[block] == 0:
                    free.append(block)

    def copy_block(self, pool: str, block: int) -> int:
        """A new block (one holder) holding a copy of `block`'s rows, copied on the pool's device in
        stream order, so after every queued step's writes to `block` and before any later step's."""
        new, size, rows = self._take(pool), self.block_size, self.storage[pool]
        rows[:, new * size:(new + 1) * size] = rows[:, block * size:(block + 1) * size]
        return new

    def adopt(self, blocks: BlockTables, tables: dict[str, list[int]], copy_on_write: set[str]) -> None:
        """Give a sequence without blocks `tables` it shares with their other holders (a cached
        prefix): leading null entries count as released, and the last block of each pool in
        `copy_on_write` is copied at its next `grow`, before it writes there."""
        for name, table in tables.items():
            self.hold(name, table)
            blocks.tables[name] = list(table)
            blocks.released[name] = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
        blocks.copy_on_write = set(copy_on_write)

    def release_behind(self, blocks: BlockTables, next_pos: int) -> None:
        """Drop the blocks that no step starting at `next_pos` can read again."""
        for name, spec in self.specs.items():
            table, start = blocks.table(name), blocks.released.get(name, 0)
            stop = min(spec.first_kept_row(next_pos) // self.block_size, len(table))
            self.drop(name, table[start:stop])
            table[start:stop] = [NULL_BLOCK] * max(0, stop - start)
            blocks.released[name] = max(start, stop)

    def free(self, blocks: BlockTables) -> None:
        for name, table in blocks.tables.items():
            self.drop(name, reversed(table))
        blocks.tables.clear()
        blocks.released.clear()
        blocks.copy_on_write.clear()

    def num_free(self) -> dict[str, int]:
        return {name: len(free) for name, free in self.free_blocks.items()}
