"""Record one configuration of a suite into a run folder of the audit store.

Rows are flushed in small atomic part files as requests finish (harness.run_writer), so a run killed
at any point keeps what it finished; `resume=True` serves only the missing requests. Launched over
several processes (torchrun), every rank serves its share and rank 0 writes the run. Because outputs
do not depend on what else is in the batch, the resumed run reaches the same root as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path

from deepinfer.audit.files import folder_lock
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.parallel import from_rank_zero, process_rank
from deepinfer.progress import Progress
from deepinfer.harness.run_writer import FLUSH_ROWS, FLUSH_SECONDS, STATS_FILE, completed_root, open_run, run_manifest
from deepinfer.harness.serve import serve
from deepinfer.harness.suite_base import Suite
from deepinfer.harness.sweep import Variant
from deepinfer.kernels.cpu_isa import cpu_threads

__all__ = ["FLUSH_ROWS", "FLUSH_SECONDS", "STATS_FILE", "record_run"]


def record_run(
    model: str | Path | None, suite: Suite, variant: Variant, run_dir: Path, *, run_seed: int = 0,
    resume: bool = False, progress: bool = True,
) -> dict:
    """Serve `suite` under `variant` into `run_dir`, locked against a second writer (rank 0 writes);
    returns the run's root (root.json contents)."""
    writer_lock = folder_lock(Path(run_dir), resumable=True) if process_rank() == 0 else contextlib.nullcontext()
    with writer_lock, cpu_threads(variant.threads):
        return _record_run(model, suite, variant, Path(run_dir), run_seed, resume, progress)


def _record_run(model: str | Path | None, suite: Suite, variant: Variant, run_dir: Path, run_seed: int,
                resume: bool, progress: bool) -> dict:
    started = time.perf_counter()
    llm = LLM(model, replace(variant.engine, seed=run_seed))
    writing = llm.layout.rank == 0  # in a launch of several processes rank 0 writes; every rank serves
    root = None
    if writing:
        manifest = run_manifest(llm, model, suite=suite.describe(), run_seed=run_seed, variant=variant.to_dict())
        root = completed_root(run_dir, manifest) if resume else None
    if (root := from_rank_zero(root)) is not None:
        return root
    writer = open_run(run_dir, manifest, llm, resume=resume, started=started) if writing else None
    done = from_rank_zero(writer.done() if writing else None)
    refused = 0
    jobs, job_index = [], []
    for index, item in enumerate(suite.requests):
        if index in done:
            continue
        params = item.params(run_seed)  # what a refused request's row records
        try:
            params = item.params(run_seed, llm)  # a "tool_call" constraint made for this engine
            prompt = item.prompt_ids(llm)
            llm.check_params(params)  # a constraint that does not compile refuses its request alone
        except DeepInferError as err:
            if writing:
                writer.refused(index, item.request_id, item.row_params(params), err)
            refused += 1
            continue
        jobs.append((prompt, params))
        job_index.append(index)
    bar = Progress(variant.name, len(suite.requests), len(done), enabled=progress and writing)
    bar.update(refused)
    for shard in range(variant.shards):  # one engine per share of the suite, over the same weights
        mine = [j for j, index in enumerate(job_index) if index % variant.shards == shard]
        if shard and not mine:  # a share with nothing to serve needs no engine (nor its cache)
            continue
        engine = llm if shard == 0 else llm.with_engine(llm.engine_config)
        if shard and writing:
            writer.serving(engine)
        for finished in serve(engine, [jobs[j] for j in mine], variant):
            if not writing:
                continue
            index = job_index[mine[finished.index]]
            item = suite.requests[index]
            writer.served(index, item.request_id,
                          item.row_fields(engine, jobs[mine[finished.index]][1], finished.output),
                          arrival_s=finished.arrival_s, first_token_s=finished.first_token_s,
                          finish_s=finished.finish_s)
            bar.update(1)
            writer.flush_if_due()
    bar.close()
    return from_rank_zero(writer.finalize() if writing else None)
