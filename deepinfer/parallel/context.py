"""Context parallelism: one step's tokens (a long prompt's chunk) split over the ranks, each running
its own rows through the model, with the same bits as one rank running them all.

The split is balanced for causal attention: the step's rows are cut into 2N contiguous pieces and
rank r takes pieces r and 2N - 1 - r (zig-zag), so every rank gets early and late positions alike.
Every row-wise computation (projections, norms, hyper-connections, the MoE) runs on a rank's own rows
only. Attention layers gather what each token writes to the caches (window KV, compressor state
rows) from every rank, so each rank writes the whole step's rows and pools the whole step's
windows; then each rank attends for its own queries, over caches that hold what one rank's would.
Every rank holds every request's cache, as all ranks schedule the same steps. The final hidden
states are gathered back into step order before the head.
"""

from __future__ import annotations

import torch

from deepinfer.parallel.layout import all_gather_rows

SPLIT_MIN_TOKENS = 256  # a smaller step runs whole on every rank: splitting would cost more than it saves


def zigzag_rows(tokens: int, rank: int, ranks: int) -> list[int]:
    """The rows rank `rank` takes of a step of `tokens` rows: pieces rank and 2N - 1 - rank of 2N."""
    pieces = 2 * ranks
    bounds = [tokens * i // pieces for i in range(pieces + 1)]
    return [*range(bounds[rank], bounds[rank + 1]), *range(bounds[pieces - 1 - rank], bounds[pieces - rank])]


class ContextSplit:
    """One step's rows over the ranks of the launch: `own` [T_r] the rows this rank runs (ascending)."""

    def __init__(self, tokens: int, rank: int, ranks: int, device: torch.device) -> None:
        self.tokens = tokens
        self.rows = [zigzag_rows(tokens, r, ranks) for r in range(ranks)]
        self.own = torch.tensor(self.rows[rank], dtype=torch.int64, device=device)
        self._places = [torch.tensor(rows, dtype=torch.int64, device=device) for rows in self.rows]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `part` [T_r, ...] in step order [T, ...] (a collective; bytes as they are)."""
        return all_gather_rows(part, self._places, self.tokens)


class ContextGroup:
    """What a model needs to split its steps (`Decoder.context`): this rank's place in the launch, and
    `current`, the split of the step being run (None while it runs whole), which the expert exchange
    reads under expert parallelism: a split step's MoE rows are already this rank's own."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.rank, self.ranks = rank, ranks
        self.current: ContextSplit | None = None

    def split(self, tokens: int, device: torch.device) -> ContextSplit | None:
        """The split of a step of `tokens` rows, or None for a step too small to split (kept as `current`)."""
        self.current = None if tokens < max(SPLIT_MIN_TOKENS, 2 * self.ranks) else ContextSplit(
            tokens, self.rank, self.ranks, device)
        return self.current
