"""A request's life inside the engine: its tokens, how many are computed, its cache blocks.

A token the device is still sampling is held in `Sequence.token_ids` as a placeholder: a negative
id, `placeholder(row)`, naming the row of the in-flight step's output that will hold it. The runner
resolves placeholders on the device (a step can take them as input before the host knows them);
`Scheduler.update` replaces them with the real tokens once the step's results come down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from deepinfer.engine.cache import BlockTables
from deepinfer.engine.structured import Matcher
from deepinfer.engine.verify_plan import HoldRates
from deepinfer.sampling_params import SamplingParams


def placeholder(row: int) -> int:
    """The stand-in for the token a step samples in its output row `row`."""
    return -1 - row


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
