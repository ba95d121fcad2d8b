"""Per-sample lm-eval metrics of two runs of the same suite (two releases, two devices), compared metric
by metric: did only the numbers change, or the quality?

For each (task, metric) the samples are paired by doc id and the paired differences B - A resampled
with replacement (a paired bootstrap); the verdict is "unchanged" when every pair is bitwise equal,
"numbers changed" when some differ but the confidence interval of the mean difference contains 0, and
"quality changed" when it excludes 0.

Where our runs keep per-sample metrics (`metric_samples` reads both): `deepinfer audit eval` writes
lm-eval's per-sample records into OUT/lm_eval/batch-N.json (`{"results": ..., "samples": {task: [record,
...]}}`); `deepinfer lm-eval ... --output_path OUT --log_samples` leaves lm-eval's own files,
OUT/<model>/results_<date>.json and one OUT/<model>/samples_<task>_<date>.jsonl per task (a record a
line). Either record holds `doc_id`, `filter`, `metrics` (the metric names) and each metric's value under
its name. Certification runs of an `lm-eval:` suite score nothing: they keep streams, no metrics.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deepinfer.audit.errors import AuditError

# (task, metric) -> doc id -> value; metrics are named as lm-eval's results name them: "acc,none"
Samples = Mapping[tuple[str, str], Mapping[int, float]]

UNCHANGED, NUMBERS_CHANGED, QUALITY_CHANGED = "unchanged", "numbers changed", "quality changed"
SAMPLES_FILE = re.compile(r"samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?)\.jsonl")
CHUNK = 1 << 22  # resampled values held at once (32 MiB of float64)


@dataclass(frozen=True)
class MetricDelta:
    """One metric of one task, B against A: means, delta = B - A (the mean paired difference), its
    bootstrap confidence interval, how many samples changed (bitwise), moved up and down, and the verdict."""

    task: str
    metric: str
    n: int
    mean_a: float
    mean_b: float
    delta: float
    ci_low: float
    ci_high: float
    confidence: float
    changed: int
    increased: int
    decreased: int
    verdict: str


def metric_deltas(a: Samples, b: Samples, *, resamples: int = 10_000, confidence: float = 0.95,
                  seed: int = 0) -> list[MetricDelta]:
    """Each (task, metric) of runs A and B compared, sorted by task and metric. Samples are taken in
    doc id order and each metric's bootstrap starts from `seed`, so a result does not depend on the
    order records were written in or on which other metrics are compared. One-line AuditError for
    empty input, different tasks, metrics or samples, and values that are not finite numbers."""
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise AuditError(f"resamples must be a positive integer, got {resamples!r}")
    if not 0 < confidence < 1:
        raise AuditError(f"confidence must be between 0 and 1, got {confidence!r}")
    _check_keys(a, b)
    rows = []
    for task, metric in sorted(a):
        name = f"{task}/{metric}"
        docs_a, docs_b = a[task, metric], b[task, metric]
        _check_docs(name, docs_a, docs_b)
        docs = sorted(docs_a)
        values_a, values_b = _values(name, "A", docs_a, docs), _values(name, "B", docs_b, docs)
        diffs = values_b - values_a
        changed = int((values_a.view(np.uint64) != values_b.view(np.uint64)).sum())
        low, high = bootstrap_ci(diffs, resamples, confidence, seed) if changed else (0.0, 0.0)
        verdict = UNCHANGED if not changed else NUMBERS_CHANGED if low <= 0 <= high else QUALITY_CHANGED
        rows.append(MetricDelta(task, metric, len(docs), float(values_a.mean()), float(values_b.mean()),
                                float(diffs.mean()), low, high, confidence, changed,
                                int((diffs > 0).sum()), int((diffs < 0).sum()), verdict))
    return rows


def bootstrap_ci(diffs: np.ndarray, resamples: int, confidence: float, seed: int) -> tuple[float, float]:
    """Percentile interval of the mean of `diffs` over `resamples` resamples with replacement.

    Resample r takes the indices floor(n * u) of n uniform doubles u, drawn in order from
    `np.random.default_rng(seed)`: unlike `Generator.integers` (which buffers 32-bit halves within one
    call), that gives the same indices whether the resamples are drawn one by one or in blocks."""
    n = diffs.size
    means = np.empty(resamples)
    block = max(1, CHUNK // n)
    rng = np.random.default_rng(seed)
    for start in range(0, resamples, block):
        draws = rng.random((min(block, resamples - start), n))
        draws *= n
        picks = np.minimum(draws.astype(np.intp), n - 1)  # n * u may round up to n
        means[start:start + len(picks)] = diffs[picks].mean(axis=1)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def per_sample(samples: Mapping[tuple[str, str], Mapping[int, object]]) -> tuple[dict, list[str]]:
    """The metrics scored as one number per sample, and the names ("task/metric") of the others: those
    lm-eval aggregates over the whole corpus (a perplexity's [loglikelihood, weight] pairs, BLEU's
    references), whose per-sample values cannot be paired as numbers."""
    numeric = {key: docs for key, docs in samples.items()
               if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in docs.values())}
    return numeric, [f"{task}/{metric}" for task, metric in sorted(set(samples) - set(numeric))]


def format_metric_deltas(rows: Sequence[MetricDelta]) -> str:
    """One line per row: `task/metric: A 0.512 -> B 0.530 (delta +0.018, 95% CI [+0.004, +0.031], n=400):
    quality changed`."""
    return "\n".join(
        f"{row.task}/{row.metric}: A {row.mean_a:.3f} -> B {row.mean_b:.3f} (delta {row.delta:+.3f}, "
        f"{row.confidence * 100:g}% CI [{row.ci_low:+.3f}, {row.ci_high:+.3f}], n={row.n}): {row.verdict}"
        for row in rows
    )


def metric_samples(path: str | Path) -> dict[tuple[str, str], dict[int, object]]:
    """One lm-eval run's per-sample metric values by (task, "metric,filter") and doc id, as recorded
    (a metric lm-eval aggregates over the corpus, such as a perplexity, holds a list per sample).

    `path` is `deepinfer audit eval`'s OUT folder (its reference batch size is read) or one of its
    OUT/lm_eval/batch-N.json; or `deepinfer lm-eval --log_samples`'s output folder (OUT or OUT/<model>)
    holding one run's samples_<task>_<date>.jsonl, or that run's results_<date>.json."""
    path = Path(path)
    if path.is_dir() and (path / "summary.json").is_file():
        summary = _read_json(path / "summary.json")
        reference = summary.get("reference") if isinstance(summary, dict) else None
        if not isinstance(reference, str):
            raise AuditError(f"{path / 'summary.json'}: names no reference run")
        path = path / "lm_eval" / f"{reference}.json"
    if path.is_dir():
        return _by_metric(_jsonl_samples(path, None), path)
    if path.name.startswith("results_") and path.suffix == ".json":
        return _by_metric(_jsonl_samples(path.parent, path.stem.removeprefix("results_")), path)
    record = _read_json(path)
    samples = record.get("samples") if isinstance(record, dict) else None
    if not isinstance(samples, dict):
        raise AuditError(f"{path}: no per-sample records (a 'samples' object, as in deepinfer audit eval's "
                         f"OUT/lm_eval/batch-N.json)")
    return _by_metric(samples, path)


def _check_keys(a: Samples, b: Samples) -> None:
    if not a or not b:
        empty = " and ".join(side for side, samples in (("A", a), ("B", b)) if not samples)
        raise AuditError(f"no per-sample metrics to compare: {empty} {'is' if len(empty) == 1 else 'are'} empty")
    tasks_a, tasks_b = {task for task, _ in a}, {task for task, _ in b}
    if tasks_a != tasks_b:
        raise AuditError(f"different tasks: {_only(tasks_a, tasks_b)}")
    if a.keys() != b.keys():
        names_a, names_b = ({f"{task}/{metric}" for task, metric in side} for side in (a, b))
        raise AuditError(f"different metrics: {_only(names_a, names_b)}")


def _only(a: set, b: set) -> str:
    return "; ".join(f"only in {side}: {', '.join(map(str, sorted(only))) or 'none'}"
                     for side, only in (("A", a - b), ("B", b - a)))


def _check_docs(name: str, docs_a: Mapping, docs_b: Mapping) -> None:
    if not docs_a and not docs_b:
        raise AuditError(f"{name}: no samples to compare")
    sides = [(side, sorted(docs.keys() - other.keys()))
             for side, docs, other in (("A", docs_a, docs_b), ("B", docs_b, docs_a))]
    if any(only for _, only in sides):
        raise AuditError(f"{name}: different samples: " + ", ".join(
            f"{len(only)} only in {side} (first: doc {only[0]})" for side, only in sides if only))


def _values(name: str, side: str, docs: Mapping, order: list) -> np.ndarray:
    for doc in order:
        value = docs[doc]
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise AuditError(f"{name}: doc {doc} in {side} is not a finite number: {value!r}")
    return np.array([docs[doc] for doc in order], dtype=np.float64)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AuditError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AuditError(f"{path}: not readable JSON ({err})") from None


def _jsonl_samples(folder: Path, date: str | None) -> dict[str, list]:
    """The samples_<task>_<date>.jsonl files of one lm-eval run in `folder` or its subfolders (lm-eval
    writes them under OUT/<model>/), by task; `date` picks the run, None asks for exactly one."""
    runs: dict[tuple[Path, str], dict[str, Path]] = {}
    for file in sorted([*folder.glob("samples_*.jsonl"), *folder.glob("*/samples_*.jsonl")]):
        match = SAMPLES_FILE.fullmatch(file.name)
        if match and date in (None, match["date"]):
            runs.setdefault((file.parent, match["date"]), {})[match["task"]] = file
    if not runs:
        wanted = f"samples_<task>_{date}.jsonl" if date else "samples_<task>_<date>.jsonl"
        raise AuditError(f"{folder}: no lm-eval per-sample files ({wanted}, written with --log_samples)")
    if len(runs) > 1:
        found = ", ".join(str(parent.relative_to(folder) / f"results_{day}.json") for parent, day in runs)
        raise AuditError(f"{folder}: holds {len(runs)} lm-eval runs' samples; give one's results file: {found}")
    [files] = runs.values()
    samples = {}
    for task, file in files.items():
        try:
            samples[task] = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise AuditError(f"{file}: not readable JSON lines ({err})") from None
    return samples


def _by_metric(samples: Mapping[str, list], source: Path) -> dict[tuple[str, str], dict[int, object]]:
    """lm-eval's per-sample records (`doc_id`, `filter`, `metrics` and a value per metric) by metric."""
    values: dict[tuple[str, str], dict[int, object]] = {}
    for task, records in samples.items():
        for record in records:
            try:
                doc, names, filter_name = record["doc_id"], record["metrics"], record["filter"]
                for metric in names:
                    docs = values.setdefault((task, f"{metric},{filter_name}"), {})
                    if doc in docs:
                        raise AuditError(f"{source}: {task}/{metric},{filter_name}: doc {doc} recorded twice")
                    docs[doc] = record[metric]
            except KeyError as err:
                raise AuditError(f"{source}: task {task}: a sample record lacks {err}") from None
            except TypeError:
                raise AuditError(f"{source}: task {task}: a sample record is not lm-eval's "
                                 f"(doc_id, filter, metrics and each metric's value)") from None
    return values
