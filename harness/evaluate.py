"""lm-eval tasks run offline through `DeepInferLM` at several engine batch sizes, with a verdict on
whether the metrics and every request's stream hashes stay the same. The tasks are the shipped ones
(harness/suites/lm_eval) plus, with `include_path`, those of a user's own task folder; the runs'
manifests carry a content hash over both folders' files, so a changed task is a different suite.

    OUT/runs/batch-N/          the requests served at batch size N (an audit-store run)
    OUT/lm_eval/batch-N.json   lm-eval's results and per-sample records at batch size N
    OUT/summary.json           per batch size its metrics and roots; each compared with the first

Verdicts: IDENTICAL (metrics and every stream hash), METRICS_IDENTICAL (same metrics, but some
stream's tokens or logprob bits moved), DIFFERENT (a metric moved).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

# The shipped tasks are local files: never let lm-eval or `datasets` reach for the Hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
import polars as pl  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import handle_non_serializable  # noqa: E402

from audit.compare import STATUSES, compare_streams  # noqa: E402
from audit.files import atomic_write, json_bytes  # noqa: E402
from audit.store import read_run  # noqa: E402
from harness.lm_eval_model import DeepInferLM, EvalError  # noqa: E402

SUITES = Path(__file__).parent / "suites" / "lm_eval"
SUMMARY = "summary.json"
SUMMARY_FORMAT = "deepinfer-lm-eval/1"
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
            raise EvalError(f"unknown task {name!r} (known: {', '.join(manager.all_tasks)})")
    return tasks


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
    numerics: str = "batch_invariant", dtype: str = "float32", device: str = "cpu", limit: int | None = None,
    run_seed: int = 0, max_model_len: int | None = None, include_path: str | Path | None = None,
) -> dict:
    """Run `tasks` (shipped, or from the task folder `include_path`) once per batch size into `out`
    (a new or empty folder); returns the summary."""
    batch_sizes = parse_batch_sizes(",".join(str(size) for size in batch_sizes))
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvalError(f"{out}: the output folder must be new or empty")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise EvalError(f"--limit must be a positive integer, got {limit!r}")
    include = include_folder(include_path) if include_path is not None else None
    manager = task_manager(include)
    tasks = parse_tasks(",".join(tasks), manager)
    suite = {"kind": "lm-eval", "path": str(SUITES), "include_path": str(include) if include else None,
             "tasks": tasks, "limit": limit, "content_hash": suite_hash(tasks, limit, include)}
    (out / "lm_eval").mkdir(parents=True, exist_ok=True)
    runs = []
    for size in batch_sizes:
        name = f"batch-{size}"
        lm = DeepInferLM(model=model, numerics=numerics, dtype=dtype, device=device, batch_size=size,
                         max_model_len=max_model_len, run_seed=run_seed, run_dir=out / "runs" / name, suite=suite)
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                          bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True)
        root = lm.finalize()
        record = {"results": results["results"], "samples": results["samples"]}
        atomic_write(out / "lm_eval" / f"{name}.json",
                     json.dumps(record, indent=2, sort_keys=True, default=handle_non_serializable).encode() + b"\n")
        runs.append({"name": name, "batch_size": size, "run": f"runs/{name}", "count": root["count"],
                     "token_root": root["token_root"], "logit_root": root["logit_root"],
                     "metrics": _json_safe(results["results"])})
    comparisons = [_compare(out, runs[0], run) for run in runs[1:]]
    summary = {
        "format": SUMMARY_FORMAT, "tasks": tasks, "limit": limit, "suite": suite,
        "engine": {"model": model, "numerics": numerics, "dtype": dtype, "device": device,
                   "max_model_len": max_model_len, "run_seed": run_seed},
        "reference": runs[0]["name"], "runs": runs, "comparisons": comparisons, "verdict": _verdict(comparisons),
    }
    atomic_write(out / SUMMARY, json_bytes(summary))
    return summary


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
    return {
        "name": other["name"],
        "streams": counts,
        "streams_identical": counts["equal"] == ref_streams.height == other_streams.height,
        "moved_requests": comparison.filter(pl.col("status") != "equal")["request_id"].to_list(),
        "metrics_identical": not metric_differences and ref_metrics.keys() == other_metrics.keys(),
        "metric_differences": metric_differences,
    }


def _verdict(comparisons: list[dict]) -> str:
    if not all(c["metrics_identical"] for c in comparisons):
        return "DIFFERENT"
    return "IDENTICAL" if all(c["streams_identical"] for c in comparisons) else "METRICS_IDENTICAL"


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
