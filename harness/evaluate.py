"""lm-eval tasks run offline through `DeepInferLM` at several engine batch sizes, with a verdict on
whether the metrics and every request's stream hashes stay the same. The tasks are the shipped ones
(harness/suites/lm_eval) plus, with `include_path`, those of a user's own task folder; the runs'
manifests carry a content hash over both folders' files, so a changed task is a different suite.

    OUT/runs/batch-N/          the requests served at batch size N (an audit-store run)
    OUT/lm_eval/batch-N.json   lm-eval's results and per-sample records at batch size N
    OUT/summary.json           per batch size its metrics and roots; each compared with the first

Verdicts use `deepinfer audit certify`'s words for the same meaning, per comparison and overall (the
worst of them):
    BITWISE_REPRODUCIBLE   every metric's bits and every request's stream hash are the reference's
    TOKEN_REPRODUCIBLE     same metrics and tokens, but some logprob bits moved (certify's logprob-only drift)
    METRICS_REPRODUCIBLE   same metrics, but some request's tokens moved (or it errored differently)
    DIVERGENT              a metric moved
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

# The shipped tasks are local files: never let lm-eval or `datasets` reach for the Hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
import polars as pl  # noqa: E402
import yaml  # noqa: E402  (lm-eval's own dependency)
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import handle_non_serializable  # noqa: E402

from deepinfer.audit.certificate import BITWISE, DIVERGENT, TOKEN  # noqa: E402
from deepinfer.audit.compare import STATUSES, compare_streams  # noqa: E402
from deepinfer.audit.files import atomic_write, folder_lock, json_bytes  # noqa: E402
from deepinfer.audit.store import read_run  # noqa: E402
from deepinfer.engine.config import EngineConfig, resolve_device  # noqa: E402
from deepinfer.harness.lm_eval_model import DeepInferLM, EvalError  # noqa: E402
from deepinfer.kernels.cpu_isa import cpu_threads  # noqa: E402

SUITES = Path(__file__).parent / "suites" / "lm_eval"
SUMMARY = "summary.json"
SUMMARY_FORMAT = "deepinfer-lm-eval/2"  # 2: certify's verdict words, and a verdict per comparison
METRICS = "METRICS_REPRODUCIBLE"
VERDICTS = (BITWISE, TOKEN, METRICS, DIVERGENT)  # from best to worst
BOOTSTRAP_ITERS = 100  # our metrics have closed-form standard errors; this only caps resampling ones


def parse_batch_sizes(spec: str) -> list[int]:
    """Comma-separated batch sizes ("1,8,64") as a list: at least two distinct positive integers."""
    try:
        sizes = [int(part) for part in spec.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise EvalError(f"--batch-sizes must be comma-separated positive integers, got {spec!r}")
    if len(set(sizes)) != len(sizes):
        raise EvalError(f"--batch-sizes lists a size twice: {spec!r}")
    if len(sizes) < 2:
        raise EvalError(f"--batch-sizes needs at least two sizes to compare, got {spec!r}")
    return sizes


def include_folder(path: str | Path) -> Path:
    """A user's task folder (lm-eval's `--include_path`), absolute; one-line EvalError when it is not a folder."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise EvalError(f"include path {path}: no such folder")
    return folder.resolve()


def task_manager(include_path: Path | None = None) -> TaskManager:
    """The shipped tasks, plus those of `include_path` (an `include_folder`); not lm-eval's own tasks,
    which download their data and take seconds to index."""
    folders = [SUITES] if include_path is None else [SUITES, include_path]
    return TaskManager(include_path=[str(folder) for folder in folders], include_defaults=False)


def parse_tasks(spec: str, manager: TaskManager) -> list[str]:
    """Comma-separated names ("a,b") as a list, each a task, group or tag the manager knows."""
    tasks = [name.strip() for name in spec.split(",") if name.strip()]
    if not tasks:
        raise EvalError(f"--tasks names no task: {spec!r}")
    for name in tasks:
        if name not in manager.all_tasks:
            broken = broken_task_files(manager.include_path or [])
            why = f"; lm-eval skipped {'; '.join(broken)}" if broken else ""
            raise EvalError(f"unknown task {name!r} (known: {', '.join(manager.all_tasks)}){why}")
    return tasks


