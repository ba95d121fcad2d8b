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

from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SPECULATION = ("off", "ngram")


class Drafter(Protocol):
    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """At most `limit` tokens to follow `token_ids` (every one known: no placeholders)."""


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, trying n = max_ngram first and down to min_ngram. Costs no model: it pays where text
    repeats (code edits, quoted tool output, retrieved passages echoed back)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        if limit <= 0 or len(token_ids) < 2:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            # windows start at 0 .. len - 1 - n: each has a token after it, and none is the suffix itself
            hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1))
            if hits.size:
                follows = int(hits[-1]) + n
                return ids[follows:follows + limit].tolist()
        return []


def build_drafter(speculation: str) -> Drafter | None:
    """The drafter an `EngineConfig.speculation` names (None for off)."""
    return NgramDrafter() if speculation == "ngram" else None
