"""Tests for audit.store (the run folder), audit.manifest and harness.environment.

The store's promise: rows appended in any split, with duplicates, across crashes and resumes, finalize
to the same streams.parquet content and root as one uninterrupted run; fp32 logprob bits survive;
check_run finds tampering with anything the hashes cover.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.audit.errors import AuditError
from deepinfer.audit.manifest import build_manifest
from deepinfer.audit.store import RunStore, check_run, file_digests, make_row, read_run
from deepinfer.audit.streams import STREAM_SCHEMA, merkle_root
from deepinfer.harness.environment import NVIDIA_DRIVER_VERSION, engine_version, environment_fingerprint, git_state

REPO = Path(__file__).resolve().parent.parent
HASHED = ["index", "request_id", "prompt_token_ids", "params", "prompt_hash", "token_ids", "logprobs",
          "finish_reason", "error_kind", "error", "token_hash", "logit_hash"]
SPECIAL_BITS = [0x80000000, 0x00000000, 0x80000001, 0x807FFFFF, 0xFF7FFFFF, 0xBF800000]


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bits_of(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def spec(i: int) -> dict:
    """Deterministic make_row arguments for request i (error rows, special logprobs, non-ASCII text)."""
    n = i % 4
    logprobs = [f32(SPECIAL_BITS[(2 * i + k) % len(SPECIAL_BITS)]) for k in range(n)]
    error = f"out of memory ✗ {i}" if i % 7 == 3 else None
    return {
        "index": i, "request_id": f"req-{i:03d}-ü", "prompt_token_ids": [i, i + 1, 2**32 - 1],
        "params": {"seed": i, "temperature": 0.5, "max_tokens": 3},
        "token_ids": [] if error else [i * 7 + k for k in range(n)],
        "logprobs": [] if error else logprobs,
        "top_token_ids": [] if error else [[i * 7 + k, 1] for k in range(n)],
        "top_logprobs": [] if error else [[x, f32(0xC2000000)] for x in logprobs],
        "text": None if error or n == 0 else "x" * n,
        "finish_reason": "error" if error else ("stop" if n % 2 else "length"), "error": error,
        "error_kind": "invalid_request" if error else None,
        "arrival_s": 0.25 * i, "first_token_s": None if error else 0.25 * i + 0.1, "finish_s": 0.25 * i + 0.2,
    }


def bitwise(value: object) -> object:
    """Cell values with floats replaced by their bits, so -0.0 and 0.0 compare different."""
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, list):
        return [bitwise(v) for v in value]
    return value


def bitwise_rows(frame: pl.DataFrame, columns: list[str] | None = None) -> list:
    return [bitwise(list(row)) for row in frame.select(columns or list(STREAM_SCHEMA)).iter_rows()]


def expected_root(rows: list[dict]) -> dict:
    ordered = sorted(rows, key=lambda row: row["index"])
    ids = [row["request_id"] for row in ordered]
    return {"format": "deepinfer-run/1", "count": len(ordered),
            "token_root": merkle_root(ids, [row["token_hash"] for row in ordered]),
            "logit_root": merkle_root(ids, [row["logit_hash"] for row in ordered])}


def one_shot(path: Path, rows: list[dict]) -> dict:
    store = RunStore.create(path, {"name": "one-shot"})
    store.append(rows)
    return store.finalize()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("finished") / "run"
    one_shot(path, [make_row(**spec(i)) for i in range(12)])
    return path


def copy_run(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "copy"))


# --- writing ---

row_specs = st.builds(
    lambda i, rid, prompt, tokens, timing: {
        "index": i, "request_id": rid, "prompt_token_ids": prompt, "params": {"seed": i},
        "token_ids": [t for t, _ in tokens], "logprobs": [x for _, x in tokens],
        "top_token_ids": [[t] for t, _ in tokens], "top_logprobs": [[x] for _, x in tokens],
        "text": None, "finish_reason": "length", "error": None,
        "arrival_s": timing, "first_token_s": None, "finish_s": timing + 1.0},
    st.just(0), st.text(min_size=1, max_size=4), st.lists(st.integers(0, 2**32 - 1), max_size=3),
    st.lists(st.tuples(st.integers(0, 2**32 - 1),
                       st.one_of(st.floats(width=32, allow_nan=False),
                                 st.sampled_from([f32(b) for b in SPECIAL_BITS]))),
             max_size=4),
    st.floats(0, 100))


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(row_specs, max_size=8, unique_by=lambda s: s["request_id"]), data=st.data())
def test_any_split_with_duplicates_finalizes_to_the_direct_root(specs, data):
    for i, s in enumerate(specs):
        s["index"] = i
    rows = [make_row(**s) for s in specs]
    order = data.draw(st.permutations(rows))
    replays = data.draw(st.lists(st.sampled_from(rows), max_size=4)) if rows else []
    # a replayed row is identical except for its timing, as when a resumed harness re-runs a request
    stream = order + [dict(row, arrival_s=row["arrival_s"] + 5.0, finish_s=row["finish_s"] + 5.0) for row in replays]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore.create(Path(tmp) / "run", {"name": "split"})
        for start, stop in zip([0, *cuts], [*cuts, len(stream)]):
            store.append(stream[start:stop])
        assert store.done() == set(range(len(rows)))
        root = store.finalize()
        assert root == expected_root(rows)
        run = read_run(Path(tmp) / "run")
        assert run.root == root and check_run(run.path) == []
        assert not (run.path / "parts").exists()
        assert run.streams["index"].to_list() == list(range(len(rows)))
        # first-written copy wins, and fp32 bits (-0.0, subnormals, inf) come back exactly
        first = {}
        for row in stream:
            first.setdefault(row["index"], row)
        assert bitwise_rows(run.streams) == [bitwise([first[i][c] for c in STREAM_SCHEMA]) for i in range(len(rows))]


def test_logprob_bits_round_trip_exactly(finished_run):
    streams = read_run(finished_run).streams
    stored = [[bits_of(x) for x in row] for row in streams["logprobs"].to_list()]
    assert stored == [[bits_of(x) for x in spec(i)["logprobs"]] for i in range(12)]
    assert {b for row in stored for b in row} == set(SPECIAL_BITS)


def test_resume_after_crash_reaches_the_one_shot_root(tmp_path):
    rows = [make_row(**spec(i)) for i in range(10)]
    store = RunStore.create(tmp_path / "run", {"name": "crash"})
    store.append(rows[0:3])
    store.append(rows[3:5])
    # what a writer killed mid-append leaves: a half-written tmp file (never a half-written part)
    (tmp_path / "run" / "parts" / "part-000003.parquet.4242.tmp").write_bytes(b"PAR1 half written")
    (tmp_path / "run" / "streams.parquet.4242.tmp").write_bytes(b"")
    del store

    resumed = RunStore.resume(tmp_path / "run")
    assert resumed.manifest == {"name": "crash"}
    assert resumed.done() == set(range(5))
    assert not list((tmp_path / "run").rglob("*.tmp"))
    resumed.append([rows[4]])  # the request in flight at the crash, re-run
    resumed.append(rows[5:8])
    assert sorted(p.name for p in (tmp_path / "run" / "parts").iterdir()) == [
        f"part-00000{k}.parquet" for k in (1, 2, 3, 4)]
    again = RunStore.resume(tmp_path / "run")
    again.append([row for row in rows if row["index"] not in again.done()])
    root = again.finalize()

    assert root == one_shot(tmp_path / "reference", rows)
    resumed_run, reference = read_run(tmp_path / "run"), read_run(tmp_path / "reference")
    assert resumed_run.streams.height == 10
    assert bitwise_rows(resumed_run.streams) == bitwise_rows(reference.streams)


SIGKILL_WRITER = """
import json, sys, time
from deepinfer.audit.store import RunStore, make_row
store = RunStore.create(sys.argv[1], {"name": "killed"})
for spec in json.loads(open(sys.argv[2]).read()):
    store.append([make_row(**spec)])
    print(spec["index"], flush=True)
    time.sleep(0.02)