class _TaskYamlLoader(yaml.SafeLoader):
    """YAML as lm-eval's task files write it: tags such as `!function module.name` are accepted unread."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def broken_task_files(folders: Sequence[str | Path]) -> list[str]:
    """The YAML files under `folders` that do not parse, each as `file:line: problem`: lm-eval skips
    them without a word, so a task defined in one is just 'not found'."""
    broken = []
    for folder in map(Path, folders):
        for file in sorted(folder.rglob("*.yaml")):
            try:
                yaml.load(file.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)
            except (yaml.YAMLError, UnicodeDecodeError) as err:
                mark = getattr(err, "problem_mark", None)
                at = f":{mark.line + 1}" if mark is not None else ""
                problem = getattr(err, "problem", None) or str(err).splitlines()[0]
                broken.append(f"{file}{at}: not valid YAML ({problem})")
    return broken


def folder_hash(folder: Path) -> str:
    """SHA-256 over a task folder's files (paths relative to it, and bytes), recursively: YAML, data,
    Python, anything a task may read. Python's __pycache__ and dot-files are left out (they change
    without the tasks changing); the folder's own location is not hashed."""
    digest = hashlib.sha256()
    files = sorted(path.relative_to(folder) for path in folder.rglob("*") if path.is_file())
    for file in files:
        if not any(part == "__pycache__" or part.startswith(".") for part in file.parts):
            digest.update(file.as_posix().encode() + b"\0" + (folder / file).read_bytes() + b"\0")
    return digest.hexdigest()


def suite_hash(tasks: Sequence[str], limit: int | None, include_path: Path | None = None) -> str:
    """The content hash of an lm-eval suite: the shipped and the included task files, the task list and
    the limit. Runs of `evaluate` and the `lm-eval:` suite of the same tasks share it."""
    files = {"suite_files": folder_hash(SUITES)}
    if include_path is not None:
        files["include_files"] = folder_hash(include_path)
    content = json.dumps({**files, "tasks": list(tasks), "limit": limit}, sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()


def evaluate(
    tasks: Sequence[str], batch_sizes: Sequence[int], out: Path, *, model: str | None = None,
    engine: EngineConfig = EngineConfig(), limit: int | None = None, include_path: str | Path | None = None,
    threads: int | None = None,
) -> dict:
    """Run `tasks` (shipped, or from the task folder `include_path`) once per batch size into `out`
    (a new or empty folder), each an engine as `engine` says with that batch size as its `max_num_seqs`,
    with `threads` PyTorch CPU threads (None: the process's); returns the summary.

    Settings are checked before anything is written, and a start that fails before the first batch size
    is recorded removes what it wrote, so `out` can be used again. `out` is locked while this runs: a
    second evaluation into it is refused in one line and never touches what the first wrote."""
    batch_sizes = parse_batch_sizes(",".join(str(size) for size in batch_sizes))
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EvalError(f"{out}: exists and is not a folder")
    created = not out.exists()
    with folder_lock(out):
        if any(out.iterdir()):
            raise EvalError(f"{out}: the output folder must be new or empty")
        return _evaluate_into(tasks, batch_sizes, out, created, model=model, engine=engine, limit=limit,
                              include_path=include_path, threads=threads)


def _evaluate_into(tasks: Sequence[str], batch_sizes: list[int], out: Path, created: bool, *, model: str | None,
                   engine: EngineConfig, limit: int | None, include_path: str | Path | None,
                   threads: int | None) -> dict:
    """`evaluate` into the locked, empty folder `out` (`created`: made for this evaluation)."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise EvalError(f"--limit must be a positive integer, got {limit!r}")
    _check_engine(engine, threads)
    include = include_folder(include_path) if include_path is not None else None
    manager = task_manager(include)
    tasks = parse_tasks(",".join(tasks), manager)
    suite = {"kind": "lm-eval", "path": str(SUITES), "include_path": str(include) if include else None,
             "tasks": tasks, "limit": limit, "content_hash": suite_hash(tasks, limit, include)}
    runs: list[dict] = []
    try:
        with cpu_threads(threads):
            for size in batch_sizes:
                runs.append(_evaluate_at(replace(engine, max_num_seqs=size), tasks, manager, out, model=model,
                                         limit=limit, suite=suite))
    except BaseException:
        if not runs:  # a failed start: leave `out` as it was (new or empty)
            _remove_outputs(out, created)
        raise
    comparisons = [_compare(out, runs[0], run) for run in runs[1:]]
    settings = _lm_eval_settings(engine)
    del settings["batch_size"]  # each run's own
    summary = {
        "format": SUMMARY_FORMAT, "tasks": tasks, "limit": limit, "suite": suite,
        "engine": {"model": model, **settings, "threads": threads},
        "reference": runs[0]["name"], "runs": runs, "comparisons": comparisons, "verdict": _verdict(comparisons),
    }
    atomic_write(out / SUMMARY, json_bytes(summary))
    return summary


def _check_engine(engine: EngineConfig, threads: int | None) -> None:
    """One-line errors for settings the engine would refuse only after lm-eval indexed the tasks."""
    resolve_device(engine.device)
    cores = os.cpu_count() or 1
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or
                                not 1 <= threads <= cores):
        raise EvalError(f"--threads must be between 1 and this machine's {cores} CPUs, got {threads!r}")


def _lm_eval_settings(engine: EngineConfig) -> dict:
    """`engine` as `DeepInferLM`'s model_args name its fields: batch_size and run_seed."""
    settings = asdict(engine)
    return {"batch_size": settings.pop("max_num_seqs"), "run_seed": settings.pop("seed"), **settings}


def _evaluate_at(engine: EngineConfig, tasks: list[str], manager: TaskManager, out: Path, *, model: str | None,
                 suite: dict, limit: int | None) -> dict:
    """The tasks at the engine's batch size N: OUT/runs/batch-N, OUT/lm_eval/batch-N.json and its summary entry."""
    size = engine.max_num_seqs
    name = f"batch-{size}"
    lm = DeepInferLM(model=model, run_dir=out / "runs" / name, suite=suite, **_lm_eval_settings(engine))
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                      bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True)
    root = lm.finalize()
    record = {"results": results["results"], "samples": results["samples"]}
    (out / "lm_eval").mkdir(parents=True, exist_ok=True)
    atomic_write(out / "lm_eval" / f"{name}.json",
                 json.dumps(record, indent=2, sort_keys=True, default=handle_non_serializable).encode() + b"\n")
    return {"name": name, "batch_size": size, "run": f"runs/{name}", "count": root["count"],
            "token_root": root["token_root"], "logit_root": root["logit_root"],
            "metrics": _json_safe(results["results"])}


