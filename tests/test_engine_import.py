"""`deepinfer audit import`: other engines' outputs (vLLM, SGLang, plain JSONL) as audit runs that compare,
diff and certify like our own, and the one-line refusals of bad files. No model runs: the suite is a
small native request file of token-id prompts, the engines' files are written here."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from deepinfer.audit.certificate import TOKEN, verify_certificate
from deepinfer.audit.compare import compare_streams
from deepinfer.audit.store import check_run, read_run
from deepinfer.harness.cli import main

PROMPTS = {"r1": [1, 2, 3], "r2": [4, 5], "r3": [6]}
# per request: (tokens, chosen logprobs, top-2 per position as (token, logprob)), all exact binary32 values
STREAMS = {
    "r1": ([10, 11], [-0.5, -0.25], [[(10, -0.5), (12, -1.5)], [(11, -0.25), (13, -2.0)]]),
    "r2": ([20], [-0.125], [[(20, -0.125), (21, -3.0)]]),
    "r3": ([30, 31, 32], [-1.0, -0.75, -0.0625], [[(30, -1.0), (33, -1.25)], [(31, -0.75), (34, -1.0)],
                                                  [(32, -0.0625), (35, -4.0)]]),
}


def next_float32(value: float) -> float:
    """The binary32 value one ulp away: the smallest change of a logprob's bits."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return struct.unpack("<f", struct.pack("<I", bits + 1))[0]


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    path = tmp_path / "suite.jsonl"
    path.write_text("".join(json.dumps({"id": rid, "prompt_token_ids": ids, "sampling": {"max_tokens": 3}}) + "\n"
                            for rid, ids in PROMPTS.items()))
    return path


def vllm_line(rid: str, tokens: list[int], logprobs: list[float], top: list, **extra) -> dict:
    positions = []
    for token, value, pairs in zip(tokens, logprobs, top):
        entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": f"<{t}>"}
                 for rank, (t, lp) in enumerate(pairs, 1)}
        entry.setdefault(str(token), {"logprob": value, "rank": 7, "decoded_token": f"<{token}>"})
        positions.append(entry)
    return {"request_id": rid, "prompt_token_ids": PROMPTS[rid], "prompt": None,
            "outputs": [{"index": 0, "text": "t", "token_ids": tokens, "logprobs": positions,
                         "finish_reason": "length", "cumulative_logprob": sum(logprobs)}], "finished": True, **extra}


def sglang_line(rid: str, tokens: list[int], logprobs: list[float], top: list) -> dict:
    return {"text": "t", "output_ids": tokens, "meta_info": {
        "id": rid, "prompt_tokens": len(PROMPTS[rid]), "completion_tokens": len(tokens), "input_ids": PROMPTS[rid],
        "finish_reason": {"type": "length", "length": len(tokens)},
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(tokens, logprobs)],
        "output_top_logprobs": [[[lp, t, f"<{t}>"] for t, lp in pairs] for pairs in top]}}


def jsonl_line(rid: str, tokens: list[int], logprobs: list[float], top: list) -> dict:
    return {"request_id": rid, "prompt_token_ids": PROMPTS[rid], "token_ids": tokens, "logprobs": logprobs,
            "top_logprobs": [[[t, lp] for t, lp in pairs] for pairs in top], "finish_reason": "length"}


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def engine_file(path: Path, make=vllm_line, streams: dict = STREAMS, order=("r3", "r1", "r2")) -> Path:
    """An engine's output file: lines in completion order, not the suite's."""
    return write_lines(path, [make(rid, *streams[rid]) for rid in order])


def run_import(file: Path, suite: Path, out: Path, source: str = "vllm", *extra: str) -> int:
    return main(["audit", "import", str(file), "--from", source, "--suite", str(suite), "--out", str(out), *extra])


def drifted() -> dict:
    """r3's second logprob one ulp off (batch-dependent numerics, same tokens)."""
    tokens, logprobs, top = STREAMS["r3"]
    moved = next_float32(logprobs[1])
    return {**STREAMS, "r3": (tokens, [logprobs[0], moved, logprobs[2]], [top[0], [(31, moved), top[1][1]], top[2]])}


def diverged() -> dict:
    """r1's second token is another one (a near-tie resolved otherwise)."""
    return {**STREAMS, "r1": ([10, 13], [-0.5, -1.0], [[(10, -0.5), (12, -1.5)], [(13, -1.0), (11, -1.0)]])}


