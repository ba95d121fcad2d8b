"""Record one configuration of a suite into a run folder of the audit store.

Rows are flushed in small atomic part files as requests finish, so a run killed at any point keeps
what it finished; `resume=True` serves only the missing requests. Because outputs do not depend on
what else is in the batch, the resumed run reaches the same root as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from audit.errors import AuditError
from audit.files import atomic_write, json_bytes
from audit.manifest import build_manifest
from audit.store import ROOT, RunStore, make_row, read_run
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from harness.progress import Progress
from harness.serve import serve
from harness.suites import Suite
from harness.sweep import Variant, cpu_threads

FLUSH_ROWS = 16
FLUSH_SECONDS = 2.0
STATS_FILE = "stats.json"


def record_run(
    model: str | Path | None, suite: Suite, variant: Variant, run_dir: Path, *, run_seed: int = 0,
    resume: bool = False, progress: bool = True,
) -> dict:
    """Serve `suite` under `variant` into `run_dir`; returns the run's root (root.json contents)."""
    with cpu_threads(variant.threads):
        return _record_run(model, suite, variant, Path(run_dir), run_seed, resume, progress)


def _record_run(model: str | Path | None, suite: Suite, variant: Variant, run_dir: Path, run_seed: int,
                resume: bool, progress: bool) -> dict:
    started = time.perf_counter()
    llm = LLM(model, seed=run_seed, **variant.engine_kwargs())
    manifest = build_manifest(
        engine={"max_num_seqs": variant.max_num_seqs, "max_num_batched_tokens": llm.max_num_batched_tokens,
                "enable_chunked_prefill": variant.enable_chunked_prefill,
                "num_cache_blocks": variant.num_cache_blocks, "cache_blocks": llm.cache.num_blocks,
                "max_model_len": llm.max_model_len, "numerics": variant.numerics, "dtype": variant.dtype,
                "device": variant.device},
        checkpoint={"path": str(model) if model is not None else None, "content_hash": llm.model_id},
        suite=suite.describe(), seeds={"run_seed": run_seed}, variant=variant.to_dict(),
    )
    if resume and (run_dir / ROOT).exists():
        run = read_run(run_dir)
        _check_same_run(run_dir, run.manifest, manifest)
        return run.root
    store = _open_store(run_dir, manifest, resume)
    _read_stats(run_dir)  # a damaged stats.json stops a resume now, not after all the work
    done = store.done()
    rows: list[dict] = []
    jobs, job_index = [], []
    for index, item in enumerate(suite.requests):
        if index in done:
            continue
        params = item.params(run_seed)
        try:
            prompt = item.prompt_ids(llm)
        except DeepInferError as err:
            rows.append(_error_row(index, item.request_id, item.row_params(params), err))
            continue
        jobs.append((prompt, params))
        job_index.append(index)
    bar = Progress(variant.name, len(suite.requests), len(done), enabled=progress)
    bar.update(len(rows))
    last_flush = time.monotonic()
    for finished in serve(llm, jobs, variant):
        index = job_index[finished.index]
        item = suite.requests[index]
        rows.append(make_row(
            index=index, request_id=item.request_id, **item.row_fields(llm, jobs[finished.index][1], finished.output),
            error=None, arrival_s=finished.arrival_s, first_token_s=finished.first_token_s,
            finish_s=finished.finish_s,
        ))
        bar.update(1)
        if len(rows) >= FLUSH_ROWS or time.monotonic() - last_flush > FLUSH_SECONDS:
            store.append(rows)
            rows, last_flush = [], time.monotonic()
    if rows:
        store.append(rows)
    bar.close()
    _add_stats(run_dir, llm, time.perf_counter() - started)
    return store.finalize()


def _open_store(run_dir: Path, manifest: dict, resume: bool) -> RunStore:
    if not resume:
        return RunStore.create(run_dir, manifest)
    if not (run_dir / "manifest.json").exists():
        return RunStore.create(run_dir, manifest)
    store = RunStore.resume(run_dir)
    _check_same_run(run_dir, store.manifest, manifest)
    return store


def _check_same_run(run_dir: Path, stored: dict, wanted: dict) -> None:
    for key in ("checkpoint", "suite", "variant", "engine", "seeds"):
        if _comparable(stored.get(key)) != _comparable(wanted[key]):
            raise AuditError(f"{run_dir}: cannot resume: its {key} differs from this invocation's")


def _comparable(section: object) -> object:
    """A manifest section without the fields that may legitimately differ between sessions."""
    if isinstance(section, dict):
        return {k: v for k, v in section.items() if k != "path"}
    return section


def _error_row(index: int, request_id: str, params: dict, error: DeepInferError) -> dict:
    """The row of a request the engine refused: its error kind and detail (never where the input was read
    from, so the same refusal hashes the same from any folder)."""
    return make_row(
        index=index, request_id=request_id, prompt_token_ids=[], params=params, token_ids=[], logprobs=[],
        top_token_ids=[], top_logprobs=[], text=None, finish_reason="error", error_kind=error.kind,
        error=error.detail, arrival_s=0.0, first_token_s=None, finish_s=0.0,
    )


def _read_stats(run_dir: Path) -> dict:
    """The engine statistics of earlier sessions of the run; a damaged file is a one-line error (read
    before a resumed run does any work)."""
    path = run_dir / STATS_FILE
    if not path.exists():
        return {"sessions": 0, "wall_s": 0.0, "preemptions": 0}
    try:
        stats = json.loads(path.read_bytes())
    except (OSError, ValueError):
        stats = None
    numbers = isinstance(stats, dict) and all(
        isinstance(stats.get(key), (int, float)) and not isinstance(stats.get(key), bool)
        for key in ("sessions", "wall_s", "preemptions"))
    if not numbers:
        raise AuditError(f"{path}: not the run's statistics (a JSON object with sessions, wall_s and preemptions); "
                         "delete it to resume")
    return stats


def _add_stats(run_dir: Path, llm: LLM, seconds: float) -> None:
    """Engine statistics summed over the sessions that produced the run (timing is never hashed)."""
    stats = _read_stats(run_dir)
    stats["sessions"] += 1
    stats["wall_s"] += seconds
    stats["preemptions"] += llm.scheduler.num_preemptions
    atomic_write(run_dir / STATS_FILE, json_bytes(stats))
