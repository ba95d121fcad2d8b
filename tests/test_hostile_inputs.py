"""Hostile inputs are refused, or served, within 10 s and 2 GB each: endless and deeply nested request
files, unbounded flags, and structured constraints that are unsatisfiable or explode when compiled.

They run through the command line in one child process (so its peak memory is theirs: the engine, the
inputs, and the bounded compiler children it forks), under an 8 GiB address-space limit that keeps a
regression from taking the machine down; the test then checks each one's exit code, one-line message
and time, and the peak resident memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.audit.store import read_run
from deepinfer.engine.structured import COMPILE_BYTES
from test_traces import episode

REPO = Path(__file__).resolve().parent.parent
SECONDS, MEGABYTES = 10, 2048  # seconds per input; how much the peak memory may grow over the battery
DEEP = "[" * 10000 + "]" * 10000  # nested past Python's recursion limit
CONSTRAINTS = {
    "schema-true": {"json_schema": True},
    "empty-class": {"regex": "[^\\x00-\\U0010FFFF]"},
    "ref-loop": {"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
    "dfa-blowup": {"regex": "(a|b)*a(a|b){24}"},
    "wide-schema": {"json_schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(70000)}}},
}
DEEP_SCHEMA = {"json_schema": '{"properties": {"x": ' * 500 + "{}" + "}}" * 500}  # a shape error: refused at load
CHILD = """
import contextlib, io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
from deepinfer.harness.cli import main
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
results = []
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    results.append({"code": code, "seconds": time.monotonic() - start, "err": err.getvalue(), "out": out.getvalue()})
rss = [resource.getrusage(who).ru_maxrss // 1024 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
print(json.dumps({"results": results, "base_rss_mb": base, "max_rss_mb": rss[0], "compile_children_max_rss_mb": rss[1]}))
"""


@pytest.fixture(scope="module")
def hostile(tiny_checkpoint, tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "deep.jsonl").write_text('{"prompt": "hello", "sampling": {"max_tokens": 2}}\n'
                                       f'{{"prompt": "x", "sampling": {{"stop": {DEEP}}}}}\n')
    for name, constraint in CONSTRAINTS.items():  # each beside a plain request, in a run of its own
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in (
            {"id": name, "prompt": "Answer:", "sampling": {"max_tokens": 8, "structured": constraint}},
            {"id": "plain", "prompt": "Answer:", "sampling": {"max_tokens": 4}})))
    (folder / "deep-schema.jsonl").write_text(json.dumps({"prompt": "x", "sampling": {"structured": DEEP_SCHEMA}}) + "\n")
    (folder / "traces.jsonl").write_text(json.dumps(episode("fine")) + "\n" + f'{{"id": "deep", "messages": {DEEP}}}\n')
    model = ["--model", str(tiny_checkpoint)]
    cases = {
        "dev-zero": ["generate", *model, "--prompts-file", "/dev/zero"],
        "deep-line": ["generate", *model, "--prompts-file", str(folder / "deep.jsonl")],
        "draft-tokens": ["generate", *model, "--prompt", "x", "--speculation", "mtp", "--draft-tokens", "1000"],
        "shards": ["audit", "run", *model, "--suite", f"native:{folder / 'schema-true.jsonl'}", "--shards", "1000",
                   "--out", str(folder / "never")],
        "deep-schema": ["audit", "run", *model, "--suite", f"native:{folder / 'deep-schema.jsonl'}", "--out",
                        str(folder / "never")],
        **{name: ["audit", "run", *model, "--suite", f"native:{folder / name}.jsonl", "--no-progress",
                  "--out", str(folder / name)] for name in CONSTRAINTS},
        "deep-trace": ["audit", "run", *model, "--suite", f"traces:{folder / 'traces.jsonl'}", "--no-progress",
                       "--out", str(folder / "traces")],
    }
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(list(cases.values()))], cwd=REPO,
                           capture_output=True, text=True, timeout=SECONDS * len(cases) + 60)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    memory = {key: report[key] for key in ("base_rss_mb", "max_rss_mb", "compile_children_max_rss_mb")}
    return folder, {**memory, **dict(zip(cases, report["results"]))}


def test_each_hostile_input_ends_within_the_time_and_memory_bounds(hostile):
    """Each input ends within SECONDS; the process's peak memory grows by less than MEGABYTES over the
    battery (over its peak once imported: alone here 325 MB, then 741 MB at the end; inside the full
    suite on a fresh clone the end reached 2,054 and 2,082 MB, not yet explained), and a grammar
    compiled in a forked child (`structured._within_limits`) stays within what the child may add to
    what it forked from (its pages count in its own peak)."""
    _, results = hostile
    slow = {name: round(r["seconds"], 1) for name, r in results.items()
            if isinstance(r, dict) and r["seconds"] > SECONDS}
    assert not slow
    assert results["max_rss_mb"] - results["base_rss_mb"] < MEGABYTES
    assert results["compile_children_max_rss_mb"] < results["max_rss_mb"] + (COMPILE_BYTES >> 20) + 64


@pytest.mark.parametrize("case, message", [
    ("dev-zero", "/dev/zero:1: longer than 64 MiB (a request line is at most that)"),
    ("deep-line", "{folder}/deep.jsonl:2: JSON nested more than 100 levels deep"),
    ("draft-tokens", "draft_tokens must be from 1 to 16 (a step verifies at most that many drafts per sequence), "
                     "got 1000"),
    ("shards", "flags: shards must be from 1 to 64 (one engine each), got 1000"),
    ("deep-schema", "{folder}/deep-schema.jsonl:1: invalid sampling params: structured json_schema nested more than "
                    "100 levels deep"),
])
def test_unbounded_inputs_are_refused_in_one_line(hostile, case, message):
    folder, results = hostile
    assert (results[case]["code"], results[case]["err"]) == (2, f"error: {message.format(folder=folder)}\n")
    assert not (folder / "never").exists()


@pytest.mark.parametrize("name, error", [
    ("schema-true", None),  # any JSON value
    ("dfa-blowup", None),  # served by llguidance once outlines-core's build hit its limit
    ("empty-class", "invalid regex: no output satisfies it"),
    ("ref-loop", "invalid JSON schema: no output satisfies it"),
    ("wide-schema", "invalid JSON schema: schema too large"),
])
def test_a_bad_constraint_fails_only_its_request(hostile, name, error):
    folder, results = hostile
    assert results[name]["code"] == 0, results[name]["err"]
    rows = {row["request_id"]: row for row in read_run(folder / name).streams.to_dicts()}
    assert rows["plain"]["error_kind"] is None and len(rows["plain"]["token_ids"]) == 4
    if error is not None:
        assert (rows[name]["error_kind"], rows[name]["error"]) == ("invalid_request", error)
    else:
        assert rows[name]["error_kind"] is None and rows[name]["token_ids"]
    if name == "dfa-blowup":
        assert set(rows[name]["text"]) <= {"a", "b"}


def test_a_trace_line_nested_too_deep_is_one_malformed_request_and_the_rest_runs(hostile):
    folder, results = hostile
    assert results["deep-trace"]["code"] == 0, results["deep-trace"]["err"]
    rows = {row["request_id"]: row for row in read_run(folder / "traces").streams.to_dicts()}
    assert rows["line-2"]["error_kind"] == "malformed"
    assert rows["line-2"]["error"] == "JSON nested more than 100 levels deep"
    assert all(not row["error_kind"] for name, row in rows.items() if name.startswith("fine/"))
