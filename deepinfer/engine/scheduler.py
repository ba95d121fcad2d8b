"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step, running sequences are served first in arrival order (a decode takes one token, an
unfinished prefill takes the next chunk), then waiting sequences are admitted while the budget,
`max_num_seqs` and the cache allow. When the cache cannot hold a running sequence's next tokens,
the most recently admitted sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed from its tokens (prompt plus what it has generated).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer.engine.cache import CacheManager
from deepinfer.engine.sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token (so a new token is drawn)."""
        return self.end == len(self.seq.token_ids)


class Scheduler:
    def __init__(
        self, cache: CacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = self._chunk_len(seq, budget)
            if n == 0:
                continue
            while not self.cache.can_grow(seq.blocks, seq.num_computed + n):
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.cache.grow(seq.blocks, seq.num_computed + n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk_len(seq, budget)
            # Leave a block per pool for each running sequence, so admitting a newcomer does not
            # force a preemption (and a re-admission, and another preemption) on the next step.
            if n == 0 or not self.cache.can_grow(seq.blocks, n, reserve=len(self.running)):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.cache.grow(seq.blocks, n)
            chunks.append(ScheduledChunk(seq, 0, n))
            budget -= n
        return chunks

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed
        if remaining <= budget:
            return remaining
        # A preempted sequence is recomputed in chunks even with chunked prefill off: its prompt
        # plus output can outgrow the budget, and it could otherwise never be scheduled again.
        return budget if self.chunked_prefill or seq.num_preemptions else 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.blocks)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance computed counts, release rows no later step can read, drop finished sequences."""
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed = chunk.end
            if seq.status is Status.FINISHED:
                self.running.remove(seq)
                self.cache.free(seq.blocks)
            else:
                self.cache.release_behind(seq.blocks, seq.num_computed)
