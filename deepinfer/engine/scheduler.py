"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step, running sequences are served first in arrival order (a decode takes one token, an
unfinished prefill takes the next chunk), then waiting sequences are admitted while the budget,
`max_num_seqs` and the cache allow. When the cache cannot hold a running sequence's next tokens,
the most recently admitted sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed from its tokens (prompt plus what it has generated).

With a prefix cache (`deepinfer.engine.prefix`), `update` caches each sequence's computed whole
blocks, and admission starts a sequence (a preempted one too) at its longest cached prefix. A
waiting sequence whose next block a running sequence is computing waits for it (later ones may be
admitted meanwhile), so requests that arrive together compute a shared prefix once. When blocks run
short, least recently used prefix entries are evicted before anyone is preempted.

A step is `schedule() -> SchedulerOutput`, then the runner, then `update(SchedulerOutput,
StepResult)`. The scheduler owns every change to a queued `Sequence`: `schedule()` admits and
preempts (status, blocks) and commits the step (computed and scored counts, a placeholder for each
token it will sample), `update()` applies the step's results (new tokens in place of the
placeholders, logprobs, finishing, freeing blocks); the runner and the output module only read
sequences.

With async scheduling, step t + 1 is scheduled before step t's results are read: a sequence whose
token is still a placeholder decodes it anyway (the runner resolves it on the device), so a
sequence that stops at t (end token, stop string, non-finite logits) has one step of work at t + 1
that `update` discards. A sequence that may be full once its placeholders resolve (max_tokens,
context length) is not scheduled. Batch composition never changes a request's bits, so the
outputs are the same with and without it.

With a drafter (speculative decoding), a decoding sequence's chunk also carries draft tokens: the
runner samples the target's token at each drafted position, and `update` keeps the tokens up to
and including the first one that differs from its draft, then takes the computed count back to the
kept tokens. That is the whole rollback: every cache row (window KV, compressor state, compressed
entries, indexer keys, the draft's context) is keyed by its absolute position and depends only on
the tokens up to it, so the rows the failed drafts wrote (at most k) are rewritten by the steps
that compute those positions again before anything reads them, and nothing before the rollback
point is ever recomputed (replayed). A step's drafts count as computed only once they hold: the
commit counts a chunk's tokens up to its last known one, and `update` adds the drafts kept.

Under async scheduling a speculative step (`SchedulerOutput.speculative`: it verifies drafts, or a
device drafter runs after it) is queued behind the one before as a plain step is, when its drafts are
made on the device: a sequence's next chunk is its in-flight row's last kept token (`placeholder(row)`)
followed by that row's drafts (`placeholder(row, DRAFTED, j)`), laid out at the positions the host
knows, which the runner moves on by the drafts the row kept, on the device. A host drafter (prompt
lookup) drafts from the tokens the host knows, as many more as the row may yield (`candidates`), and
the device takes the ones past what the row kept, if the row kept what they predicted. The host
reserves cache room for every draft in flight (`Sequence.num_unsettled`) and checks lengths against
the furthest the sequence may have gone; `update` of the step before then shifts the queued chunk to
where its tokens landed. A speculative step with a structured constraint is read back at once
(`SchedulerOutput.synchronous`): the constraint cuts drafts and builds masks from the tokens.
Under `verify_policy="throughput"` a step speculates only while drafts are expected to pay
(`deepinfer.engine.verify_plan`), and the others are plain steps.

A sequence with a structured constraint (`deepinfer.engine.structured`) holds a matcher, which
`update` advances over every token it keeps (the runner only reads it to build masks, leaving it as
it was); its drafts are cut before the first token the constraint forbids, so a draft row is masked
exactly as the row would be had the drafts before it been sampled.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from deepinfer.engine.cache import BlockTables, CacheManager
from deepinfer.engine.drafter import Drafter
from deepinfer.engine.prefix import PrefixCache
from deepinfer.engine.sequence import DRAFTED, Sequence, Status, is_placeholder, placeholder, placeholder_row
from deepinfer.engine.verify_plan import (DRAFTER_PRIOR, Exploration, HeadLevels, HoldRates, StepCost, confidences,
                                         plan_verify)

if TYPE_CHECKING:  # produced by the runner, which imports this module
    from deepinfer.engine.runner import StepResult


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `seq` run this step. `scored` lists the positions whose
    logits score a prompt token not scored before (position p scores token p + 1; a sequence
    recomputed after preemption does not score its prompt twice); `samples`: the chunk reaches the
    sequence's last token, so the step draws token `draws_at`; `draft_ids`: draft tokens run after
    the sequence's last token (they are the chunk's last inputs, counted in `num_tokens`), so the
    step also draws the tokens after each of them; `confidences`: a model drafter's confidence in each
    draft, where throughput-aware verification weighed them (what `HeadLevels` learn from);
    `candidates`: a host drafter's tokens to follow the sequence's known tokens, when its last token is
    still in flight (its drafts are then placeholders, for the candidates past what that step kept)."""

    seq: Sequence
    start: int
    num_tokens: int
    scored: range = range(0)
    samples: bool = False
    draft_ids: list[int] = field(default_factory=list)
    confidences: list[float] | None = None
    candidates: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_draft(self) -> int:
        return len(self.draft_ids)

    @property
    def draws_at(self) -> int:
        """The index of the first token the chunk draws (when it samples): after its last token
        but the drafts."""
        return self.end - self.num_draft

    @property
    def input_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.draws_at] + self.draft_ids

    @property
    def resolves_input(self) -> bool:
        """Whether the chunk's last token from its sequence is a placeholder of the step in flight."""
        return is_placeholder(self.seq.token_ids[self.draws_at - 1])

    @property
    def follows(self) -> int | None:
        """The in-flight output row whose last kept token this chunk decodes (its positions move on by
        the drafts that row keeps); None for a chunk whose positions the host knows."""
        first = self.seq.token_ids[self.start]
        return placeholder_row(first) if self.draws_at - self.start == 1 and is_placeholder(first) else None

    @property
    def num_verified(self) -> int:
        """Drafts the chunk verifies: a drafter that made fewer than the chunk has rows for leaves -1 in
        their place (`Scheduler.update` puts the device's drafts in for the placeholders), never held."""
        return sum(token != -1 for token in self.draft_ids)


