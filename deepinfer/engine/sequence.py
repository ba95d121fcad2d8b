"""A request's life inside the engine: its tokens, how many are computed, its cache blocks.

A token the device is still sampling is held in `Sequence.token_ids` as a placeholder: a negative
id, `placeholder(row)`, naming the row of the in-flight step's output whose last kept token it is (the
token it drew, or where that row verified drafts, the one drawn after the last draft that held). The
runner resolves placeholders on the device (a step can take them as input before the host knows them);
`Scheduler.update` replaces them with the real tokens once the step's results come down. A step queued
behind a speculative one also names what the device holds of its rows in other columns: the tokens a row
drew (`placeholder(row, DRAWN, j)`, what a shifted Engram lookback reads) and the drafts its drafter made
(`placeholder(row, DRAFTED, j)`, verified without the host seeing them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from deepinfer.engine.cache import BlockTables
from deepinfer.engine.structured import Matcher
from deepinfer.engine.verify_plan import HoldRates
from deepinfer.sampling_params import SamplingParams


ROW_LIMIT = 1 << 20  # output rows a step may have, as placeholders encode them
COLUMN_LIMIT = 1 << 10  # columns of one kind a row may have
LAST, DRAWN, DRAFTED = 0, 1, 2  # the kinds of token a placeholder stands for


def placeholder(row: int, kind: int = LAST, column: int = 0) -> int:
    """The stand-in for a token of the in-flight step's output row `row`: its last kept token (LAST), the
    token it drew in `column` (DRAWN), or its drafter's draft `column` (DRAFTED)."""
    return -1 - (row + ROW_LIMIT * (column + COLUMN_LIMIT * kind))


def placeholder_row(token: int) -> int:
    """The output row a placeholder names."""
    return (-1 - token) % ROW_LIMIT


def is_placeholder(token: int) -> bool:
    return token < 0


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose cache rows are written, or scheduled to be by a step in flight
    # drafts that steps in flight verify for it: once they resolve its tokens may lie up to that many
    # positions further on than `token_ids` places them now (0 while no speculative step is in flight)
    num_unsettled: int = 0
    num_scored: int = 0  # prompt positions whose logprobs are scheduled (`prompt_logprobs` may lag behind)
    status: Status = Status.WAITING
    blocks: BlockTables = field(default_factory=BlockTables)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    error_kind: str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)  # when it was queued
    first_token_time: float | None = None
    draft_state: object | None = None  # the scheduler's drafter's memory of this sequence (`engine.drafter`)
    hold_rates: HoldRates = field(default_factory=HoldRates)  # how often its drafts held (`engine.verify_plan`)
    proposes: HoldRates = field(default_factory=HoldRates)  # how often its drafter drafted at all
    prefix_keys: list[bytes] = field(default_factory=list)  # its token blocks' keys, as far as computed (`engine.prefix`)
    num_cached: int = 0  # leading tokens whose rows it took from or offered to the prefix cache
    grammar: Matcher | None = None  # its `structured` constraint after its known tokens (`engine.structured`)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens, placeholders included while a step is in flight."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def known_token_ids(self) -> list[int]:
        """The tokens the host knows: all but a placeholder at the end (the step in flight's)."""
        return self.token_ids[:-1] if self.token_ids and is_placeholder(self.token_ids[-1]) else self.token_ids

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def finish(self, reason: str, text: str | None = None, error: str | None = None,
               error_kind: str | None = None) -> None:
        """Mark the sequence done: `reason` "stop", "length" or "error"; `text` the output text when a
        stop string cut it; `error` what went wrong and `error_kind` its kind (deepinfer.errors.ERROR_KINDS)."""
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.text = text
        self.error, self.error_kind = error, error_kind