"""


def test_sigkilled_writer_resumes_to_the_uninterrupted_root(tmp_path):
    specs = [spec(i) for i in range(40)]
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    command = [sys.executable, "-c", SIGKILL_WRITER, str(tmp_path / "run"), str(tmp_path / "specs.json")]
    writer = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(6):
            assert writer.stdout.readline(), "the writer died before it was killed"
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait(timeout=30)
        writer.stdout.close()
    assert writer.returncode == -signal.SIGKILL

    store = RunStore.resume(tmp_path / "run")
    assert 6 <= len(store.done()) < 40
    store.append([make_row(**s) for s in specs if s["index"] not in store.done()])
    root = store.finalize()
    assert root == one_shot(tmp_path / "reference", [make_row(**s) for s in specs])
    assert read_run(tmp_path / "run").streams.height == 40


def test_duplicates_may_differ_only_in_timing(tmp_path):
    row = make_row(**spec(5))
    store = RunStore.create(tmp_path / "timing", {})
    store.append([row])
    store.append([dict(row, arrival_s=99.0)])
    store.finalize()
    assert read_run(tmp_path / "timing").streams["arrival_s"].to_list() == [row["arrival_s"]]

    # top_logprobs are not hashed: this conflict is found by comparing bits (-0.0 != 0.0)
    assert bits_of(spec(6)["top_logprobs"][0][0]) == 0x80000000
    store = RunStore.create(tmp_path / "conflict", {})
    store.append([make_row(**spec(6)), make_row(**dict(spec(6), top_logprobs=[[0.0, -32.0], [0.0, -32.0]]))])
    with pytest.raises(AuditError) as info:
        store.finalize()
    assert str(info.value) == (f"{tmp_path / 'conflict' / 'parts'}: request index 6 ('req-006-ü') "
                               "was stored twice with different content")


def test_append_rejects_rows_whose_hashes_do_not_match(tmp_path):
    store = RunStore.create(tmp_path / "run", {})
    row = make_row(**spec(2))
    row["logprobs"] = [row["logprobs"][0], -2.0]
    with pytest.raises(AuditError) as info:
        store.append([row])
    assert str(info.value) == (f"{tmp_path / 'run' / 'parts' / 'part-000001.parquet'}: "
                               "request 'req-002-ü' logit_hash does not match its tokens/logprobs")
    assert store.done() == set() and not list((tmp_path / "run" / "parts").iterdir())


def test_empty_run_and_append_after_finalize(tmp_path):
    store = RunStore.create(tmp_path / "run", {})
    store.append([])
    assert store.finalize() == expected_root([])
    assert read_run(tmp_path / "run").streams.schema == pl.Schema(STREAM_SCHEMA)
    with pytest.raises(AuditError, match="the run is already complete"):
        store.append([make_row(**spec(0))])


# --- exact messages for the errors users meet ---

def test_create_on_a_non_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(AuditError) as info:
        RunStore.create(tmp_path, {})
    assert str(info.value) == f"{tmp_path}: cannot create a run: the folder is not empty"


def test_resume_of_a_complete_run(finished_run):
    with pytest.raises(AuditError) as info:
        RunStore.resume(finished_run)
    assert str(info.value) == f"{finished_run}: the run is already complete (root.json exists)"


def test_resume_of_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(AuditError) as info:
        RunStore.resume(tmp_path)
    assert str(info.value) == f"{tmp_path}: not a run folder (no manifest.json)"


def test_nan_logprob():
    with pytest.raises(AuditError) as info:
        make_row(**dict(spec(2), logprobs=[-1.0, float("nan")]))
    assert str(info.value) == "request 'req-002-ü': logprob 1 is NaN"


@pytest.mark.parametrize(("change", "message"), [
    (dict(finish_reason="stop"), "has an error but finish_reason 'stop' (expected 'error')"),
    (dict(token_ids=[1], logprobs=[-1.0], top_token_ids=[[1]], top_logprobs=[[-1.0]]),
     "an error row must have no generated tokens, it has 1"),
])
def test_inconsistent_error_rows(change, message):
    with pytest.raises(AuditError) as info:
        make_row(**dict(spec(3), **change))
    assert str(info.value) == f"request 'req-003-ü': {message}"


# --- reading and checking ---

def test_intact_run_checks_clean(finished_run):
    run = read_run(finished_run)
    assert check_run(finished_run) == []
    assert run.manifest == {"name": "one-shot"} and run.root["count"] == 12


def test_check_run_finds_a_rewritten_logprob(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    frame = pl.read_parquet(run / "streams.parquet")
    logprobs = frame["logprobs"].to_list()
    logprobs[5][0] = f32(bits_of(logprobs[5][0]) ^ 1)
    frame = frame.with_columns(pl.Series("logprobs", logprobs, dtype=pl.List(pl.Float32)))
    frame.write_parquet(run / "streams.parquet")
    assert check_run(run) == [
        f"{run / 'streams.parquet'}: request 'req-005-ü' logit_hash does not match its tokens/logprobs"]
    read_run(run)  # the stored hashes still match root.json: only recomputing rows finds this


def test_check_run_finds_an_edited_root(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    root = json.loads((run / "root.json").read_text())
    root["token_root"] = "0" * 64
    (run / "root.json").write_text(json.dumps(root))
    message = f"{run / 'root.json'}: token_root does not match the rows of {run / 'streams.parquet'}"
    assert check_run(run) == [message]
    with pytest.raises(AuditError) as info:
        read_run(run)
    assert str(info.value) == message


def test_flipped_bytes_in_streams_parquet_are_found(finished_run, tmp_path):
    original = read_run(finished_run).streams
    data = (finished_run / "streams.parquet").read_bytes()
    run = copy_run(finished_run, tmp_path)
    detected = 0
    for position in range(0, len(data), max(1, len(data) // 60)):
        corrupted = bytearray(data)
        corrupted[position] ^= 0x10
        (run / "streams.parquet").write_bytes(bytes(corrupted))
        problems = check_run(run)
        if problems:
            detected += 1
            assert len(problems[0].splitlines()) == 1 and problems[0].startswith(f"{run / 'streams.parquet'}")
        else:  # a flip that check_run accepts must have left every hashed value intact
            assert bitwise_rows(read_run(run).streams, HASHED) == bitwise_rows(original, HASHED)
    assert detected > 0


@pytest.mark.parametrize(("damage", "message"), [
    (lambda run: (run / "manifest.json").unlink(), "{run}/manifest.json: missing"),
    (lambda run: (run / "root.json").unlink(), "{run}/root.json: missing (the run was not finalized)"),
    (lambda run: (run / "streams.parquet").write_bytes(b"not parquet"),
     "{run}/streams.parquet: not a readable parquet file ("),
    (lambda run: pl.read_parquet(run / "streams.parquet").drop("logit_hash").write_parquet(run / "streams.parquet"),
     "{run}/streams.parquet: missing column(s) 'logit_hash'"),
    (lambda run: pl.read_parquet(run / "streams.parquet").with_columns(pl.col("logprobs").cast(pl.List(pl.Float64)))
     .write_parquet(run / "streams.parquet"),
     "{run}/streams.parquet: column 'logprobs' has dtype List(Float64), expected List(Float32)"),
    (lambda run: pl.read_parquet(run / "streams.parquet").reverse().write_parquet(run / "streams.parquet"),
     "{run}/streams.parquet: rows are not in strictly increasing index order"),
    (lambda run: (run / "root.json").write_text('{"format": "deepinfer-run/1", "count": 12}'),
     "{run}/root.json: keys must be format, count, token_root, logit_root; got ['count', 'format']"),
])
def test_damaged_runs_give_one_line_messages(finished_run, tmp_path, damage, message):
    run = copy_run(finished_run, tmp_path)
    damage(run)
    expected = message.format(run=run)
    with pytest.raises(AuditError) as info:
        read_run(run)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    assert check_run(run) == [str(info.value)]


def test_file_digests_cover_every_file(finished_run, tmp_path):
    digests = file_digests(finished_run)
    assert digests == {name: hashlib.sha256((finished_run / name).read_bytes()).hexdigest()
                       for name in ("manifest.json", "streams.parquet", "root.json")}
    run = copy_run(finished_run, tmp_path)
    (run / "root.json").write_text((run / "root.json").read_text() + " ")
    assert file_digests(run)["root.json"] != digests["root.json"]


# --- manifest ---

def test_git_state(tmp_path):
    assert git_state(tmp_path) == {"commit": None, "dirty": None}
    assert git_state(tmp_path / "missing") == {"commit": None, "dirty": None}
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("a")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.txt"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert git_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.txt").write_text("b")
    assert git_state(tmp_path) == {"commit": head, "dirty": True}


def test_manifest_is_json_and_survives_the_store(tmp_path):
    environment = environment_fingerprint()
    assert {"python", "implementation", "os", "platform", "cpu", "cpu_count", "packages", "cuda"} <= set(environment)
    assert environment["packages"]["polars"] == pl.__version__
    manifest = build_manifest(engine={"numerics": "fp32"}, checkpoint={"hash": "ab"}, suite={"name": "s"},
                              seeds={"base": 0}, variant={"batch": 4}, environment=environment,
                              git=git_state(), engine_version=engine_version())
    assert manifest["format"] == "deepinfer-manifest/1" and manifest["engine_version"] != "unknown"
    assert set(manifest["git"]) == {"commit", "dirty"}
    assert manifest["environment"] is environment
    store = RunStore.create(tmp_path / "run", manifest)
    store.finalize()
    assert read_run(tmp_path / "run").manifest == json.loads(json.dumps(manifest))


def test_cuda_fingerprint_comes_from_torch_only_when_cuda_is_available(monkeypatch):
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2,
                                 get_device_name=lambda i: f"NVIDIA H200 #{i}")
    torch = types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda="12.8"))
    monkeypatch.setitem(sys.modules, "torch", torch)
    found = environment_fingerprint()["cuda"]
    assert found["version"] == "12.8" and found["devices"] == ["NVIDIA H200 #0", "NVIDIA H200 #1"]
    assert "driver" in found
    cuda.is_available = lambda: False
    assert environment_fingerprint()["cuda"] is None
    monkeypatch.setitem(sys.modules, "torch", None)  # not installed: the fingerprint still succeeds
    assert environment_fingerprint()["cuda"] is None


@pytest.mark.parametrize(("line", "version"), [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n", "550.54.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16)\n",
     "570.86.15"),
])
def test_nvidia_driver_version_pattern(line, version):
    assert NVIDIA_DRIVER_VERSION.search(line).group(1) == version