@dataclass
class SchedulerOutput:
    """One step's work, in the order the runner lays it out; `speculative`: the step verifies drafts or
    a device drafter runs after it; `synchronous`: it must be read back before the next step is
    scheduled (its drafts are the host's to make)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    speculative: bool = False
    synchronous: bool = False

    @property
    def sampling(self) -> list[ScheduledChunk]:
        return [chunk for chunk in self.chunks if chunk.samples]

    @property
    def decodes_only(self) -> bool:
        """Every chunk is a sequence's last token and its drafts, nothing scored: a decode (or verify)
        step, the kind replayed from CUDA graphs and the kind throughput-aware verification prices."""
        return all(chunk.num_tokens == 1 + chunk.num_draft and not chunk.scored for chunk in self.chunks)


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
        chunked_prefill: bool, drafter: Drafter | None = None, draft_tokens: int = 0,
        prefix: PrefixCache | None = None, plan_verification: bool = False,
    ) -> None:
        self.cache = cache
        self.prefix = prefix
        self.rules = rules
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.drafter, self.draft_tokens = drafter, draft_tokens
        self.plans_verification = plan_verification and drafter is not None
        self.forget_verification()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.latest: SchedulerOutput | None = None  # the step scheduled last (it may be in flight)
        self.latest_before: SchedulerOutput | None = None  # the one before it, `latest` again after an undo
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0  # tokens of the sequences admitted while prefix caching is on
        self.num_prefix_hit_tokens = 0  # of those, the ones whose rows came from the prefix cache
        self.num_prefix_hits = 0  # admissions that took a cached prefix
        self.num_drafted = 0  # draft tokens verified
        self.num_draft_kept = 0  # of those, the ones that held
        self.num_verify_chunks = 0  # chunks that carried drafts
        self.verify_lengths: dict[int, int] = {}  # drafts a chunk carried -> how many chunks carried that many
        self.num_drafts_declined = 0  # drafts proposed that throughput-aware verification did not verify
        # the holds that verification's plans expected of the drafts they verified (their survivals summed):
        # beside num_draft_kept, how well calibrated the rates it plans with are
        self.num_drafts_expected = 0.0
        self.num_speculating_steps = 0  # steps that verified drafts or drafted (the others ran plain)
        self.num_rollbacks = 0  # verify chunks with a draft that failed
        self.num_rollback_rows = 0  # cache rows those wrote past the kept tokens (rewritten later, never replayed)

    def forget_verification(self) -> None:
        """Start throughput-aware verification (`engine.verify_plan`) from nothing, as a new engine does:
        no step times, and the drafter's rates over every sequence (which each sequence's own pool with)
        at the prior, its head's levels unknown; `drafter_proposes` holds at position 0 the chance that the
        drafter drafts at all where it can."""
        self.step_cost: StepCost | None = StepCost() if self.plans_verification else None
        self.exploration = Exploration()
        self.verify_all = False  # the step after a device drafter's probe verifies every draft it made
        self.num_probes = 0  # steps that probed the drafter (`Exploration`)
        self.drafter_holds = HoldRates(prior=DRAFTER_PRIOR)
        self.drafter_proposes = HoldRates(prior=DRAFTER_PRIOR)
        self.head_levels = HeadLevels()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        proposals: list[Sequence] = []  # the sequences the drafter could draft for
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0 or self.rules.full(seq, self._furthest(seq)):
                continue
            n = self._chunk_len(seq, budget)
            if n == 0:
                continue
            proposed = self._drafts(seq, n, budget)
            if proposed is not None:
                proposals.append(seq)
            drafts, candidates = proposed or ([], None)
            end = seq.num_computed + seq.num_unsettled + n  # as far as its rows may reach
            if not self._fits(seq.blocks, end + len(drafts)):
                drafts = []  # drafts never cost another sequence its blocks
            while not self._fits(seq.blocks, end):
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.cache.grow(seq.blocks, end + len(drafts))
            chunks.append(self._chunk(seq, seq.num_computed, n, drafts))
            chunks[-1].candidates = candidates if drafts else None
            budget -= n + len(drafts)
        probing = self.step_cost is not None and self._probe_due(chunks)
        verify_all, self.verify_all = self.verify_all, False
        if self.step_cost is not None:
            if not (probing or verify_all):
                budget += self._plan_verification(chunks)
            self._observe_proposals(proposals, chunks)
        index = 0  # waiting sequences before it wait for a prefix a running sequence is computing
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if self.rules.full(seq, len(seq.token_ids)):
                break
            if seq.num_unsettled:  # preempted with drafts in flight: its tokens are not all placed yet
                index += 1
                continue
            if not self._take_prefix(seq):
                index += 1
                continue
            n = self._chunk_len(seq, budget)
            # Leave a block per pool for each running sequence, so admitting a newcomer does not
            # force a preemption (and a re-admission, and another preemption) on the next step.
            if n == 0 or not self._fits(seq.blocks, seq.num_computed + n, reserve=len(self.running)):
                self.cache.free(seq.blocks)
                seq.num_computed = 0
                break
            del self.waiting[index]
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._count_prefix(seq)
            self.cache.grow(seq.blocks, seq.num_computed + n)
            chunks.append(self._chunk(seq, seq.num_computed, n, []))
            budget -= n
        self._commit(chunks)
        speculative = probing or self._speculates(chunks)
        if probing:
            self.exploration.probed()
            self.num_probes += 1
            self.verify_all = speculative and self.drafter.on_device
        elif speculative and not verify_all and self.step_cost is not None:
            self.exploration.paid()
        self.num_speculating_steps += speculative
        self.latest_before = self.latest
        # a constraint cuts drafts on the host, from the tokens before them
        constrained = any(chunk.seq.grammar is not None for chunk in chunks if chunk.samples)
        self.latest = SchedulerOutput(chunks, speculative, speculative and constrained)
        return self.latest

    @staticmethod
    def _furthest(seq: Sequence) -> int:
        """The most tokens `seq` may have once its steps in flight resolve (each draft may hold)."""
        return len(seq.token_ids) + seq.num_unsettled

    def _plan(self, base_rows: int, base_tokens: int, survivals: list[list[float]]) -> list[int]:
        return plan_verify(base_rows, base_tokens, survivals, self.step_cost.speculating.seconds,
                           self.step_cost.plain.seconds)

    def _observe_proposals(self, proposals: list[Sequence], chunks: list[ScheduledChunk]) -> None:
        """Whether the drafter drafted anything the plan verifies where it could, per sequence and over
        the step (drafts the plan declines count as none: a drafter whose drafts never pay runs no more
        than one that never drafts)."""
        verified = {id(chunk.seq) for chunk in chunks if chunk.num_draft}
        drafted = [int(id(seq) in verified) for seq in proposals]
        for seq, did in zip(proposals, drafted):
            seq.proposes.observe(1, did)
        self.drafter_proposes.observe_step([(1, did) for did in drafted])

    def _speculates(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step is speculative: it verifies drafts, or drafting pays (a device drafter then
        runs after it)."""
        if self.drafter is None or not chunks:
            return False
        return any(chunk.num_draft for chunk in chunks) or self._drafting_pays(chunks)

    def _probe_due(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this decode step probes the drafter (`Exploration`): what a probe would add to plain
        steps of these sequences, a step verifying `draft_tokens` drafts each (and for a device drafter,
        the step it drafts after) against plain ones, is due."""
        if self.drafter is None or not chunks or not all(chunk.num_tokens - chunk.num_draft == 1 for chunk in chunks):
            return False
        rows = len(chunks)
        extra = self.step_cost.speculating.seconds(rows * (1 + self.draft_tokens)) - self.step_cost.plain.seconds(rows)
        # no extra cost (or none measured yet): the plan itself verifies whatever may hold
        return extra > 0 and self.exploration.due(extra * (2 if self.drafter.on_device else 1))

    def _drafting_pays(self, chunks: list[ScheduledChunk]) -> bool:
        """Always under the fixed policy; under throughput-aware verification, while a decode step of the
        step's sequences, each with `draft_tokens` drafts, would verify some (the rates do not change in
        plain steps, which verify nothing: an engine whose drafts stopped paying stays plain until it
        probes, `_probe_due`). Each
        sequence's survivals are weighed by the chance that its drafter drafts at all (prompt lookup
        often finds nothing), which is also learnt only in steps that speculate."""
        if self.step_cost is None:
            return True
        survivals = []
        for chunk in chunks:
            drafting = chunk.seq.proposes.rate(0, self.drafter_proposes)
            survivals.append([drafting * a for a in chunk.seq.hold_rates.survivals(self.draft_tokens, self.drafter_holds)])
        return any(self._plan(len(chunks), len(chunks), survivals))

    def _plan_verification(self, chunks: list[ScheduledChunk]) -> int:
        """Cut each chunk's drafts to the length `plan_verify` picks for the step; the budget freed."""
        speculating = [chunk for chunk in chunks if chunk.num_draft]
        if not speculating:
            return 0
        for chunk in speculating:  # drafts still on the device come with no confidence the host can read
            survivals = None if is_placeholder(chunk.draft_ids[0]) else self.drafter.survivals(chunk.seq)
            chunk.confidences = None if survivals is None else confidences(survivals[:chunk.num_draft])
        survivals = [self._survivals(chunk) for chunk in speculating]
        lengths = self._plan(sum(chunk.num_tokens - chunk.num_draft for chunk in chunks),
                             sum(chunk.samples for chunk in chunks), survivals)
        freed = 0
        for chunk, length, expected in zip(speculating, lengths, survivals):
            self.num_drafts_expected += sum(expected[:length])
            declined = chunk.num_draft - length
            chunk.num_tokens -= declined
            chunk.draft_ids = chunk.draft_ids[:length]
            freed += declined
        self.num_drafts_declined += freed
        return freed

    def _survivals(self, chunk: ScheduledChunk) -> list[float]:
        """The chance that a chunk's first j drafts all hold, j = 1 .. its drafts: the running product of
        its sequence's learnt rates (`HoldRates`), each scaled by the drafter's confidence in the draft
        relative to its usual one there (`HeadLevels`) where the drafter has a confidence head."""
        survivals, survival = [], 1.0
        for j in range(chunk.num_draft):
            rate = chunk.seq.hold_rates.rate(j, self.drafter_holds)
            if chunk.confidences is not None:
                rate = min(1.0, rate * self.head_levels.relative(j, chunk.confidences[j]))
            survival *= rate
            survivals.append(survival)
        return survivals

    def observe_step(self, scheduled: SchedulerOutput, plain_seconds: float, speculating_seconds: float) -> None:
        """What a step cost, for throughput-aware verification: `plain_seconds`, what it would have taken
        as a plain step, and for a speculative step `speculating_seconds`, its whole time (read back at
        once: its wall time, host work included; queued behind another: its forward, sampling and
        drafter on the device's clock, the host's work overlapping them as it does a plain step's).
        Only decode steps teach the curves: the plan weighs decode steps with drafts against decode steps
        without, and a step holding a prompt's chunk runs eagerly and costs what the prompt does (the
        first step of a run is one: speculative, as the drafter runs after it)."""
        if self.step_cost is None or not scheduled.decodes_only:
            return
        rows = sum(chunk.num_tokens for chunk in scheduled.chunks)
        self.step_cost.plain.observe(rows, plain_seconds)
        self.exploration.observe(scheduled.speculative, plain_seconds)
        if scheduled.speculative:
            self.step_cost.speculating.observe(rows, speculating_seconds)

    def _take_prefix(self, seq: Sequence) -> bool:
        """Start a waiting sequence at its longest cached prefix, sharing that prefix's blocks; or
        return False, changing nothing, while a running sequence is computing the next block it could
        take. A sequence asking for prompt logprobs takes at most the positions it
        has already scored (none, unless it is recomputed after a preemption); every sequence computes
        at least its last token, whose logits it samples from."""
        if self.prefix is None:
            return True
        limit = len(seq.token_ids) - 1
        if seq.params.prompt_logprobs:
            limit = min(limit, seq.num_scored)
        entry = self.prefix.lookup(seq, limit)
        start = entry.length if entry is not None else 0
        if self.prefix.computing(seq, start, limit, self.running):
            return False
        if entry is not None:
            self.cache.adopt(seq.blocks, *self.prefix.tables(entry))
            seq.num_computed = start
        seq.num_cached = start
        return True

    def _count_prefix(self, seq: Sequence) -> None:
        """Count an admitted sequence's tokens and the ones it took from the prefix cache."""
        if self.prefix is not None:
            self.num_prefix_query_tokens += len(seq.token_ids)
            self.num_prefix_hit_tokens += seq.num_computed
            self.num_prefix_hits += seq.num_computed > 0

    def _fits(self, blocks: BlockTables, end: int, reserve: int = 0) -> bool:
        """Whether tokens up to `end` can be given rows leaving `reserve` blocks free in every pool,
        evicting least recently used prefix entries as far as that takes (never anyone's blocks)."""
        while not self.cache.can_grow(blocks, end, reserve):
            if self.prefix is None or not self.prefix.evict():
                return False
        return True

    def _offer_prefix(self, seq: Sequence) -> None:
        """Cache the rows of `seq`'s computed whole blocks (not the last token's of a finished sequence:
        a draft there may have been rejected after its row was written)."""
        if self.prefix is not None:
            end = min(seq.num_computed, len(seq.token_ids) - 1)
            seq.num_cached = max(seq.num_cached, self.prefix.offer(seq, end))

    def reset_prefix_cache(self) -> None:
        """Evict every cached prefix (sequences keep the blocks they took)."""
        if self.prefix is not None:
            self.prefix.clear()

    @staticmethod
    def _chunk(seq: Sequence, start: int, n: int, drafts: list[int]) -> ScheduledChunk:
        end = start + n
        return ScheduledChunk(seq, start, n + len(drafts), scored_positions(seq, start, end),
                              samples=end == len(seq.token_ids), draft_ids=drafts)

    def _drafts(self, seq: Sequence, n: int, budget: int) -> tuple[list[int], list[int] | None] | None:
        """Draft tokens for a decoding sequence (its one uncomputed token known): as many as the
        drafter proposes up to `draft_tokens`, the step's budget, and the tokens the sequence may
        still have (a draft past max_tokens or the context would be computed for nothing), cut before
        the first one its structured constraint forbids (it could not be kept). A sequence whose last
        token is still in flight (and has no constraint) takes placeholders: for the drafts a device
        drafter made after it, where one ran after that step, or for a host drafter's `candidates` past
        the tokens that step keeps. Returns the drafts and those candidates (None where the drafts
        are not placeholders for them), or None where the drafter had no chance to draft (see
        `Drafter.propose`)."""
        if self.drafter is None or n != 1 or seq.num_uncomputed != 1:
            return None
        last = seq.token_ids[-1]
        if is_placeholder(last) and (seq.grammar is not None or self.drafter.on_device and not self.latest.speculative):
            return None
        limit = 0
        while limit < min(self.draft_tokens, budget - 1) and not self.rules.full(seq, self._furthest(seq) + limit + 1):
            limit += 1
        if not limit:
            return None
        candidates = None
        if is_placeholder(last) and not self.drafter.on_device:
            # the in-flight step yields 1 to num_unsettled + 1 tokens: draft past the most it may keep
            candidates = self.drafter.propose(seq, seq.num_unsettled + 1 + limit)
            if candidates is None:
                return None
            limit = min(limit, len(candidates) - 1)
        if is_placeholder(last):
            return [placeholder(placeholder_row(last), DRAFTED, j) for j in range(limit)], candidates
        drafts = self.drafter.propose(seq, limit)
        if drafts is None:
            return None
        drafts = drafts[:limit]
        return (drafts[:seq.grammar.allows(drafts)] if seq.grammar is not None else drafts), None

    @staticmethod
    def _commit(chunks: list[ScheduledChunk]) -> None:
        """Count the step's work as done: its tokens computed (drafts once they hold: `update`), its
        positions scored, its drafts in flight, and a placeholder for each token it samples (its row in
        the step's output), so the next step can be scheduled before this one's results are read."""
        row = 0
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed = chunk.draws_at
            seq.num_unsettled += chunk.num_draft
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
        self.latest = self.latest_before
        for chunk in reversed(scheduled.chunks):
            seq = chunk.seq
            seq.num_computed = chunk.start
            seq.num_unsettled -= chunk.num_draft
            if chunk.scored:
                seq.num_scored = chunk.scored.start
            if chunk.samples:
                del seq.token_ids[chunk.draws_at:]

    def update(self, scheduled: SchedulerOutput, result: StepResult) -> list[Sequence]:
        """Apply a step's results: record prompt logprobs, put the sampled tokens in place of their
        placeholders, finish sequences (stop, length, or non-finite logits) and release cache rows
        no later step can read. Rows of sequences that finished before this step are dropped.
        Returns the sequences that finished."""
        now = time.perf_counter()
        finished = []
        later = None if self.latest is scheduled else self.latest  # the step queued behind this one, if any
        queued = {} if later is None else {id(chunk.seq): chunk for chunk in later.chunks}
        live = [(row, chunk) for row, chunk in enumerate(scheduled.sampling) if chunk.seq.status is not Status.FINISHED]
        verified = [(chunk, len(result.tokens[row]) - 1) for row, chunk in live if chunk.num_verified]
        foreseen = [(chunk.seq, seen) for row, chunk in live if not chunk.num_verified
                    and (seen := self._foreseen(queued.get(id(chunk.seq)), result.tokens[row])) is not None]
        for seq, seen in foreseen:
            seq.hold_rates.observe(*seen)
        self.drafter_holds.observe_step([(chunk.num_verified, kept) for chunk, kept in verified]
                                        + [seen for _, seen in foreseen])
        self.head_levels.observe_step([(chunk.confidences, chunk.num_verified, kept) for chunk, kept in verified
                                       if chunk.confidences is not None])
        scoring = iter(zip(result.prompt_logprobs, result.prompt_top))
        sampled = iter(range(len(result.tokens)))
        for chunk in scheduled.chunks:
            seq = chunk.seq
            prompt = next(scoring) if chunk.scored else None
            row = next(sampled) if chunk.samples else None
            seq.num_unsettled -= chunk.num_draft
            if seq.status is Status.FINISHED:
                continue
            if prompt is not None:
                seq.prompt_logprobs.extend(prompt[0])
                seq.prompt_top_logprobs.extend(prompt[1])
            if row is not None:
                following = queued.get(id(seq))
                self._resolve(seq, chunk, result, row, now, following)
                if result.drafts is not None and seq.status is Status.RUNNING:
                    self.drafter.observe(seq, chunk.draws_at + len(result.tokens[row]), result.drafts[row],
                                         result.draft_survivals[row])
                if seq.status is Status.RUNNING and following is not None and following.num_draft:
                    following.draft_ids = self._placed_drafts(following, result, row)
            if seq.status is Status.FINISHED:
                (self.running if seq in self.running else self.waiting).remove(seq)
                self._offer_prefix(seq)
                self.cache.free(seq.blocks)
                finished.append(seq)
            elif seq.status is Status.RUNNING:
                self._offer_prefix(seq)
                self.cache.release_behind(seq.blocks, seq.num_computed)
        return finished

    @staticmethod
    def _placed_drafts(following: ScheduledChunk, result: StepResult, row: int) -> list[int]:
        """The drafts the device put in for `following`'s draft placeholders once the step before it
        (this `result`, its sequence in output `row`) kept what it kept: its drafter's, or `following`'s
        candidates past the tokens kept if those predicted them; -1 where it put in none (those never
        hold). A chunk whose drafts the host made keeps them."""
        if not is_placeholder(following.draft_ids[0]):
            return following.draft_ids
        if following.candidates is None:
            made = result.drafts[row]
        else:
            drawn, candidates = result.tokens[row], following.candidates
            made = candidates[len(drawn):] if candidates[:len(drawn)] == drawn else []
        made = made[:following.num_draft]
        return made + [-1] * (following.num_draft - len(made))

    @staticmethod
    def _foreseen(following: ScheduledChunk | None, drawn: list[int]) -> tuple[int, int] | None:
        """A host drafter's candidates for the chunk queued behind one that verified nothing, checked
        against what that chunk drew: where they failed to predict it, the drafts they make are dropped
        on the device (`ModelRunner._drafts_ahead`) and verify nothing, but the draws tested them as a
        verification would: (tried, held), the first `held` candidates equal to the draws and the next
        one not. None where they predicted every draw (their drafts are then verified) or there are none."""
        if following is None or following.candidates is None or not following.num_draft:
            return None
        held = next((j for j, (c, t) in enumerate(zip(following.candidates, drawn)) if c != t), None)
        return None if held is None else (held + 1, held)

    def _resolve(self, seq: Sequence, chunk: ScheduledChunk, result: StepResult, row: int, now: float,
                 following: ScheduledChunk | None) -> None:
        """The tokens `chunk` drew, in its output row `row`, from token `chunk.draws_at` on: the first
        in place of its placeholder, the ones drawn after drafts that held inserted after it (before
        the placeholder of a step queued behind this one), each followed by the stop checks (a finished
        sequence drops the tokens after its last), then the drafts kept counted as computed and
        `following` (the sequence's chunk in the step queued behind, which the runner laid out on the
        device past them) moved on past them."""
        index, drawn = chunk.draws_at, result.tokens[row]
        verified, kept = chunk.num_verified, len(drawn) - 1
        self.num_drafted += verified
        self.num_draft_kept += kept
        self.num_verify_chunks += verified > 0
        if verified:
            self.verify_lengths[verified] = self.verify_lengths.get(verified, 0) + 1
            seq.hold_rates.observe(verified, kept)
        for j, token in enumerate(drawn):
            if not result.finite[row][j]:
                del seq.token_ids[index + j:]
                seq.finish("error", error=f"non-finite logits at position {index + j - 1}",
                           error_kind="non_finite_logits")
                return
            if j == 0:
                seq.token_ids[index] = token
            else:
                seq.token_ids.insert(index + j, token)
            if seq.grammar is not None and not seq.grammar.advance(token):
                del seq.token_ids[index + j:]
                seq.finish("error", error=f"token {token} at position {index + j} breaks the request's structured "
                           f"constraint", error_kind="invalid_request")
                return
            seq.logprobs.append(result.logprobs[row][j])
            if result.top[row] is not None:
                seq.top_logprobs.append(result.top[row][j])
            if seq.first_token_time is None:
                seq.first_token_time = now
            stopped = self.rules.stop(seq, index + j + 1)
            if stopped is not None:
                del seq.token_ids[index + j + 1:]
                seq.finish(*stopped)
                return
        self.num_rollbacks += kept < chunk.num_draft
        self.num_rollback_rows += chunk.num_draft - kept
        if seq.status is Status.RUNNING:  # a sequence preempted meanwhile is recomputed from its tokens
            seq.num_computed += kept
            if following is not None:
                following.start += kept
