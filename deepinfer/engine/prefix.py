"""Prefix caching: the cache rows one sequence computed, taken by later sequences with the same start.

Every cache row is keyed by its absolute position, and with batch-invariant numerics its bits depend
only on the tokens up to it (never on how steps were chunked or batched). So a sequence whose first P
tokens equal another's may take that sequence's rows for them and start computing at P: its outputs
are the same bits as if it had computed them itself. (Under `fast` numerics rows change bits with the
batch, as the outputs already do; reusing them is allowed there and promises nothing more.)

Prefixes are cut at block boundaries: key i is a hash chain over token blocks 0..i (`block_size`
tokens each), so equal keys mean equal tokens [0, (i + 1) * block_size). The entry for boundary P
holds what a step starting at token P reads (`PoolSpec.first_kept_row` to `rows_for(P)`): per window
and state pool the blocks of rows [first_kept_row(P), P), which it pins; per entries pool (compressed
rows, kept for a sequence's life) rows [0, P // ratio), where it pins only the blocks past its
parent's (the entry at P - block_size, kept alive while a child needs its blocks). A sequence that
takes an entry shares all those blocks; the last entries block, when P // ratio does not fill it, is
one it will write into, so it gets its own copy (`CacheManager.grow`).

Memory: entries pin blocks their sequences would otherwise have freed (window and state rows behind
the window, everything of finished sequences), so the cache may come to hold every block of every
pool. The scheduler evicts least recently used entries whenever an allocation would otherwise fail,
before it preempts anyone or refuses an admission, so prefix caching holds only memory nothing else
asks for.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.engine.cache import CacheManager
from deepinfer.engine.sequence import Sequence, is_placeholder
from deepinfer.model import NULL_BLOCK


@dataclass(eq=False)
class PrefixEntry:
    """The rows of one cached prefix of `length` tokens. `pins[pool]` / `kept[pool]`: (first logical
    block, physical blocks from there); `kept` (entries pools) continues `parent`'s blocks, which hold
    the logical blocks before its first. `holders`: 1 while the cache lists it, plus its children."""

    length: int
    pins: dict[str, tuple[int, list[int]]]
    kept: dict[str, tuple[int, list[int]]]
    parent: PrefixEntry | None
    holders: int = 1


class PrefixCache:
    """Cached prefixes by key, least recently used first; the scheduler decides when to look up, offer
    and evict, this class keeps the entries and their holds on `cache`'s blocks."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()

    def keys(self, seq: Sequence, tokens: int) -> list[bytes]:
        """The keys of `seq`'s whole blocks among its first `tokens` tokens, up to its first placeholder
        (memoised in `seq.prefix_keys`: tokens before a placeholder never change)."""
        keys, size = seq.prefix_keys, self.block_size
        count = tokens // size
        while len(keys) < count:
            block = seq.token_ids[len(keys) * size:(len(keys) + 1) * size]
            if any(is_placeholder(token) for token in block):
                break
            keys.append(hashlib.blake2b((keys[-1] if keys else b"") + array("q", block).tobytes(),
                                        digest_size=16).digest())
        return keys[:count]

    def lookup(self, seq: Sequence, limit: int) -> PrefixEntry | None:
        """The entry of the longest cached prefix of `seq`'s first `limit` tokens, marked as used."""
        keys = self.keys(seq, limit)
        for key in reversed(keys):
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        return None

    def computing(self, seq: Sequence, start: int, limit: int, running: list[Sequence]) -> bool:
        """Whether a running sequence will offer the block of `seq`'s tokens from `start` (its cached
        prefix; the block within its first `limit` tokens), not having offered it yet: waiting for it
        saves computing that block twice."""
        keys, index = self.keys(seq, limit), start // self.block_size
        if index >= len(keys):
            return False
        end = (index + 1) * self.block_size
        return any(other.num_cached < end and self.keys(other, end)[index:] == [keys[index]] for other in running)

    def tables(self, entry: PrefixEntry) -> tuple[dict[str, list[int]], set[str]]:
        """The block tables of a sequence that takes `entry` (null blocks before what a step at its
        length reads), and the pools whose last block that sequence must copy before writing into it."""
        tables = {name: [NULL_BLOCK] * first + blocks for name, (first, blocks) in entry.pins.items()}
        copies = set()
        for name in entry.kept:
            tables[name] = self._entries_table(entry, name)
            if self.cache.specs[name].rows_for(entry.length) % self.block_size:
                copies.add(name)
        return tables, copies

    @staticmethod
    def _entries_table(entry: PrefixEntry, pool: str) -> list[int]:
        parts, node, stop = [], entry, None
        while True:
            first, blocks = node.kept[pool]
            parts.append(blocks if stop is None else blocks[:stop - first])
            if first == 0:
                return [block for part in reversed(parts) for block in part]
            node, stop = node.parent, first

    def offer(self, seq: Sequence, end: int) -> int:
        """Cache `seq`'s rows at each block boundary after `seq.num_cached` up to `end` tokens (rows that
        are computed, or written by a step already queued, and final); returns the boundary reached."""
        keys, size = self.keys(seq, end), self.block_size
        for index in range(seq.num_cached // size, len(keys)):
            key = keys[index]
            if key in self.entries:
                self.entries.move_to_end(key)
            else:
                parent = self.entries.get(keys[index - 1]) if index else None
                self.entries[key] = self._entry(seq, (index + 1) * size, parent)
        return len(keys) * size

    def _entry(self, seq: Sequence, length: int, parent: PrefixEntry | None) -> PrefixEntry:
        """An entry for `seq`'s first `length` tokens, holding the blocks of its tables that a step at
        `length` reads (entries pools: only those after `parent`'s last whole block)."""
        size, pins, kept = self.block_size, {}, {}
        for name, spec in self.cache.specs.items():
            end = -(-spec.rows_for(length) // size)
            if spec.kind == "entries":
                first = spec.rows_for(length - size) // size if parent is not None else 0
            else:
                first = spec.first_kept_row(length) // size
            blocks = seq.blocks.table(name)[first:end]
            if len(blocks) != end - first or NULL_BLOCK in blocks:
                raise RuntimeError(f"prefix cache: {name} rows of the first {length} tokens were freed before "
                                   "they were offered")
            self.cache.hold(name, blocks)
            (kept if spec.kind == "entries" else pins)[name] = (first, blocks)
        if not any(first for first, _ in kept.values()):
            parent = None
        elif parent is not None:
            parent.holders += 1
        return PrefixEntry(length, pins, kept, parent)

    def evict(self) -> bool:
        """Drop the least recently used entry (its blocks are freed once nothing else holds them);
        False when there is none."""
        if not self.entries:
            return False
        entry = self.entries.popitem(last=False)[1]
        for name, (_, blocks) in entry.pins.items():
            self.cache.drop(name, blocks)
        entry.pins = {}
        node = entry
        node.holders -= 1
        while node is not None and node.holders == 0:
            for name, (_, blocks) in node.kept.items():
                self.cache.drop(name, blocks)
            node = node.parent
            if node is not None:
                node.holders -= 1
        return True

    def clear(self) -> None:
        """Evict every entry."""
        while self.evict():
            pass
