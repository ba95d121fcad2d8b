"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step, running sequences are served first in arrival order (a decode takes one token, an
unfinished prefill takes the next chunk), then waiting sequences are admitted while the budget,
`max_num_seqs` and the cache allow. When the cache cannot hold a running sequence's next tokens,
the most recently admitted sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed from its tokens (prompt plus what it has generated).

A step is `schedule() -> SchedulerOutput`, then the runner, then `update(SchedulerOutput,
StepResult)`. The scheduler owns every change to a queued `Sequence`: `schedule()` admits and
preempts (status, blocks) and commits the step (computed and scored counts, a placeholder for each
token it will sample), `update()` applies the step's results (new tokens in place of the
placeholders, logprobs, finishing, freeing blocks); the runner and the output module only read
sequences.

With async scheduling, step t + 1 is scheduled before step t's results are read: a sequence whose
token is still a placeholder decodes it anyway (the runner resolves it on the device), so a
sequence that stops at t (end token, stop string, non-finite logits) has one step of work at t + 1
that `update` discards. A sequence that will be full once its placeholders resolve (max_tokens,
context length) is not scheduled. Batch composition never changes a request's bits, so the
outputs are the same with and without it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.engine.cache import CacheManager
from deepinfer.engine.sequence import Sequence, Status, is_placeholder, placeholder


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `seq` run this step. `scored` lists the positions whose
    logits score a prompt token not scored before (position p scores token p + 1; a sequence
    recomputed after preemption does not score its prompt twice); `samples`: the chunk reaches the
    sequence's last token, so the step draws token `end`; `num_draft` is room for draft tokens after
    the sampled one (0 until speculative decoding)."""

    seq: Sequence
    start: int
    num_tokens: int
    scored: range = range(0)
    samples: bool = False
    num_draft: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def resolves_input(self) -> bool:
        """Whether the chunk's last input token is a placeholder of the step in flight."""
        return is_placeholder(self.seq.token_ids[self.end - 1])


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
    """Positions in [start, end) whose logits score a prompt token not scored by an earlier step."""
    if not seq.params.prompt_logprobs:
        return range(0)
    return range(max(start, seq.num_scored), min(end, len(seq.prompt_token_ids) - 1))


class StopRules(Protocol):
    """When a sequence is done (`deepinfer.engine.output.OutputProcessor` is one)."""

    def stop(self, seq: Sequence, length: int) -> tuple[str, str | None] | None:
        """After token `length - 1` was sampled: the finish reason (and, for a stop string, the text
        cut before it), or None to go on."""

    def full(self, seq: Sequence, length: int) -> bool:
        """Whether `seq` with `length` tokens may have no more."""


class Scheduler:
    def __init__(
        self, cache: CacheManager, rules: StopRules, *, max_num_seqs: int, max_num_batched_tokens: int,
        chunked_prefill: bool,
    ) -> None:
        self.cache = cache
        self.rules = rules
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
            if seq.status is not Status.RUNNING or budget == 0 or self.rules.full(seq, len(seq.token_ids)):
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
            if (n == 0 or self.rules.full(seq, len(seq.token_ids))
                    or not self.cache.can_grow(seq.blocks, n, reserve=len(self.running))):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.cache.grow(seq.blocks, n)
            chunks.append(self._chunk(seq, 0, n))
            budget -= n
        self._commit(chunks)
        return SchedulerOutput(chunks)

    @staticmethod
    def _chunk(seq: Sequence, start: int, n: int) -> ScheduledChunk:
        end = start + n
        return ScheduledChunk(seq, start, n, scored_positions(seq, start, end), samples=end == len(seq.token_ids))

    @staticmethod
    def _commit(chunks: list[ScheduledChunk]) -> None:
        """Count the step's work as done: its tokens computed, its positions scored, and a placeholder
        for each token it samples (its row in the step's output), so the next step can be scheduled
        before this one's results are read."""
        row = 0
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed = chunk.end
            if chunk.scored:
                seq.num_scored = chunk.scored.stop
            if chunk.samples:
                seq.token_ids.append(placeholder(row))
                row += 1

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

    def undo(self, scheduled: SchedulerOutput) -> None:
        """Take back the commit of a step that did not run (computed and scored counts, placeholders),
        so the next `schedule()` gives its sequences the same work again; admissions and blocks stay."""
        for chunk in reversed(scheduled.chunks):
            seq = chunk.seq
            seq.num_computed = chunk.start
            if chunk.scored:
                seq.num_scored = chunk.scored.start
            if chunk.samples:
                del seq.token_ids[chunk.end:]

    def update(self, scheduled: SchedulerOutput, result: StepResult) -> list[Sequence]:
        """Apply a step's results: record prompt logprobs, put the sampled tokens in place of their
        placeholders, finish sequences (stop, length, or non-finite logits) and release cache rows
        no later step can read. Rows of sequences that finished before this step are dropped.
        Returns the sequences that finished."""
        now = time.perf_counter()
        finished = []
        scoring = iter(zip(result.prompt_logprobs, result.prompt_top))
        sampled = iter(range(len(result.tokens)))
        for chunk in scheduled.chunks:
            seq = chunk.seq
            prompt = next(scoring) if chunk.scored else None
            row = next(sampled) if chunk.samples else None
            if seq.status is Status.FINISHED:
                continue
            if prompt is not None:
                seq.prompt_logprobs.extend(prompt[0])
                seq.prompt_top_logprobs.extend(prompt[1])
            if row is not None:
                self._resolve(seq, chunk.end, result, row, now)
            if seq.status is Status.FINISHED:
                (self.running if seq in self.running else self.waiting).remove(seq)
                self.cache.free(seq.blocks)
                finished.append(seq)
            elif seq.status is Status.RUNNING:
                self.cache.release_behind(seq.blocks, seq.num_computed)
        return finished

    def _resolve(self, seq: Sequence, index: int, result: StepResult, row: int, now: float) -> None:
        """Token `index` of `seq`, sampled in `row`: the real token in place of its placeholder, then
        the stop checks (a finished sequence drops the placeholders after it)."""
        if not result.finite[row]:
            del seq.token_ids[index:]
            seq.finish("error", error=f"non-finite logits at position {index - 1}", error_kind="non_finite_logits")
            return
        seq.token_ids[index] = result.tokens[row]
        seq.logprobs.append(result.logprobs[row])
        if result.top[row] is not None:
            seq.top_logprobs.append(result.top[row])
        if seq.first_token_time is None:
            seq.first_token_time = now
        stopped = self.rules.stop(seq, index + 1)
        if stopped is not None:
            del seq.token_ids[index + 1:]
            seq.finish(*stopped)
