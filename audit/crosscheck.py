"""crosscheck.json: runs of one suite made on different hardware, CPU code paths, dtypes' paths or
engine releases, each request classified against the first run, sealed and verified like a certificate.

A request's class, from `compare_streams` against the first run (the reference):
- bitwise: the same token ids and the same bits of every returned logprob;
- logprob_drift: the same tokens, some logprob bits differ (bounded by the pair's max abs and max ulps
  over the chosen tokens' logprobs);
- near_tie: the tokens diverge where the top-2 logprob gap on either side is below the threshold (the
  two devices disagreed on a coin toss);
- diverged: the tokens diverge where neither side was near a tie;
- missing / error: the request is not in the other run, or it errored there or in the reference and
  not identically.

The certificate copies the runs into its folder (`runs/NAME`), so it verifies wherever it travels:
verification re-reads them, checks their files' digests and re-classifies every pair. Each run's
"where it ran" (device, CPU and its library code path, package versions, engine release and commit,
dtype and numerics) is stated, and each pair lists what differed between its two runs.
"""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

import polars as pl

from deepinfer.audit.certificate import (
    RUN_FILES,
    RUNS,
    check_sealed_fields,
    content_hash,
    cpu_isa_statement,
    digest_problems,
    read_sealed,
    run_path_problems,
    seal,
    signature_problems,
)
from deepinfer.audit.compare import compare_streams
from deepinfer.audit.errors import AuditError
from deepinfer.audit.files import atomic_write, json_bytes
from deepinfer.audit.store import Run, check_run, file_digests, read_run

CROSSCHECK_FORMAT = "deepinfer-crosscheck/1"
CROSSCHECK = "crosscheck.json"
CLASSES = ("bitwise", "logprob_drift", "near_tie", "diverged", "missing", "error")
_STATUS_CLASS = {"equal": "bitwise", "logprob_drift": "logprob_drift", "missing": "missing", "error": "error"}
_TOP_KEYS = {"format", "created", "suite", "checkpoint", "near_tie_threshold", "reference", "runs", "pairs",
             "content_hash"}
_RUN_KEYS = {"name", "run", "count", "token_root", "logit_root", "files", "where"}
_PAIR_KEYS = {"reference", "other", "requests", "classes", "max_logprob_drift", "max_logprob_ulps", "divergences",
              "differs"}


def request_classes(comparison: pl.DataFrame) -> pl.Series:
    """Each compared request's class (CLASSES), from `compare_streams`' status and near_tie."""
    return comparison.select(
        pl.when(pl.col("status") == "diverged")
        .then(pl.when(pl.col("near_tie")).then(pl.lit("near_tie")).otherwise(pl.lit("diverged")))
        .otherwise(pl.col("status").replace_strict(_STATUS_CLASS, default=None))
        .alias("class")
    )["class"]


def where_it_ran(manifest: dict) -> dict:
    """What a run's manifest says about where and how it ran, flat: the keys pairs are compared on."""
    environment = manifest.get("environment") if isinstance(manifest.get("environment"), dict) else {}
    variant = manifest.get("variant") if isinstance(manifest.get("variant"), dict) else {}
    git = manifest.get("git") if isinstance(manifest.get("git"), dict) else {}
    cuda = environment.get("cuda") if isinstance(environment.get("cuda"), dict) else {}
    torch_cpu = environment.get("torch_cpu") if isinstance(environment.get("torch_cpu"), dict) else {}
    packages = environment.get("packages") if isinstance(environment.get("packages"), dict) else {}
    on_cpu = variant.get("device") == "cpu"  # None: a run imported from another engine, which does not say
    external = manifest.get("external_engine") if isinstance(manifest.get("external_engine"), dict) else None
    return {
        "engine": (" ".join(str(v) for v in (external.get("name"), external.get("version")) if v) or None
                   if external else "deepinfer"),
        "engine_release": manifest.get("engine_version"),
        "git_commit": git.get("commit"),
        "device": variant.get("device"),
        "gpu": None if on_cpu else ", ".join(map(str, cuda.get("devices") or [])) or None,
        "cuda": None if on_cpu else cuda.get("version"),
        "nvidia_driver": None if on_cpu else cuda.get("driver"),
        "cpu": environment.get("cpu"),
        "cpu_code_path": cpu_isa_statement(manifest) if on_cpu else None,
        "cpu_kernels": torch_cpu.get("capability") if on_cpu else None,  # PyTorch's own (ATEN_CPU_CAPABILITY)
        "dtype": variant.get("dtype"),
        "numerics": variant.get("numerics"),
        "python": environment.get("python"),
        **{name: packages.get(name) for name in sorted(packages)},
    }


