"""The run folder: incremental, crash-safe writing of stream rows and reading/checking a finished run.

    RUN/manifest.json        written once at create
    RUN/parts/part-NNNNNN.parquet
                             one per append(); each written to a tmp file, fsynced, renamed
    RUN/streams.parquet      at finalize: all parts, sorted by index, duplicates collapsed
    RUN/root.json            at finalize, last; its presence marks the run complete

A writer killed at any point leaves only complete part files (plus stray *.tmp files, which resume
removes), so a resumed run appends what is missing and reaches the same root as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import operator
import os
import re
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from deepinfer.audit.errors import AuditError
from deepinfer.audit.files import atomic_write, fsync_dir, json_bytes
from deepinfer.audit.streams import (
    HEX_DIGEST,
    RUN_FORMAT,
    STREAM_SCHEMA,
    StreamHashes,
    canonical_json,
    error_hashes,
    fp32_bits,
    run_root,
    stream_hashes,
)

MANIFEST = "manifest.json"
STREAMS = "streams.parquet"
ROOT = "root.json"
STATS = "stats.json"  # the engine's own counters for a run (harness.run_writer): not covered by its roots
PARTS = "parts"
TIMING_COLUMNS = ("arrival_s", "first_token_s", "finish_s")
NULLABLE_COLUMNS = frozenset({"text", "error_kind", "error", "first_token_s"})
_PART_NAME = re.compile(r"part-(\d{6,})\.parquet")


def _parquet_bytes(frame: pl.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.write_parquet(buffer)
    return buffer.getvalue()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _read_parquet(file: Path, columns: list[str] | None = None) -> pl.DataFrame:
    if not file.is_file():
        raise AuditError(f"{file}: missing")
    try:
        return pl.read_parquet(file, columns=columns)
    except (Exception, pl.exceptions.PanicException) as exc:  # a corrupt file can make the reader panic
        raise AuditError(f"{file}: not a readable parquet file ({_first_line(exc)})") from None


def _read_json_object(file: Path, missing: str) -> dict:
    if not file.is_file():
        raise AuditError(f"{file}: {missing}")
    try:
        obj = json.loads(file.read_bytes())
    except (OSError, ValueError) as exc:
        raise AuditError(f"{file}: not valid JSON ({_first_line(exc)})") from None
    if not isinstance(obj, dict):
        raise AuditError(f"{file}: not a JSON object")
    return obj


def _check_frame(frame: pl.DataFrame, where: Path) -> pl.DataFrame:
    """The frame with exactly STREAM_SCHEMA's columns, dtypes and order, and no nulls where none belong."""
    missing = [name for name in STREAM_SCHEMA if name not in frame.columns]
    if missing:
        raise AuditError(f"{where}: missing column(s) {', '.join(map(repr, missing))}")
    extra = [name for name in frame.columns if name not in STREAM_SCHEMA]
    if extra:
        raise AuditError(f"{where}: unexpected column(s) {', '.join(map(repr, extra))}")
    for name, dtype in STREAM_SCHEMA.items():
        if frame.schema[name] != dtype:
            raise AuditError(f"{where}: column {name!r} has dtype {frame.schema[name]}, expected {dtype}")
        if name not in NULLABLE_COLUMNS and frame[name].null_count():
            raise AuditError(f"{where}: column {name!r} has {frame[name].null_count()} null value(s)")
    return frame.select(list(STREAM_SCHEMA))


def _expected_hashes(row: dict) -> StreamHashes:
    """Validate one row's data and hash it; the hash columns of `row` are not read."""
    try:
        params = json.loads(row["params"])
    except ValueError:
        raise AuditError("params is not valid JSON") from None
    if not isinstance(params, dict):
        raise AuditError("params is not a JSON object")
    if canonical_json(params).decode("utf-8") != row["params"]:
        raise AuditError("params is not canonical JSON")
    count = len(row["token_ids"])
    lengths = (len(row["logprobs"]), len(row["top_token_ids"]), len(row["top_logprobs"]))
    if lengths != (count,) * 3:
        raise AuditError(f"{count} token ids but {lengths[0]} logprobs, {lengths[1]} top_token_ids "
                         f"and {lengths[2]} top_logprobs")
    for position, (top_ids, top_values) in enumerate(zip(row["top_token_ids"], row["top_logprobs"])):
        if len(top_ids) != len(top_values):
            raise AuditError(f"position {position}: {len(top_ids)} top_token_ids but {len(top_values)} top_logprobs")
        for value in top_values:
            fp32_bits(value, f"top logprob at position {position}")
    error, kind, reason = row["error"], row["error_kind"], row["finish_reason"]
    if (error is None) != (kind is None):
        raise AuditError("error and error_kind must be set together")
    if error is not None:
        if reason != "error":
            raise AuditError(f"has an error but finish_reason {reason!r} (expected 'error')")
        if count:
            raise AuditError(f"an error row must have no generated tokens, it has {count}")
        return error_hashes(row["prompt_token_ids"], params, kind, error)
    if reason == "error":
        raise AuditError("finish_reason 'error' without an error message")
    return stream_hashes(row["prompt_token_ids"], params, row["token_ids"], row["logprobs"], reason)