def test_import_writes_a_checked_run_in_suite_order_whose_manifest_names_the_engine(tmp_path, suite, capsys):
    out = tmp_path / "runs" / "batch-8"
    settings = {"max_num_seqs": 8, "model": "deepseek-ai/DeepSeek-V4"}
    assert run_import(engine_file(tmp_path / "vllm.jsonl", vllm_line, order=("r3", "r1", "r2")), suite, out, "vllm",
                      "--name", "batch-8", "--engine-settings", json.dumps(settings)) == 0
    assert "3 requests imported from vllm" in capsys.readouterr().out
    assert check_run(out) == []
    run = read_run(out)
    assert run.streams["request_id"].to_list() == ["r1", "r2", "r3"]
    r1 = run.streams.row(0, named=True)
    assert (r1["prompt_token_ids"], r1["token_ids"], r1["logprobs"]) == ([1, 2, 3], [10, 11], [-0.5, -0.25])
    assert r1["top_token_ids"] == [[10, 12], [11, 13]] and r1["finish_reason"] == "length"
    manifest = run.manifest
    assert manifest["external_engine"] == {"name": "vllm", "version": None, "settings": settings}
    assert manifest["variant"] == {"name": "batch-8", "engine": "vllm", "engine_version": None, "settings": settings}
    assert manifest["imported"]["from"] == "vllm" and manifest["suite"]["count"] == 3
    assert "engine" not in manifest and "checkpoint" not in manifest
    assert sorted(p.name for p in out.parent.iterdir()) == ["batch-8"]  # no temporary folder left


def test_vllm_top_logprobs_leave_out_a_sampled_token_ranked_below_them(tmp_path, suite):
    streams = {**STREAMS, "r2": ([21], [-3.0], [[(20, -0.125), (22, -2.0)]])}  # sampled token 21 at rank 7
    out = tmp_path / "run"
    assert run_import(engine_file(tmp_path / "v.jsonl", vllm_line, streams), suite, out) == 0
    r2 = read_run(out).streams.row(1, named=True)
    assert (r2["logprobs"], r2["top_token_ids"], r2["top_logprobs"]) == ([-3.0], [[20, 22]], [[-0.125, -2.0]])


def test_the_same_streams_in_every_format_import_to_identical_roots(tmp_path, suite):
    roots = []
    for source, make in (("vllm", vllm_line), ("vllm", vllm_line), ("sglang", sglang_line), ("jsonl", jsonl_line)):
        out = tmp_path / f"run-{len(roots)}"
        assert run_import(engine_file(tmp_path / f"{len(roots)}.jsonl", make), suite, out, source) == 0
        roots.append(json.loads((out / "root.json").read_text()))
    assert all(root == roots[0] for root in roots)
    assert read_run(tmp_path / "run-3").manifest["external_engine"]["name"] is None  # jsonl names no engine


def test_batch_sizes_compare_as_logprob_drift_and_diverged(tmp_path, suite, capsys):
    runs = {}
    for name, streams in (("batch-1", STREAMS), ("batch-8-drift", drifted()), ("batch-8-diverged", diverged())):
        runs[name] = tmp_path / name
        assert run_import(engine_file(tmp_path / f"{name}.jsonl", vllm_line, streams), suite, runs[name]) == 0
    base = read_run(runs["batch-1"]).streams
    drift = compare_streams(base, read_run(runs["batch-8-drift"]).streams)
    assert dict(zip(drift["request_id"], drift["status"])) == {"r1": "equal", "r2": "equal", "r3": "logprob_drift"}
    split = compare_streams(base, read_run(runs["batch-8-diverged"]).streams)
    assert dict(zip(split["request_id"], split["status"])) == {"r1": "diverged", "r2": "equal", "r3": "equal"}
    row = split.row(0, named=True)
    assert (row["first_divergence"], row["token_ref"], row["token_other"]) == (1, 11, 13)
    assert row["near_tie"]  # the other engine's top-2 margin there is 0
    roots = {name: json.loads((path / "root.json").read_text()) for name, path in runs.items()}
    assert roots["batch-8-drift"]["token_root"] == roots["batch-1"]["token_root"]
    assert roots["batch-8-drift"]["logit_root"] != roots["batch-1"]["logit_root"]
    capsys.readouterr()
    assert main(["audit", "diff", "--baseline", str(runs["batch-1"]), "--run", str(runs["batch-8-drift"])]) == 1
    assert main(["audit", "compare", str(runs["batch-1"]), str(runs["batch-1"])]) == 0