def _remove_outputs(out: Path, created: bool) -> None:
    """Remove what a failed start wrote into `out` (new or empty before it), and `out` if it made it."""
    for name in ("runs", "lm_eval"):
        if (out / name).is_dir() and not (out / name).is_symlink():
            shutil.rmtree(out / name, ignore_errors=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass


def _compare(out: Path, reference: dict, other: dict) -> dict:
    """`other` against `reference`: stream statuses per request (audit.compare) and metric by metric."""
    ref_streams = read_run(out / reference["run"]).streams
    other_streams = read_run(out / other["run"]).streams
    comparison = compare_streams(ref_streams, other_streams)
    counts = {status: int((comparison["status"] == status).sum()) for status in STATUSES}
    ref_metrics, other_metrics = reference["metrics"], other["metrics"]
    metric_differences = [
        {"task": task, "metric": metric, "reference": value, "other": other_metrics.get(task, {}).get(metric)}
        for task, metrics in ref_metrics.items() for metric, value in metrics.items()
        if _bits(value) != _bits(other_metrics.get(task, {}).get(metric))
    ]
    same_count = ref_streams.height == other_streams.height
    result = {
        "name": other["name"],
        "streams": counts,
        "streams_identical": same_count and counts["equal"] == ref_streams.height,
        "tokens_identical": same_count and counts["equal"] + counts["logprob_drift"] == ref_streams.height,
        "moved_requests": comparison.filter(pl.col("status") != "equal")["request_id"].to_list(),
        "metrics_identical": not metric_differences and ref_metrics.keys() == other_metrics.keys(),
        "metric_differences": metric_differences,
    }
    return {**result, "verdict": _comparison_verdict(result)}


def _comparison_verdict(comparison: dict) -> str:
    if not comparison["metrics_identical"]:
        return DIVERGENT
    if comparison["streams_identical"]:
        return BITWISE
    return TOKEN if comparison["tokens_identical"] else METRICS


def _verdict(comparisons: list[dict]) -> str:
    """The worst of the comparisons' verdicts."""
    return max((c["verdict"] for c in comparisons), key=VERDICTS.index)


def _bits(value: object) -> object:
    """Floats compare by their bits (lm-eval returns numpy floats too)."""
    return struct.pack("<d", value) if isinstance(value, float) else value


def _json_safe(value: object) -> object:
    """lm-eval's results as strict JSON: numpy scalars as Python numbers, non-finite floats as strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else repr(float(value))
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return _json_safe(handle_non_serializable(value))
