"""Drive one engine over a list of prompts the way a variant says: arrival order and staggering.

Batch size, chunking and preemption are engine settings (a variant's `EngineConfig`); what this
module adds is *when* each request reaches the engine.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.harness.sweep import Variant

SHUFFLE_SEED = 1


@dataclass
class Finished:
    """A served request: `index` is its position in the job list; times are seconds since `serve` began
    (`first_token_s`: when its first output token was sampled; None when it errored first)."""

    index: int
    output: RequestOutput
    arrival_s: float
    first_token_s: float | None
    finish_s: float


def arrival_order(count: int, variant: Variant) -> list[int]:
    order = list(range(count))
    if variant.shuffle:
        random.Random(SHUFFLE_SEED).shuffle(order)
    return order


def serve(llm: LLM, jobs: list[tuple[list[int], SamplingParams]], variant: Variant) -> Iterator[Finished]:
    """Submit `jobs` (prompt ids, params) in the variant's order and yield each as it finishes.
    Job i is request number i. In a launch of several processes every rank is given the same jobs and
    serves its share (all of them unless the engine is data parallel), and every rank yields every
    finished job (`LLM.stream`).
    With `stagger=k`, k requests start together and one more joins every k engine steps. With
    `warm`, the jobs are served once first, their outputs dropped."""
    if variant.warm:
        for _ in _serve(llm, jobs, variant):
            pass
    yield from _serve(llm, jobs, variant)


def _serve(llm: LLM, jobs: list[tuple[list[int], SamplingParams]], variant: Variant) -> Iterator[Finished]:
    start = time.perf_counter()
    pending = deque(index for index in arrival_order(len(jobs), variant) if llm.layout.serves(index))

    def submit() -> None:
        index = pending.popleft()
        llm.add_request(*jobs[index], request_id=index)

    for _ in range(min(len(pending), variant.stagger or len(pending))):
        submit()
    steps = itertools.count()

    def arrive() -> bool:
        """With `stagger`: one more request every `stagger` steps, or at once when the engine is idle."""
        step = next(steps)
        if pending and (not llm.has_unfinished() or step % variant.stagger == 0):
            submit()
        return bool(pending)

    for finished in llm.stream(arrive):
        for output in finished:
            first = None if output.first_token_time is None else output.first_token_time - start  # None: errored
            yield Finished(output.request_id, output, output.arrival_time - start, first, output.finish_time - start)
