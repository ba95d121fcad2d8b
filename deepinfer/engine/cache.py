"""Paged cache pools and per-sequence block tables.

Five kinds of rows are cached, each in its own pool of fixed-size blocks:

- `window`: every layer's sliding-window KV, one row per token; rows older than the window are freed.
- `csa_state` / `hca_state`: the compressor's per-token projections (its partial state), kept only
  until the windows they feed are closed (CSA keeps one extra window for the overlap).
- `csa_entries` / `hca_entries`: compressed rows (CSA: KV + indexer key), one per closed window,
  kept for the life of the sequence.

A block table maps a sequence's logical block i (rows [i*B, (i+1)*B) of that kind) to a physical
block; freed entries point at the null block (block 0 of every pool, never handed out: see
`deepinfer.model.batch`). All pools share the block size.

The compressed-entry pools grow with max_model_len (one row per compression window, kept for the
life of the sequence), so a model's full context can need far more memory than its weights:
`default_max_model_len` is the one rule that caps the engine's default context to what fits.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from deepinfer.config import CSA, ModelConfig
from deepinfer.errors import DeepInferError
from deepinfer.model import NULL_BLOCK, POOL_PREFIX
CACHE_MEMORY_FRACTION = 0.5  # of the memory left once the weights are loaded (see `cache_memory`)


@dataclass(frozen=True)
class PoolSpec:
    name: str
    kind: str  # "window" | "state" | "entries"
    layers: tuple[int, ...]
    width: int
    ratio: int = 1
    window: int = 0
    overlap: bool = False

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


def pool_specs(config: ModelConfig, widths: list[dict[str, int]]) -> list[PoolSpec]:
    """The pools a model needs, from its layer types and each layer's row widths."""
    specs = [PoolSpec("window", "window", tuple(range(config.num_hidden_layers)), config.head_dim,
                      window=config.sliding_window)]
    for layer_type, prefix in POOL_PREFIX.items():
        layers = tuple(i for i, t in enumerate(config.layer_types) if t == layer_type)
        if not layers:
            continue
        ratio = config.compress_rates[layer_type]
        overlap = layer_type == CSA
        for kind in ("state", "entries"):
            specs.append(PoolSpec(f"{prefix}_{kind}", kind, layers, widths[layers[0]][kind], ratio, overlap=overlap))
    return specs


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


def cache_memory(device: torch.device, weight_bytes: int) -> int:
    """Bytes the default cache may take: CACHE_MEMORY_FRACTION of the memory left once the weights are
    loaded. On CUDA that is the device's free memory plus what PyTorch's allocator holds unused (the
    weights' build leaves freed blocks cached); on CPU, physical RAM minus the weights (not the
    momentarily free RAM, so one machine resolves the same default on every run)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        left = torch.cuda.mem_get_info(device)[0] + cached
    else:
        left = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - weight_bytes
    return int(max(left, 0) * CACHE_MEMORY_FRACTION)


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
    """One sequence's block tables, one per pool."""

    tables: dict[str, list[int]] = field(default_factory=dict)

    def table(self, pool: str) -> list[int]:
        return self.tables.setdefault(pool, [])


class CacheManager:
    """Owns the pool storage and hands out blocks; the scheduler decides who gets them.

    Each pool gets room for `max_num_seqs` sequences of `max_model_len`, or, when `num_blocks` is
    given, `num_blocks` blocks raised to what one sequence of `max_model_len` needs in that pool (a
    pool that cannot hold one sequence could never finish it). Pools differ in rows per token, so one
    small `num_blocks` squeezes every pool whose one-sequence need is below it (forcing preemption)
    and leaves the others one sequence's worth. `self.num_blocks` records what each pool got, not
    counting its null block."""

    def __init__(
        self,
        config: ModelConfig,
        widths: list[dict[str, int]],
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
        self.specs = {spec.name: spec for spec in pool_specs(config, widths)}
        self.storage: dict[str, torch.Tensor] = {}
        self.free_blocks: dict[str, list[int]] = {}
        self.num_blocks: dict[str, int] = {}
        for spec in self.specs.values():
            one_seq = spec.max_blocks_per_seq(max_model_len, max_step_tokens, block_size)
            count = max(num_blocks, one_seq) if num_blocks is not None else one_seq * max_num_seqs
            self.num_blocks[spec.name] = count
            self.storage[spec.name] = torch.zeros(
                len(spec.layers), (count + 1) * block_size, spec.width, dtype=dtype, device=device
            )
            self.free_blocks[spec.name] = [b for b in range(count, -1, -1) if b != NULL_BLOCK]
        self.layer_views = self._layer_views(config)

    def _layer_views(self, config: ModelConfig) -> list[dict[str, torch.Tensor]]:
        views: list[dict[str, torch.Tensor]] = [{} for _ in range(config.num_hidden_layers)]
        for spec in self.specs.values():
            for slot, layer in enumerate(spec.layers):
                views[layer][spec.kind] = self.storage[spec.name][slot]
        return views

    def _growth(self, blocks: BlockTables, end: int) -> dict[str, int]:
        growth = {}
        for name, spec in self.specs.items():
            wanted = math.ceil(spec.rows_for(end) / self.block_size)
            growth[name] = max(0, wanted - len(blocks.table(name)))
        return growth

    def can_grow(self, blocks: BlockTables, end: int, reserve: int = 0) -> bool:
        """Whether tokens up to `end` can be given rows without evicting anyone, leaving at least
        `reserve` blocks free in every pool."""
        return all(n + reserve <= len(self.free_blocks[name]) for name, n in self._growth(blocks, end).items())

    def grow(self, blocks: BlockTables, end: int) -> None:
        for name, n in self._growth(blocks, end).items():
            free = self.free_blocks[name]
            blocks.table(name).extend(free.pop() for _ in range(n))

    def release_behind(self, blocks: BlockTables, next_pos: int) -> None:
        """Free blocks that no step starting at `next_pos` can read again."""
        for name, spec in self.specs.items():
            table = blocks.table(name)
            for i in range(min(spec.first_kept_row(next_pos) // self.block_size, len(table))):
                if table[i] != NULL_BLOCK:
                    self.free_blocks[name].append(table[i])
                    table[i] = NULL_BLOCK

    def free(self, blocks: BlockTables) -> None:
        for name, table in blocks.tables.items():
            self.free_blocks[name].extend(b for b in reversed(table) if b != NULL_BLOCK)
        blocks.tables.clear()

    def num_free(self) -> dict[str, int]:
        return {name: len(free) for name, free in self.free_blocks.items()}