def pair_summary(reference: Run, other: Run, near_tie_threshold: float) -> dict:
    """The classes of `other`'s requests against `reference`, the drift bounds over both runs' common
    tokens, each divergence (request, position, both sides' top-2 gaps there) and what differed."""
    comparison = compare_streams(reference.streams, other.streams, near_tie_threshold)
    classes = request_classes(comparison)
    counts = dict.fromkeys(CLASSES, 0)
    for name, count in classes.value_counts().iter_rows():
        counts[name] += count
    diverged = comparison.with_columns(classes).filter(pl.col("class").is_in(["near_tie", "diverged"]))
    drift, ulps = comparison["max_logprob_drift"].max(), comparison["max_logprob_ulps"].max()
    a, b = where_it_ran(reference.manifest), where_it_ran(other.manifest)
    return {
        "requests": comparison.height,
        "classes": counts,
        "max_logprob_drift": float(drift) if drift is not None else 0.0,
        "max_logprob_ulps": int(ulps) if ulps is not None else 0,
        "divergences": [{"request_id": row["request_id"], "position": row["first_divergence"],
                         "gap_reference": _finite(row["margin_ref"]), "gap_other": _finite(row["margin_other"]),
                         "near_tie": row["class"] == "near_tie"} for row in diverged.iter_rows(named=True)],
        "differs": {key: [a.get(key), b.get(key)] for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)},
    }


def _finite(value: float | None) -> float | None:
    """A top-2 gap as JSON can hold it: None where there is no second token (or no number)."""
    return value if value is not None and math.isfinite(value) else None


def build_crosscheck(out_dir: str | os.PathLike, runs: list[tuple[str, str]], near_tie_threshold: float = 1e-2,
                     created: str | None = None) -> dict:
    """A sealed crosscheck of the runs (name, folder relative to `out_dir`) already in `out_dir`; the
    first is the reference. AuditError when they are not runs of one suite and one checkpoint."""
    base = Path(out_dir)
    if len(runs) < 2:
        raise AuditError("a crosscheck needs at least two runs")
    names = [name for name, _ in runs]
    if len(set(names)) != len(names):
        raise AuditError(f"run names must be unique, got {names}: name them NAME=PATH")
    read = [read_run(base / relative) for _, relative in runs]
    suite, checkpoint = _same(read, names, "suite"), _same(read, names, "checkpoint")
    entries = [{"name": name, "run": relative, "count": run.root["count"], "token_root": run.root["token_root"],
                "logit_root": run.root["logit_root"], "files": file_digests(run.path), "where": where_it_ran(run.manifest)}
               for (name, relative), run in zip(runs, read)]
    pairs = [{"reference": names[0], "other": name, **pair_summary(read[0], run, near_tie_threshold)}
             for name, run in zip(names[1:], read[1:])]
    return seal({
        "format": CROSSCHECK_FORMAT,
        "created": created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "suite": suite,
        "checkpoint": checkpoint,
        "near_tie_threshold": float(near_tie_threshold),
        "reference": names[0],
        "runs": entries,
        "pairs": pairs,
    })


def _same(runs: list[Run], names: list[str], section: str) -> dict:
    """The manifests' `section` reduced to its content hash, which every run must share: a crosscheck
    compares one suite served from one set of weights. A run imported from another engine states no
    checkpoint (`audit import`): its weights are taken on trust, and the crosscheck names the others'."""
    hashes = [(run.manifest.get(section) or {}).get("content_hash") for run in runs]
    stated = [(name, found) for name, found in zip(names, hashes) if found is not None or section == "suite"]
    for name, found in stated[1:]:
        if found != stated[0][1]:
            raise AuditError(f"run {name!r} is of {section} {found}, run {stated[0][0]!r} of {section} {stated[0][1]}: "
                             f"a crosscheck compares runs of one {section}")
    return {"content_hash": stated[0][1] if stated else None}


def write_crosscheck(out_dir: Path, crosscheck: dict) -> Path:
    """Write a sealed crosscheck atomically as OUT/crosscheck.json, in the one form it is verified in."""
    if crosscheck.get("content_hash") != content_hash(crosscheck):
        raise AuditError(f"{out_dir / CROSSCHECK}: refusing to write a crosscheck that is not sealed (or changed since)")
    atomic_write(out_dir / CROSSCHECK, json_bytes(crosscheck))
    return out_dir / CROSSCHECK


def load_crosscheck(path: str | os.PathLike) -> dict:
    """A crosscheck whose structure is valid (its seal and runs are not checked here)."""
    file = crosscheck_file(Path(path))
    _, crosscheck = read_sealed(file)
    _check_structure(crosscheck, file)
    return crosscheck


def crosscheck_file(path: Path) -> Path:
    return path / CROSSCHECK if path.is_dir() else path


def is_crosscheck(path: str | os.PathLike) -> bool:
    """Does `path` name a crosscheck (its file or folder) rather than a certificate?"""
    return crosscheck_file(Path(path)).name == CROSSCHECK and crosscheck_file(Path(path)).is_file()


