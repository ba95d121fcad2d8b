"""A request's life inside the engine: its tokens, how many are computed, its cache blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from deepinfer.engine.cache import BlockTables
from deepinfer.sampling_params import SamplingParams


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
    num_computed: int = 0
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
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
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
