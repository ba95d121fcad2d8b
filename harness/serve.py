"""Drive one engine over a list of prompts the way a variant says: arrival order and staggering.

Batch size, chunking and preemption are engine settings (a variant's `EngineConfig`); what this
module adds is *when* each request reaches the engine.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.parallel import gather_objects
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
    In a launch of several processes every rank is given the same jobs and serves its share (all of
    them unless the engine is data parallel), stepping while any rank works, and every rank yields
    every finished job.
    With `stagger=k`, k requests start together and one more joins every k engine steps. With
    `warm`, the jobs are served once first, their outputs dropped."""
    if variant.warm:
        for _ in _serve(llm, jobs, variant):
            pass
    yield from _serve(llm, jobs, variant)


def _serve(llm: LLM, jobs: list[tuple[list[int], SamplingParams]], variant: Variant) -> Iterator[Finished]:
    start = time.perf_counter()
    pending = [index for index in arrival_order(len(jobs), variant) if llm.layout.serves(index)]
    index_of: dict[int, int] = {}
    arrival: dict[int, float] = {}

    def submit(index: int) -> None:
        request_id = llm.add_request(*jobs[index])
        index_of[request_id] = index
        arrival[index] = time.perf_counter() - start

    head = len(pending) if not variant.stagger else variant.stagger
    for index in pending[:head]:
        submit(index)
    pending = pending[head:]
    steps = 0
    while True:
        working = llm.has_unfinished() or bool(pending)
        finished = []
        if working:
            if pending and (not llm.has_unfinished() or steps % variant.stagger == 0):
                submit(pending.pop(0))
            for output in llm.step():
                index = index_of[output.request_id]
                first = None if output.first_token_time is None else output.first_token_time - start  # None: errored
                finished.append(Finished(index, output, arrival[index], first, time.perf_counter() - start))
            steps += 1
        elif llm.layout.lockstep:  # the other ranks' MoE layers still exchange tokens with this one's
            llm.step()
        if llm.layout.world > 1:  # every rank learns who still works and gets every rank's finished requests
            shares = gather_objects((working, finished))
            working = any(share[0] for share in shares)
            finished = [done for share in shares[::llm.layout.attention_ranks] for done in share[1]]  # one per group
        yield from finished
        if not working:
            return