_HASH_SUBJECTS = (("prompt_hash", "prompt/params"), ("token_hash", "tokens"), ("logit_hash", "tokens/logprobs"))


_NESTED = tuple(name for name, dtype in STREAM_SCHEMA.items() if isinstance(getattr(dtype, "inner", None), pl.List))


def _rows_frame(rows: list[dict]) -> pl.DataFrame:
    """Rows as a frame of STREAM_SCHEMA. Polars builds list-of-list columns from Python objects one
    Series per inner list (about 1 ms per row); those columns go through JSON instead, which is exact
    for finite numbers (an fp32 value prints as a round-trip float64 decimal). Rows holding a
    non-finite number there take the slow exact path."""
    flat_schema = {name: dtype for name, dtype in STREAM_SCHEMA.items() if name not in _NESTED}
    frame = pl.from_dicts([{name: row[name] for name in flat_schema} for row in rows], schema=flat_schema)
    columns = []
    for name in _NESTED:
        values = [row[name] for row in rows]
        if all(math.isfinite(x) for row in values for inner in row for x in inner):
            column = pl.Series(name, [json.dumps(v) for v in values]).str.json_decode(STREAM_SCHEMA[name])
        else:
            column = pl.Series(name, values, dtype=STREAM_SCHEMA[name])
        columns.append(column)
    return frame.with_columns(columns).select(list(STREAM_SCHEMA))


def _row_problems(frame: pl.DataFrame, where: Path) -> list[str]:
    """One message per row whose hashes do not match its data, and per request id given to two indices."""
    return _hash_problems(frame, where) + _shared_id_problems(frame, where)


def _hash_problems(frame: pl.DataFrame, where: Path) -> list[str]:
    problems = []
    for row in frame.iter_rows(named=True):
        request = f"request {row['request_id']!r}"
        try:
            expected = _expected_hashes(row)
        except (AuditError, TypeError) as exc:  # TypeError: a null inside a list of a tampered file
            problems.append(f"{where}: {request}: {exc}")
            continue
        for column, subject in _HASH_SUBJECTS:
            if getattr(expected, column) != row[column]:
                problems.append(f"{where}: {request} {column} does not match its {subject}")
    return problems


def _shared_id_problems(frame: pl.DataFrame, where: Path) -> list[str]:
    shared = (frame.group_by("request_id", maintain_order=True).agg(pl.col("index").n_unique())
              .filter(pl.col("index") > 1)["request_id"])
    return [f"{where}: request id {request_id!r} is used by more than one index" for request_id in shared.to_list()]


def _raise_first(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise AuditError(problems[0] + more)


def _content_key(value: object) -> object:
    """A comparable form of a cell in which floats compare by their bits (so -0.0 != 0.0)."""
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, list):
        return tuple(_content_key(item) for item in value)
    return value


def _collapse_duplicates(frame: pl.DataFrame, where: Path) -> pl.DataFrame:
    """Keep the first row of each index; rows for one index may differ only in their timing columns."""
    content = [name for name in STREAM_SCHEMA if name not in TIMING_COLUMNS]
    first: dict[int, object] = {}
    for row in frame.filter(pl.col("index").is_duplicated()).select(content).iter_rows(named=True):
        key = _content_key([row[name] for name in content])
        if first.setdefault(row["index"], key) != key:
            raise AuditError(f"{where}: request index {row['index']} ({row['request_id']!r}) "
                             "was stored twice with different content")
    return frame.unique(subset=["index"], keep="first", maintain_order=True)


def _part_files(parts: Path) -> list[tuple[int, Path]]:
    found = []
    for file in parts.iterdir():
        match = _PART_NAME.fullmatch(file.name)
        if match:
            found.append((int(match.group(1)), file))
    return sorted(found)


def _ints(values: Sequence[int], what: str) -> list[int]:
    try:
        return [operator.index(value) for value in values]
    except TypeError:
        raise AuditError(f"{what} must be integers") from None


