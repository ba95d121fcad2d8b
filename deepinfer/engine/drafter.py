"""Draft tokens for speculative decoding: a drafter guesses how a sequence goes on, and the target
model checks the guesses in one step (`Scheduler.schedule` asks for them, `ModelRunner.execute`
samples the target's token at every drafted position, `Scheduler.update` keeps the run that held).

A draft token is kept only when it equals the token the target's sampler draws at its position, and
that draw depends on the request's seed, the position and the target's logits there, which under
batch-invariant numerics are the same bits however many positions a step computes. So what a drafter
proposes changes how many tokens a step yields, never which tokens: outputs are bitwise the same with
speculation on or off, greedy or sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deepinfer.engine.sequence import Sequence

SPECULATION = ("off", "ngram", "dspark", "mtp")
DEVICE_SPECULATION = ("dspark", "mtp")  # drafted on the device by the checkpoint's draft layers


class Drafter(Protocol):
    on_device: bool  # its drafts are made on the device by a pass after each step (`draft_runner`)

    def propose(self, seq: Sequence, limit: int) -> list[int] | None:
        """At most `limit` tokens to follow `seq.known_token_ids` (a step in flight may yield tokens
        after them: the scheduler asks a host drafter for that many more and the device picks the
        drafts that follow what the step kept); None when the drafter had no chance to draft there (a
        device drafter that did not run after the sequence's last step), where [] means it looked and
        had nothing. A drafter may keep what it
        learns of a sequence in `seq.draft_state`, which nothing else touches."""

    def survivals(self, seq: Sequence) -> list[float] | None:
        """For the drafts `propose` gives `seq` now, the chance by the drafter's own confidence that the
        first j of them all hold, j = 1, 2, ...; None where the drafter has no such estimate."""


class NgramIndex:
    """For n = 1 .. max_ngram, the latest start of every n-gram of a token list that has a token after
    it, kept up to date as the list grows (each new token costs max_ngram dictionary writes)."""

    def __init__(self, max_ngram: int) -> None:
        self.starts: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self.length = 0  # the list's length when last extended

    def extend(self, ids: list[int]) -> None:
        for end in range(max(self.length - 1, 0), len(ids) - 1):  # n-grams ending at `end` now have a successor
            for n in range(1, min(len(self.starts) - 1, end + 1) + 1):
                self.starts[n][tuple(ids[end - n + 1:end + 1])] = end - n + 1
        self.length = len(ids)


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, trying n = max_ngram first and down to min_ngram. Costs no model: it pays where text
    repeats (code edits, quoted tool output, retrieved passages echoed back). Each sequence's n-gram
    index lives in its `draft_state` and grows with it, so a step costs the same at any length."""

    on_device = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def survivals(self, seq: Sequence) -> None:
        return None  # a lookup has no confidence of its own

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        ids = seq.known_token_ids
        index = seq.draft_state
        if not isinstance(index, NgramIndex) or index.length > len(ids):  # a stopped sequence can shrink
            index = seq.draft_state = NgramIndex(self.max_ngram)
        index.extend(ids)
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = index.starts[n].get(tuple(ids[len(ids) - n:]))
            if start is not None:
                return ids[start + n:start + n + limit]
        return []


@dataclass
class DeviceDraft:
    """Drafts made on the device for a sequence of `length` tokens, and their survivals by the drafter's
    confidence head (the chance that the drafts up to each all hold)."""

    length: int
    tokens: list[int]
    survivals: list[float]


class DeviceDrafter:
    """The host half of drafting on the device (`dspark`, `mtp`): each step drafts after every sampling
    chunk (`deepinfer.engine.draft_runner`, which also picks how many to verify from the drafter's
    confidence); the next `schedule()` proposes those drafts if the sequence still ends where they were
    made (it may have stopped, or been preempted and recomputed, or its last step was plain: then it
    has none, and decodes one token). A step queued behind that one's takes them on the device
    instead (`Scheduler._drafts`)."""

    on_device = True

    def observe(self, seq: Sequence, length: int, drafts: list[int], survivals: list[float]) -> None:
        """Take the drafts the runner made on the device to follow `seq.token_ids[:length]` (the tokens
        a step kept: a step queued behind it may have put a placeholder after them), with their
        survivals (`Scheduler.update` calls it once a step's tokens are applied)."""
        seq.draft_state = DeviceDraft(length, drafts, survivals)

    def propose(self, seq: Sequence, limit: int) -> list[int] | None:
        state = self._current(seq)
        return None if state is None else state.tokens[:limit]

    def survivals(self, seq: Sequence) -> list[float] | None:
        state = self._current(seq)
        return None if state is None else state.survivals

    @staticmethod
    def _current(seq: Sequence) -> DeviceDraft | None:
        """The drafts made to follow `seq` as it is now, if any."""
        state = seq.draft_state
        return state if isinstance(state, DeviceDraft) and state.length == len(seq.token_ids) else None


def build_drafter(speculation: str) -> Drafter | None:
    """The drafter an `EngineConfig.speculation` names (None for off; the model drafters' host half)."""
    if speculation == "off":
        return None
    return NgramDrafter() if speculation == "ngram" else DeviceDrafter()
