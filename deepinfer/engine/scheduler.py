"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step, running sequences are served first in arrival order (a decode takes one token, an
unfinished prefill takes the next chunk), then waiting sequences are admitted while the budget,
`max_num_seqs` and the cache allow. When the cache cannot hold a running sequence's next tokens,
the most recently admitted sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed from its tokens (prompt plus what it has generated).

A step is `schedule() -> SchedulerOutput`, then the runner, then `update(SchedulerOutput,
StepResult)`. The scheduler owns every change to a queued `Sequence`: `schedule()` admits and
preempts (status, blocks), `update()` applies a step's results (new tokens, logprobs, finishing,
computed counts, freeing blocks); the runner and the output module only read sequences.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.engine.cache import CacheManager
from deepinfer.engine.sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `seq` run this step. `scored` lists the positions whose
    logits score a prompt token not scored before (position p scores token p + 1; a sequence
    recomputed after preemption does not score its prompt twice); `num_draft` is room for draft
    tokens after the sampled one (0 until speculative decoding)."""

    seq: Sequence
    start: int
    num_tokens: int
    scored: range = range(0)
    num_draft: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token (so a new token is drawn)."""
        return self.end == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    """One step's work, in the order the runner lays it out."""

    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def sampling(self) -> list[ScheduledChunk]:
        return [chunk for chunk in self.chunks if chunk.samples]


@dataclass
class StepResult:
    """What the host reads of a runner's output (see `ModelRunner.execute`), per sampling chunk in
    order: the token, its logprob, its top logprobs (when asked for), whether its logits were
    finite; per scoring chunk the prompt logprobs and top logprobs of its `scored` positions."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]] | None]
    finite: list[bool]
    prompt_logprobs: list[list[float]]
    prompt_top: list[list[list[tuple[int, float]]]]


def scored_positions(seq: Sequence, start: int, end: int) -> range:
    """Positions in [start, end) whose logits score a prompt token that has no logprob yet."""
    if not seq.params.prompt_logprobs:
        return range(0)
    return range(max(start, len(seq.prompt_logprobs)), min(end, len(seq.prompt_token_ids) - 1))


# Decides whether a sequence that just got a token is done: the finish reason (and, for a stop
# string, the text cut before it) or None. `deepinfer.engine.output.OutputProcessor.stop` is one.
StopCheck = Callable[[Sequence], tuple[str, str | None] | None]


class Scheduler:
    def __init__(
        self, cache: CacheManager, stop: StopCheck, *, max_num_seqs: int, max_num_batched_tokens: int,
        chunked_prefill: bool,
    ) -> None:
        self.cache = cache
        self.stop = stop
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

    def schedule(self) -> SchedulerOutput:
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
            chunks.append(self._chunk(seq, seq.num_computed, n))
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
            chunks.append(self._chunk(seq, 0, n))
            budget -= n
        return SchedulerOutput(chunks)

    @staticmethod
    def _chunk(seq: Sequence, start: int, n: int) -> ScheduledChunk:
        return ScheduledChunk(seq, start, n, scored_positions(seq, start, start + n))

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

    def update(self, scheduled: SchedulerOutput, result: StepResult) -> list[Sequence]:
        """Apply a step's results: record prompt logprobs, append sampled tokens, finish sequences
        (stop, length, or non-finite logits), advance computed counts and release cache rows no
        later step can read. Returns the sequences that finished."""
        now = time.perf_counter()
        finished = []
        scoring = iter(zip(result.prompt_logprobs, result.prompt_top))
        sampled = iter(range(len(result.tokens)))
        for chunk in scheduled.chunks:
            seq = chunk.seq
            if chunk.scored:
                logprobs, top = next(scoring)
                seq.prompt_logprobs.extend(logprobs)
                seq.prompt_top_logprobs.extend(top)
            seq.num_computed = chunk.end
            if chunk.samples:
                row = next(sampled)
                if not result.finite[row]:
                    seq.finish("error", error=f"non-finite logits at position {chunk.end - 1}",
                               error_kind="non_finite_logits")
                else:
                    self._append(seq, result, row, now)
            if seq.status is Status.FINISHED:
                self.running.remove(seq)
                self.cache.free(seq.blocks)
                finished.append(seq)
            else:
                self.cache.release_behind(seq.blocks, seq.num_computed)
        return finished

    def _append(self, seq: Sequence, result: StepResult, row: int, now: float) -> None:
        seq.token_ids.append(result.tokens[row])
        seq.logprobs.append(result.logprobs[row])
        if result.top[row] is not None:
            seq.top_logprobs.append(result.top[row])
        if seq.first_token_time is None:
            seq.first_token_time = now
        stopped = self.stop(seq)
        if stopped is not None:
            seq.finish(*stopped)