def make_row(index: int, request_id: str, prompt_token_ids: Sequence[int], params: dict,
             token_ids: Sequence[int], logprobs: Sequence[float], top_token_ids: Sequence[Sequence[int]],
             top_logprobs: Sequence[Sequence[float]], text: str | None, finish_reason: str, error: str | None,
             arrival_s: float, first_token_s: float | None, finish_s: float, error_kind: str | None = None) -> dict:
    """One streams.parquet row with its hashes; AuditError (naming the request) on inconsistent data.
    An error row gives both `error_kind` and `error` (the detail, without file paths)."""
    if not isinstance(request_id, str):
        raise AuditError(f"request id must be a string, got {request_id!r}")
    try:
        index = operator.index(index)
        if index < 0:
            raise AuditError(f"index must be >= 0, got {index}")
        row = {
            "index": index,
            "request_id": request_id,
            "prompt_token_ids": _ints(prompt_token_ids, "prompt_token_ids"),
            "params": canonical_json(params).decode("utf-8"),
            "prompt_hash": "",
            "token_ids": _ints(token_ids, "token_ids"),
            "logprobs": [float(value) for value in logprobs],
            "top_token_ids": [_ints(ids, "top_token_ids") for ids in top_token_ids],
            "top_logprobs": [[float(value) for value in values] for values in top_logprobs],
            "text": text,
            "finish_reason": finish_reason,
            "error_kind": error_kind,
            "error": error,
            "token_hash": "",
            "logit_hash": "",
            "arrival_s": float(arrival_s),
            "first_token_s": None if first_token_s is None else float(first_token_s),
            "finish_s": float(finish_s),
        }
        hashes = _expected_hashes(row)
    except (AuditError, TypeError, ValueError) as exc:
        raise AuditError(f"request {request_id!r}: {exc}") from None
    row.update(prompt_hash=hashes.prompt_hash, token_hash=hashes.token_hash, logit_hash=hashes.logit_hash)
    return row


