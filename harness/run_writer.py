"""The one writer of run folders in the audit store: harness.record (a suite under one configuration)
and `DeepInferLM` (the requests lm-eval sends, harness/lm_eval_model.py) both go through it.

    RUN/manifest.json     the engine as configured and as it resolved its limits, the checkpoint's
                          path and content hash, the suite, the seeds and the configuration
    RUN/parts/, RUN/streams.parquet, RUN/root.json
                          the rows (audit.store.RunStore: part files as rows come, merged at the end)
    RUN/stats.json        with `stats`: engine statistics summed over the sessions that wrote the run
                          (sessions, wall_s, preemptions, speculation's drafts and how many chunks
                          verified each number of them, prompt tokens the prefix cache was asked for
                          and supplied, steps a fixed-capacity expert exchange ran again; timing is
                          never hashed)

A resumed run (`open_run(..., resume=True)`) must have the same manifest, except the fields that may
differ between sessions (the checkpoint's path); a damaged stats.json stops it before any work. Its rows
must also have been rendered with the same prompt protocol (encoding and deepseek-recipe version): a run
recorded before manifests held the protocol cannot be resumed, since what rendered its prompts is unknown.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from dataclasses import asdict
from pathlib import Path

from deepinfer.audit.errors import AuditError
from deepinfer.audit.files import atomic_write, json_bytes
from deepinfer.audit.manifest import build_manifest, describe_protocol
from deepinfer.audit.store import MANIFEST, ROOT, STATS, RunStore, make_row, read_run
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.parallel import placement_digest
from deepinfer.recipe.official import recipe_version
from deepinfer.harness.environment import engine_version, environment_fingerprint, git_state

__all__ = ["FLUSH_ROWS", "FLUSH_SECONDS", "STATS_FILE", "RunWriter", "completed_root", "open_run", "read_stats",
           "run_manifest"]

FLUSH_ROWS = 16
FLUSH_SECONDS = 2.0
STATS_FILE = STATS
_STATS_KEYS = ("sessions", "wall_s", "preemptions")
# the scheduler's counters added with speculation (stats key: `engine.scheduler.Scheduler` attribute);
# runs recorded before they existed lack them and read as 0
_SPECULATION_KEYS = {"drafted": "num_drafted", "drafts_kept": "num_draft_kept", "verify_chunks": "num_verify_chunks",
                     "rollbacks": "num_rollbacks", "rollback_rows": "num_rollback_rows",
                     "drafts_declined": "num_drafts_declined", "speculating_steps": "num_speculating_steps",
                     "probes": "num_probes"}
# the prefix cache's counters (stats key: `engine.scheduler.Scheduler` attribute); older runs read as 0
_PREFIX_KEYS = {"prefix_hit_tokens": "num_prefix_hit_tokens", "prefix_query_tokens": "num_prefix_query_tokens"}
# a fixed-capacity expert exchange's redone steps (stats key: `engine.core.EngineCore` attribute); older runs read as 0
_EXCHANGE_KEYS = {"exchange_redos": "num_exchange_redos", "exchange_overflow_slots": "num_exchange_overflow_slots"}
_COUNTED = (*_SPECULATION_KEYS, *_PREFIX_KEYS, *_EXCHANGE_KEYS)  # counters a run's sessions add up
_RESUMED_SECTIONS = ("checkpoint", "suite", "variant", "engine", "seeds")  # what a resumed run must share


def run_manifest(llm: LLM, model: str | Path | None, *, suite: dict, run_seed: int, variant: dict) -> dict:
    """The manifest of a run served by `llm` (loaded from `model`; None: the embedded checkpoint).
    `engine` is the engine's `EngineConfig` as resolved (max_model_len filled in; its seed is the run
    seed, recorded under `seeds`), plus what it derived from it: the blocks each cache pool got, the
    step budget, and the parallel layout (world size, degrees, the hash of the experts' placement).
    `checkpoint` names the model family, how the checkpoint stores its weights, the tokenizer served
    with it (where it came from, the sha256 of its tokenizer.json, its size; None without one) and
    what prompts are rendered with (`protocol`: the family's encoding and the deepseek-recipe version)."""
    return build_manifest(
        engine={**{k: v for k, v in asdict(llm.engine_config).items() if k != "seed"},  # seeds has it
                "cache_blocks": llm.cache.num_blocks, "step_budget": llm.max_num_batched_tokens,
                "parallel": {**llm.layout.describe(), "expert_placement": _placement(llm)}},
        checkpoint={"path": str(model) if model is not None else None, "content_hash": llm.model_id,
                    "family": llm.config.model_type, "formats": llm.stored_formats,
                    "tokenizer": llm.tokenizer.describe() if llm.tokenizer is not None else None,
                    "protocol": _protocol(llm)},
        suite=suite, seeds={"run_seed": run_seed}, variant=variant,
        environment=environment_fingerprint(), git=git_state(), engine_version=engine_version(),
    )


def _protocol(llm: LLM) -> dict:
    """What `llm` renders chat prompts with: its family's official encoding (as `ModelHost.protocol`
    takes it) and the deepseek-recipe version (None where it is not installed: it ships Linux x86-64
    wheels only, and a manifest must never be the reason a run fails)."""
    try:
        recipe = recipe_version()
    except importlib.metadata.PackageNotFoundError:
        recipe = None
    return {"encoding": llm.host.family.encoding, "recipe": recipe}


def _placement(llm: LLM) -> str | None:
    """The hash of where the experts are (None when every rank holds them all)."""
    return placement_digest(llm.expert_placements) if llm.expert_placements else None


def completed_root(run_dir: Path, manifest: dict) -> dict | None:
    """The root of the run already complete in `run_dir` (AuditError when it is another run), or None."""
    if not (Path(run_dir) / ROOT).exists():
        return None
    run = read_run(run_dir)
    _check_same_run(Path(run_dir), run.manifest, manifest)
    return run.root


def open_run(run_dir: str | Path, manifest: dict, llm: LLM, *, resume: bool = False, stats: bool = True,
             started: float | None = None) -> RunWriter:
    """A writer of a new run in `run_dir` (a new or empty folder); with `resume`, of the rest of the
    interrupted run there (or a new one when it holds none). `started` (a time.perf_counter() value,
    default now) is when this session's work began, for stats.json's wall_s."""
    run_dir = Path(run_dir)
    if resume and (run_dir / MANIFEST).exists():
        store = RunStore.resume(run_dir)
        _check_same_run(run_dir, store.manifest, manifest)
    else:
        store = RunStore.create(run_dir, manifest)
    return RunWriter(store, llm, stats=stats, started=started)


class RunWriter:
    """Rows into one open run: `served` and `refused` queue a row, `flush` (or `flush_if_due`) writes
    the queued rows as one part file, `finalize` seals the run and returns its root."""

    def __init__(self, store: RunStore, llm: LLM, *, stats: bool = True, started: float | None = None) -> None:
        self.store = store
        self.engines = [llm]  # whose counters stats.json adds up (`serving` adds a shard's engine)
        self.path = store.path
        self._started = time.perf_counter() if started is None else started
        # read before any work: a damaged stats.json stops a resumed run now, not after it
        self._stats = read_stats(self.path) if stats else None
        self._rows: list[dict] = []
        self._last_flush = time.monotonic()

    def serving(self, llm: LLM) -> None:
        """Count `llm`'s statistics too: another engine serves some of the run's requests."""
        self.engines.append(llm)

    def done(self) -> set[int]:
        """Indices the run already holds (a resumed run skips them)."""
        return self.store.done()

    def served(self, index: int, request_id: str, fields: dict, *, arrival_s: float, first_token_s: float | None,
               finish_s: float) -> dict:
        """Queue the row of a served request: `fields` are its prompt, params and stream (`make_row`'s)."""
        row = make_row(index=index, request_id=request_id, **{"error": None, **fields}, arrival_s=arrival_s,
                       first_token_s=first_token_s, finish_s=finish_s)
        self._rows.append(row)
        return row

    def refused(self, index: int, request_id: str, params: dict, error: DeepInferError) -> dict:
        """Queue the row of a request the engine refused: its error kind and detail (never where the input
        was read from, so the same refusal hashes the same from any folder)."""
        row = make_row(
            index=index, request_id=request_id, prompt_token_ids=[], params=params, token_ids=[], logprobs=[],
            top_token_ids=[], top_logprobs=[], text=None, finish_reason="error", error_kind=error.kind,
            error=error.detail, arrival_s=0.0, first_token_s=None, finish_s=0.0,
        )
        self._rows.append(row)
        return row

    def flush(self) -> None:
        """Write the queued rows as one part file (nothing when none are queued)."""
        if self._rows:
            self.store.append(self._rows)
        self._rows, self._last_flush = [], time.monotonic()

    def flush_if_due(self) -> None:
        """`flush` once FLUSH_ROWS rows are queued or FLUSH_SECONDS passed since the last one, so a run
        killed at any point keeps most of what it finished."""
        if len(self._rows) >= FLUSH_ROWS or time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self.flush()

    def finalize(self) -> dict:
        """Write the queued rows and the statistics, then streams.parquet and root.json (last); the root."""
        self.flush()
        if self._stats is not None:
            stats = dict(self._stats)
            stats["sessions"] += 1
            stats["wall_s"] += time.perf_counter() - self._started
            counters = {"preemptions": "num_preemptions", **_PREFIX_KEYS, **_SPECULATION_KEYS}
            for key, counter in counters.items():
                stats[key] += sum(getattr(llm.scheduler, counter) for llm in self.engines)
            for key, counter in _EXCHANGE_KEYS.items():
                stats[key] += sum(getattr(llm.core, counter) for llm in self.engines)
            lengths = {int(length): count for length, count in stats["verify_lengths"].items()}
            for llm in self.engines:
                for length, count in llm.scheduler.verify_lengths.items():
                    lengths[length] = lengths.get(length, 0) + count
            stats["verify_lengths"] = {str(length): lengths[length] for length in sorted(lengths)}
            atomic_write(self.path / STATS_FILE, json_bytes(stats))
        return self.store.finalize()


def read_stats(run_dir: Path) -> dict:
    """The engine statistics of earlier sessions of the run; a damaged file is a one-line AuditError."""
    path = Path(run_dir) / STATS_FILE
    if not path.exists():
        return {"sessions": 0, "wall_s": 0.0, "preemptions": 0, **dict.fromkeys(_COUNTED, 0), "verify_lengths": {}}
    try:
        stats = json.loads(path.read_bytes())
    except (OSError, ValueError):
        stats = None
    numbers = isinstance(stats, dict) and all(
        isinstance(stats.get(key), (int, float)) and not isinstance(stats.get(key), bool) for key in _STATS_KEYS)
    lengths = stats.get("verify_lengths", {}) if numbers else None
    if not numbers or not isinstance(lengths, dict) or not all(
            key.isdigit() and int(key) > 0 and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for key, n in lengths.items()):
        raise AuditError(f"{path}: not the run's statistics (a JSON object with sessions, wall_s and preemptions, "
                         "verify_lengths mapping draft counts to chunks); delete it to resume")
    return {**dict.fromkeys(_COUNTED, 0), "verify_lengths": {}, **stats}


def _check_same_run(run_dir: Path, stored: dict, wanted: dict) -> None:
    _check_same_protocol(run_dir, (stored.get("checkpoint") or {}).get("protocol"), wanted["checkpoint"]["protocol"])
    for key in _RESUMED_SECTIONS:
        if _comparable(stored.get(key)) != _comparable(wanted[key]):
            raise AuditError(f"{run_dir}: cannot resume: its {key} differs from this invocation's")


def _check_same_protocol(run_dir: Path, recorded: object, wanted: dict) -> None:
    """Rows rendered with another encoding or deepseek-recipe version are not the same run's."""
    if recorded is None:
        raise AuditError(f"{run_dir}: cannot resume: its manifest predates the record of the prompt protocol "
                         "(checkpoint.protocol); record the run again in a new folder")
    if recorded != wanted:
        raise AuditError(f"{run_dir}: cannot resume: recorded under {describe_protocol(recorded)}, this "
                         f"invocation renders prompts with {describe_protocol(wanted)}")


def _comparable(section: object) -> object:
    """A manifest section without the fields that may legitimately differ between sessions."""
    if isinstance(section, dict):
        return {k: v for k, v in section.items() if k != "path"}
    return section