def test_imported_batch_sizes_are_certified_and_the_certificate_verifies(tmp_path, suite, capsys):
    """`audit certify-runs` over vLLM outputs at batch 1 and 8: TOKEN_REPRODUCIBLE (one logprob drifted),
    exit 1 for neither; it verifies, its report renders, and `verify --rerun` says there is nothing to re-run."""
    for name, streams in (("batch-1", STREAMS), ("batch-8", drifted())):
        settings = json.dumps({"max_num_seqs": int(name.split("-")[1])})
        assert run_import(engine_file(tmp_path / f"{name}.jsonl", vllm_line, streams), suite, tmp_path / name,
                          "vllm", "--name", name, "--engine-settings", settings) == 0
    cert_dir = tmp_path / "cert"
    capsys.readouterr()
    assert main(["audit", "certify-runs", str(tmp_path / "batch-1"), str(tmp_path / "batch-8"), "--out",
                 str(cert_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "verdict: TOKEN_REPRODUCIBLE over all 3 requests; 1 variant vs reference batch-1: 0 request divergences, "
        "1 logprob-only drift")
    cert = json.loads((cert_dir / "certificate.json").read_text())
    assert cert["verdict"] == TOKEN and cert["configurations"][1]["config"]["settings"] == {"max_num_seqs": 8}
    assert verify_certificate(cert_dir / "certificate.json") == []
    assert (cert_dir / "report.html").is_file()
    assert main(["audit", "verify", str(cert_dir), "--rerun"]) == 2
    assert capsys.readouterr().err == (f"error: {cert_dir / 'certificate.json'}: certifies runs recorded elsewhere "
                                       "(audit certify-runs): there is nothing to re-run\n")


def refusal_cases(tmp: Path) -> dict:
    """name: (file, --from, the message after `error: `)."""
    lines = [vllm_line(rid, *STREAMS[rid]) for rid in PROMPTS]
    no_logprobs = vllm_line("r2", *STREAMS["r2"])
    no_logprobs["outputs"][0]["logprobs"] = None
    reprompted = {**lines[1], "prompt_token_ids": [4, 6]}
    bad_json = tmp / "bad.jsonl"
    bad_json.write_text(json.dumps(lines[0]) + "\n{not json\n")
    f = {name: tmp / f"{name}.jsonl" for name in ("field", "logprobs", "sglang", "id", "missing", "prompt", "twice")}
    return {
        "malformed": (bad_json, "vllm",
                      f"{bad_json}:2: invalid JSON (Expecting property name enclosed in double quotes at column 2)"),
        "malformed_field": (write_lines(f["field"], [{**lines[0], "outputs": {}}]), "vllm",
                            f"{f['field']}:1: 'outputs' must be a list"),
        "no_logprobs": (write_lines(f["logprobs"], [lines[0], no_logprobs, lines[2]]), "vllm",
                        f"{f['logprobs']}:2: request 'r2' has no logprobs (run vLLM with logprobs >= 1)"),
        "sglang_no_logprobs": (write_lines(f["sglang"], [{"text": "", "output_ids": [20], "meta_info": {"id": "r2"}}]),
                               "sglang", f"{f['sglang']}:1: request 'r2' has no logprobs (send return_logprob=true)"),
        "unknown_id": (write_lines(f["id"], [*lines, {**lines[0], "request_id": "r9"}]), "vllm",
                       f"{f['id']}:4: request id 'r9' is not in the suite native:{tmp / 'suite.jsonl'}"),
        "missing": (write_lines(f["missing"], lines[1:2]), "vllm",
                    f"{f['missing']}: 2 suite request(s) have no output (first: 'r1')"),
        "prompt": (write_lines(f["prompt"], [lines[0], reprompted, lines[2]]), "vllm",
                   f"{f['prompt']}:2: request 'r2': prompt token ids differ from the suite's (first at position 1: 6 "
                   "in the file, 5 in the suite)"),
        "duplicate": (write_lines(f["twice"], [*lines, lines[0]]), "vllm",
                      f"{f['twice']}:4: duplicate request id 'r1' (first at {f['twice']}:1)"),
        "unknown_format": (bad_json, "tgi", "--from 'tgi': unknown format (known: vllm, sglang, jsonl)"),
    }


@pytest.mark.parametrize("case", ["malformed", "malformed_field", "no_logprobs", "sglang_no_logprobs", "unknown_id",
                                  "missing", "prompt", "duplicate", "unknown_format"])
def test_refusals_are_one_line_and_leave_no_run(tmp_path, suite, capsys, case):
    file, source, message = refusal_cases(tmp_path)[case]
    out = tmp_path / "runs" / "out"
    capsys.readouterr()
    assert run_import(file, suite, out, source) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and captured.out == ""
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_a_non_empty_out_folder_is_refused(tmp_path, suite, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("")
    assert run_import(engine_file(tmp_path / "v.jsonl"), suite, out) == 2
    assert capsys.readouterr().err == f"error: {out}: cannot create a run: it exists and is not an empty folder\n"
    assert sorted(p.name for p in out.iterdir()) == ["keep"]