def verify_crosscheck(path: str | os.PathLike, public_key_pem: bytes | None = None) -> list[str]:
    """Every problem with a crosscheck and its runs; [] when it is valid: the exact written form, the
    content hash and signature; then each run's real path, file digests, integrity and roots, and every
    pair and "where it ran" recomputed from the runs."""
    file = crosscheck_file(Path(path))
    name = file.name
    try:
        raw, crosscheck = read_sealed(file)
        _check_structure(crosscheck, file)
    except AuditError as exc:
        return [str(exc)]
    problems = []
    if raw != json_bytes(crosscheck):
        problems.append(f"{name}: not in the exact form it is written in (bytes changed after writing?)")
    if crosscheck["content_hash"] != content_hash(crosscheck):
        problems.append(f"{name}: content hash does not match its contents (edited after sealing?)")
    problems.extend(signature_problems(crosscheck, public_key_pem, name))
    if problems:
        return problems
    for entry in crosscheck["runs"]:
        problems.extend(_run_problems(entry, file.parent))
    if problems:
        return problems
    try:
        recomputed = build_crosscheck(file.parent, [(e["name"], e["run"]) for e in crosscheck["runs"]],
                                      crosscheck["near_tie_threshold"], crosscheck["created"])
    except AuditError as exc:
        return [f"{name}: {exc}"]
    for key in ("suite", "checkpoint", "runs", "pairs"):
        if len(_items(crosscheck[key])) != len(_items(recomputed[key])):
            problems.append(f"{name}: {key} holds {len(crosscheck[key])} entries, the runs give {len(recomputed[key])}")
            continue
        for stated, found in zip(_items(crosscheck[key]), _items(recomputed[key])):
            field = next((f for f in sorted(set(stated) | set(found)) if stated.get(f) != found.get(f)), None)
            if field is not None:
                problems.append(f"{name}: {key} {_label(stated)}: {field} {stated.get(field)} does not follow from "
                                f"the runs (recomputed {found.get(field)})")
    return problems


def _items(value: object) -> list:
    return value if isinstance(value, list) else [value]


def _label(item: dict) -> str:
    if "other" in item:
        return f"{item['reference']!r} vs {item['other']!r}"
    return repr(item["name"]) if "name" in item else ""


def _run_problems(entry: dict, base: Path) -> list[str]:
    linked = run_path_problems(base, entry["run"])
    if linked:
        return linked
    if not (base / entry["run"]).is_dir():
        return [f"{entry['run']}: run folder of {entry['name']!r} is missing"]
    return digest_problems(entry, base / entry["run"]) + check_run(base / entry["run"])


def _check_structure(crosscheck: object, path: Path) -> None:
    """AuditError naming `path` and the first field that does not have the crosscheck format."""

    def fail(problem: str) -> NoReturn:
        raise AuditError(f"{path}: {problem}")

    check_sealed_fields(crosscheck, path, CROSSCHECK_FORMAT, _TOP_KEYS)
    runs, pairs = crosscheck["runs"], crosscheck["pairs"]
    if not isinstance(runs, list) or len(runs) < 2 or not all(isinstance(r, dict) and set(r) == _RUN_KEYS for r in runs):
        fail(f"runs must be a list of at least two objects with exactly {', '.join(sorted(_RUN_KEYS))}")
    for entry in runs:
        relative = entry["run"]
        if not isinstance(relative, str) or not relative.startswith(f"{RUNS}/") or ".." in Path(relative).parts:
            fail(f"run {entry['name']!r}: run must be a folder under {RUNS}/ inside the crosscheck's folder")
        if not isinstance(entry["files"], dict) or set(entry["files"]) != set(RUN_FILES):
            fail(f"run {entry['name']!r}: files must map {', '.join(RUN_FILES)} to sha256 hex digests")
    if not isinstance(pairs, list) or not all(isinstance(p, dict) and set(p) == _PAIR_KEYS for p in pairs):
        fail(f"pairs must be a list of objects with exactly {', '.join(sorted(_PAIR_KEYS))}")
    for pair in pairs:
        classes = pair["classes"]
        if not isinstance(classes, dict) or set(classes) != set(CLASSES) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in classes.values()):
            fail(f"pair {_label(pair)}: classes must map {', '.join(CLASSES)} to counts")


def format_pair(pair: dict) -> str:
    """One pair in one line: every class counted, the drift bounds, and what differed."""
    c = pair["classes"]
    line = (f"{pair['reference']} vs {pair['other']}: {pair['requests']} requests: {c['bitwise']} bitwise, "
            f"{c['logprob_drift']} logprob drift (max {pair['max_logprob_drift']:.3g}, {pair['max_logprob_ulps']} "
            f"ulps), {c['near_tie']} diverged at a near-tie, {c['diverged']} diverged, {c['missing']} missing, "
            f"{c['error']} error")
    differs = "; ".join(f"{key} {a} -> {b}" for key, (a, b) in pair["differs"].items() if key != "cpu_code_path")
    if "cpu_code_path" in pair["differs"]:
        differs = "; ".join(filter(None, [differs, "the CPU code path"]))
    return line + (f"; differs: {differs}" if differs else "; nothing differed in where they ran")