class RunStore:
    """Writer of one run folder; obtain it with `create` or `resume`."""

    def __init__(self, path: Path, manifest: dict, done: set[int], next_part: int) -> None:
        self.path = path
        self.manifest = manifest
        self._done = done
        self._next_part = next_part
        self._checked: set[str] = set()  # part files this writer validated before writing them
        self._complete = False

    @classmethod
    def create(cls, path: str | os.PathLike, manifest: dict) -> RunStore:
        """Start a run in a new or empty folder."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise AuditError(f"{path}: cannot create a run: it exists and is not a folder")
        if path.is_dir() and any(path.iterdir()):
            raise AuditError(f"{path}: cannot create a run: the folder is not empty")
        if not isinstance(manifest, dict):
            raise AuditError(f"{path / MANIFEST}: the manifest must be a dict, got {type(manifest).__name__}")
        try:
            data = json_bytes(manifest)
        except (TypeError, ValueError) as exc:
            raise AuditError(f"{path / MANIFEST}: the manifest is not JSON-serializable ({exc})") from None
        path.mkdir(parents=True, exist_ok=True)
        fsync_dir(path.parent)
        atomic_write(path / MANIFEST, data)  # first, so a kill at any later point leaves a resumable run
        (path / PARTS).mkdir()
        return cls(path, json.loads(data), set(), 1)

    @classmethod
    def resume(cls, path: str | os.PathLike) -> RunStore:
        """Reopen an interrupted run: drop half-written tmp files, learn which indices are stored."""
        path = Path(path)
        if not (path / MANIFEST).is_file():
            raise AuditError(f"{path}: not a run folder (no {MANIFEST})")
        if (path / ROOT).exists():
            raise AuditError(f"{path}: the run is already complete ({ROOT} exists)")
        manifest = _read_json_object(path / MANIFEST, "missing")
        parts = path / PARTS
        parts.mkdir(exist_ok=True)
        for stale in [*parts.glob("*.tmp"), *path.glob("*.tmp")]:
            stale.unlink()
        done: set[int] = set()
        numbers = [0]
        for number, file in _part_files(parts):
            numbers.append(number)
            done.update(_read_parquet(file, columns=["index"])["index"].to_list())
        return cls(path, manifest, done, max(numbers) + 1)

    def done(self) -> set[int]:
        """Indices already stored (a resumed harness skips them)."""
        return set(self._done)

    def _check_open(self) -> None:
        if self._complete:
            raise AuditError(f"{self.path}: the run is already complete ({ROOT} exists)")

    def append(self, rows: list[dict]) -> None:
        """Store rows (from make_row) as one new part file; an empty list writes nothing."""
        self._check_open()
        if not rows:
            return
        file = self.path / PARTS / f"part-{self._next_part:06d}.parquet"
        for number, row in enumerate(rows):
            if not isinstance(row, dict) or set(row) != set(STREAM_SCHEMA):
                raise AuditError(f"{file}: row {number} does not have exactly the stream columns")
        try:
            frame = _rows_frame(rows)
        except (Exception, pl.exceptions.PanicException) as exc:
            raise AuditError(f"{file}: rows do not fit the stream schema ({_first_line(exc)})") from None
        frame = _check_frame(frame, file)
        _raise_first(_row_problems(frame, file))
        atomic_write(file, _parquet_bytes(frame))
        self._checked.add(file.name)
        self._next_part += 1
        self._done.update(frame["index"].to_list())

    def finalize(self) -> dict:
        """Merge the parts into streams.parquet, then write root.json (last) and return it."""
        self._check_open()
        parts = self.path / PARTS
        files = [file for _, file in _part_files(parts)]
        frames = [_check_frame(_read_parquet(file), file) for file in files]
        for file, frame in zip(files, frames):
            if file.name not in self._checked:  # parts of an earlier session: re-check their hashes
                _raise_first(_hash_problems(frame, file))
        merged = pl.concat(frames) if frames else pl.DataFrame(schema=STREAM_SCHEMA)
        merged = _collapse_duplicates(merged.sort("index", maintain_order=True), parts)
        _raise_first(_shared_id_problems(merged, parts))
        root = run_root(merged)
        atomic_write(self.path / STREAMS, _parquet_bytes(merged))
        atomic_write(self.path / ROOT, json_bytes(root))
        shutil.rmtree(parts)
        fsync_dir(self.path)
        self._complete = True
        return root


@dataclass
class Run:
    """A finished run as read from its folder."""

    path: Path
    manifest: dict
    streams: pl.DataFrame
    root: dict


def _check_root_fields(root: dict, file: Path) -> None:
    if set(root) != {"format", "count", "token_root", "logit_root"}:
        raise AuditError(f"{file}: keys must be format, count, token_root, logit_root; got {sorted(root)}")
    if root["format"] != RUN_FORMAT:
        raise AuditError(f"{file}: format {root['format']!r} is not {RUN_FORMAT!r}")
    if not isinstance(root["count"], int) or isinstance(root["count"], bool) or root["count"] < 0:
        raise AuditError(f"{file}: count {root['count']!r} is not a non-negative integer")
    for key in ("token_root", "logit_root"):
        if not isinstance(root[key], str) or not HEX_DIGEST.fullmatch(root[key]):
            raise AuditError(f"{file}: {key} is not 64 lower-case hex digits")


def _load(path: Path) -> Run:
    """Read the three files and check their structure (not the hashes)."""
    manifest = _read_json_object(path / MANIFEST, "missing")
    root = _read_json_object(path / ROOT, "missing (the run was not finalized)")
    _check_root_fields(root, path / ROOT)
    streams = _check_frame(_read_parquet(path / STREAMS), path / STREAMS)
    index = streams["index"]
    if index.len() > 1 and not (index.diff().drop_nulls() > 0).all():
        raise AuditError(f"{path / STREAMS}: rows are not in strictly increasing index order")
    return Run(path, manifest, streams, root)


def _root_problems(run: Run) -> list[str]:
    computed = run_root(run.streams)
    root_file, streams_file = run.path / ROOT, run.path / STREAMS
    problems = []
    if run.root["count"] != computed["count"]:
        problems.append(f"{root_file}: count {run.root['count']} does not match the "
                        f"{computed['count']} rows of {streams_file}")
    problems.extend(f"{root_file}: {key} does not match the rows of {streams_file}"
                    for key in ("token_root", "logit_root") if run.root[key] != computed[key])
    return problems


def read_stats(path: str | os.PathLike) -> dict | None:
    """A run folder's stats.json as written (the engine's counters); None when absent or not a JSON object."""
    try:
        stats = json.loads((Path(path) / STATS).read_bytes())
    except (OSError, ValueError):
        return None
    return stats if isinstance(stats, dict) else None


def read_run(path: str | os.PathLike) -> Run:
    """A finished run whose files are well-formed and whose root matches its stored hashes.

    Row hashes are not recomputed here (check_run does that), so reading stays cheap.
    """
    run = _load(Path(path))
    _raise_first(_root_problems(run))
    return run


def check_run(path: str | os.PathLike) -> list[str]:
    """Every problem found by recomputing each row's hashes from its data and the Merkle roots; [] if intact."""
    try:
        run = _load(Path(path))
    except AuditError as exc:
        return [str(exc)]
    return _row_problems(run.streams, run.path / STREAMS) + _root_problems(run)


def file_digests(path: str | os.PathLike) -> dict[str, str]:
    """SHA-256 of each file of a finished run, as recorded in certificates."""
    digests = {}
    for name in (MANIFEST, STREAMS, ROOT):
        file = Path(path) / name
        if not file.is_file():
            raise AuditError(f"{file}: missing")
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digests[name] = digest.hexdigest()
    return digests
