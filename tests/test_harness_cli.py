"""Tests for `deepinfer audit ...` through `harness.cli.main`: a certification that verifies (and stops
verifying when any stored byte changes), signing, regression diffs, crash-safe recording with
--resume, and one-line errors (exit code 2) for bad sweeps, suites and folders.

One small certification (4 requests, 3 configurations + a fast control) is recorded per module and
shared; tests that change files work on a copy."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
from cryptography.hazmat.primitives import serialization

from deepinfer.audit.certificate import seal, write_certificate
from deepinfer.audit.files import folder_lock
from deepinfer.audit.store import check_run, file_digests, make_row
from deepinfer.audit.streams import STREAM_SCHEMA, run_root
from deepinfer.harness.cli import main
from deepinfer.harness.suite_registry import request_seed

REPO = Path(__file__).resolve().parent.parent
CONFIGURATIONS = {"ref": "reference", "batch-1": "variant", "chunk-16": "variant", "fast": "control"}
TOOL = {"type": "function", "function": {"name": "get_weather",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "a", "content": '{"temp": 4, "sky": "rain"}'},
]
SUITE = [
    {"id": "text-greedy", "prompt": "Hello there", "sampling": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}},
    {"id": "ids-seeded", "prompt_token_ids": [0, 5, 6, 7],
     "sampling": {"temperature": 0.8, "top_k": 20, "seed": 7, "max_tokens": 5, "ignore_eos": True}},
    {"id": "chat-tools", "messages": CHAT, "tools": [TOOL],
     "sampling": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}},
    {"id": "text-unseeded", "prompt": "The fox", "sampling": {"temperature": 0.7, "max_tokens": 6, "ignore_eos": True}},
]
SWEEP = {
    "reference": {"name": "ref", "max_num_seqs": 8},
    "variants": [{"name": "batch-1", "max_num_seqs": 1}, {"name": "chunk-16", "max_num_batched_tokens": 16}],
    "controls": [{"name": "fast", "numerics": "fast"}],
}
# The --resume suite: 12 requests served one at a time (batch 1), so rows reach the store over time.
LONG_SUITE = [
    {"id": f"r{i:02d}", "prompt": f"request number {i}:",
     "sampling": {"max_tokens": 8, "ignore_eos": True, **({"temperature": 0.8, "seed": i} if i % 2 else {})}}
    for i in range(12)
]


def signed_by(public_key: Path, pinned: bool = False) -> str:
    """verify's signer line for the Ed25519 key in `public_key` (PEM): its SHA-256 fingerprint."""
    key = serialization.load_pem_public_key(public_key.read_bytes())
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"signed by {'the pinned ' if pinned else ''}key SHA256:{hashlib.sha256(raw).hexdigest()}"


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def audit(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `deepinfer audit ARGV`."""
    code = main(["audit", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(capsys, argv: list, message: str) -> None:
    assert "\n" not in message
    code, out, err = audit(capsys, *argv)
    assert (code, out, err) == (2, "", f"error: {message}\n")


@pytest.fixture(scope="module")
def certified(tmp_path_factory, tiny_checkpoint) -> SimpleNamespace:
    """keygen, then a signed certification of SUITE under SWEEP (read-only: copy before changing)."""
    base = tmp_path_factory.mktemp("certified")
    suite = write_lines(base / "suite.jsonl", SUITE)
    sweep = base / "sweep.json"
    sweep.write_text(json.dumps(SWEEP))
    keys = base / "signer"
    out = base / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["audit", "keygen", "--out", str(keys)]) == 0
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["audit", "certify", "--model", str(tiny_checkpoint), "--suite", str(suite), "--sweep", str(sweep),
                     "--out", str(out), "--sign-key", f"{keys}.key", "--no-progress"])
    return SimpleNamespace(code=code, stdout=stdout.getvalue(), out=out, cert=out / "certificate.json", suite=suite,
                           sweep=sweep, key=Path(f"{keys}.key"), pub=Path(f"{keys}.pub"))


@pytest.fixture
def cert_copy(certified, tmp_path) -> Path:
    """A private copy of the certification folder; returns its certificate.json."""
    shutil.copytree(certified.out, tmp_path / "cert")
    return tmp_path / "cert" / "certificate.json"


# --- certify -------------------------------------------------------------------------------------------


def test_certify_prints_the_verdict_and_writes_certificate_and_reports(certified):
    assert certified.code == 0
    lines = certified.stdout.splitlines()
    assert lines[0] == ("verdict: BITWISE_REPRODUCIBLE over all 4 requests; 2 variants vs reference ref: "
                        "0 request divergences, 0 logprob-only drifts")
    assert lines[1].startswith("control fast: TOKEN_REPRODUCIBLE (equal 0, logprob_drift 4, diverged 0, ")
    assert lines[2:] == [f"certificate: {certified.cert}",
                         f"report: {certified.out / 'report.md'} and {certified.out / 'report.html'}"]
    for name in ("certificate.json", "report.md", "report.html", "sweep.json"):
        assert (certified.out / name).is_file(), name
    markdown = (certified.out / "report.md").read_text()
    html = (certified.out / "report.html").read_text()
    for name in CONFIGURATIONS:
        assert f"| {name} " in markdown, name
        assert name in html, name
    assert "BITWISE_REPRODUCIBLE" in markdown and "BITWISE_REPRODUCIBLE" in html


def test_certificate_records_equal_roots_for_reference_and_variants(certified):
    cert = json.loads(certified.cert.read_text())
    assert cert["verdict"] == "BITWISE_REPRODUCIBLE" and cert["reference"] == "ref"
    configs = {c["name"]: c for c in cert["configurations"]}
    assert {name: c["role"] for name, c in configs.items()} == CONFIGURATIONS
    assert [c["name"] for c in cert["configurations"]] == list(CONFIGURATIONS)  # reference first
    for name in ("batch-1", "chunk-16"):
        assert configs[name]["logit_root"] == configs["ref"]["logit_root"]
        assert configs[name]["token_root"] == configs["ref"]["token_root"]
        assert configs[name]["comparison"] == {"equal": 4, "logprob_drift": 0, "diverged": 0, "near_tie": 0,
                                               "missing": 0, "error": 0}
        assert configs[name]["config"]["max_num_seqs"] == (1 if name == "batch-1" else 8)
    assert configs["chunk-16"]["config"]["max_num_batched_tokens"] == 16
    # the fast control reproduces the tokens of this tiny suite but not the logprob bits
    assert configs["fast"]["token_root"] == configs["ref"]["token_root"]
    assert configs["fast"]["logit_root"] != configs["ref"]["logit_root"]
    assert cert["controls"] == [
        {"name": "fast", "verdict": "TOKEN_REPRODUCIBLE", "comparison": configs["fast"]["comparison"]}]
    assert cert["suite"]["count"] == 4 and cert["suite"]["path"] == str(certified.suite.resolve())
    assert "signature" in cert and cert["signature"]["algorithm"] == "ed25519"
    for name, c in configs.items():
        root = json.loads((certified.out / c["run"] / "root.json").read_text())
        assert (root["count"], root["token_root"], root["logit_root"]) == (4, c["token_root"], c["logit_root"])


def test_certified_streams_cover_every_kind_of_request(certified):
    streams = pl.read_parquet(certified.out / "runs" / "ref" / "streams.parquet")
    assert streams["index"].to_list() == [0, 1, 2, 3]
    assert streams["request_id"].to_list() == [r["id"] for r in SUITE]
    assert streams["finish_reason"].to_list() == ["length"] * 4
    assert [len(ids) for ids in streams["token_ids"]] == [6, 5, 4, 6]
    assert streams["error"].null_count() == 4
    rows = {row["request_id"]: row for row in streams.iter_rows(named=True)}
    assert rows["ids-seeded"]["prompt_token_ids"] == [0, 5, 6, 7]
    assert len(rows["chat-tools"]["prompt_token_ids"]) > 20  # the tool schema and result are in the prompt
    params = {rid: json.loads(row["params"]) for rid, row in rows.items()}
    assert params["ids-seeded"]["seed"] == 7
    assert params["text-unseeded"]["seed"] == request_seed(0, "text-unseeded")
    assert all(p["logprobs"] == 2 for p in params.values())
    assert all(len(top) == 2 for row in rows.values() for top in row["top_token_ids"])
    assert all(0 <= row["arrival_s"] < row["first_token_s"] <= row["finish_s"] for row in rows.values())


# --- verify --------------------------------------------------------------------------------------------


def test_verify_accepts_the_intact_certificate(capsys, certified):
    code, out, err = audit(capsys, "verify", certified.cert)
    assert (code, out, err) == (0, f"OK: {certified.cert} is intact\n{signed_by(certified.pub)}, not pinned: pass "
                                   "--public-key to require it\n", "")


def test_verify_rerun_reproduces_the_reference_bit_for_bit(capsys, certified, cert_copy):
    code, out, err = audit(capsys, "verify", cert_copy, "--rerun", "--no-progress")
    assert (code, out, err) == (0, f"OK: {cert_copy} is intact and its reference run reproduces bit for bit\n"
                                   f"{signed_by(certified.pub)}, not pinned: pass --public-key to require it\n", "")


@pytest.mark.parametrize(("rerun", "message"), [
    ({"suite": "x", "run_seed": 0, "reference": {"name": "ref"}}, "rerun.model: missing or of the wrong type"),
    ({"model": None, "suite": "x", "run_seed": "0", "reference": {"name": "ref"}},
     "rerun.run_seed: missing or of the wrong type"),
    ({"model": None, "suite": "x", "run_seed": 0, "reference": {"name": "ref", "batch": 2}},
     "rerun.reference: unknown field(s) ['batch']"),
])
def test_verify_rerun_of_a_malformed_rerun_block_is_one_line(capsys, cert_copy, rerun, message):
    cert = json.loads(cert_copy.read_text())
    write_certificate(cert_copy, seal({**cert, "rerun": rerun}))
    assert_user_error(capsys, ["verify", cert_copy, "--rerun", "--no-progress"],
                      f"{cert_copy}: {message} (cannot re-run)")


def test_verify_reports_an_edited_certificate_field(capsys, cert_copy):
    raw = cert_copy.read_bytes()
    at = raw.index(b'"created": "') + len(b'"created": "') + 3  # a digit of the year
    cert_copy.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out) == (1, "")
    assert err == ("FAIL: certificate.json: content hash does not match its contents (edited after sealing?)\n"
                   "FAIL: certificate.json: signature is not valid for its contents\n")


def test_verify_reports_changed_certificate_bytes_even_when_the_content_is_the_same(capsys, cert_copy):
    raw = cert_copy.read_bytes()
    assert raw.endswith(b"}\n")
    cert_copy.write_bytes(raw[:-1] + b" ")  # same JSON value, different bytes
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out) == (1, "")
    assert err == "FAIL: certificate.json: not in the exact form it is written in (bytes changed after writing?)\n"


def test_verify_reports_a_flipped_byte_in_a_variant_streams_file(capsys, cert_copy):
    streams = cert_copy.parent / "runs" / "batch-1" / "streams.parquet"
    raw = bytearray(streams.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    streams.write_bytes(bytes(raw))
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out) == (1, "")
    assert ("FAIL: runs/batch-1/streams.parquet: sha256 does not match the certificate (changed after "
            "certification?)\n") in err
    assert "runs/ref" not in err and "runs/chunk-16" not in err


def test_verify_reports_an_edited_root_json(capsys, cert_copy):
    root_file = cert_copy.parent / "runs" / "chunk-16" / "root.json"
    root = json.loads(root_file.read_text())
    root["logit_root"] = "0" * 64
    root_file.write_text(json.dumps(root, indent=2, sort_keys=True) + "\n")
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert ("FAIL: runs/chunk-16/root.json: sha256 does not match the certificate (changed after "
            "certification?)") in lines
    assert "FAIL: runs/chunk-16/root.json: logit_root differs from the certificate" in lines
    assert f"FAIL: {root_file}: logit_root does not match the rows of {root_file.parent / 'streams.parquet'}" in lines
    assert len(lines) == 3


def test_verify_reports_a_run_rewritten_with_consistent_hashes(capsys, cert_copy):
    run = cert_copy.parent / "runs" / "batch-1"
    rewrite_token(run, "text-greedy", 0)
    assert check_run(run) == []  # the run alone looks fine: only the certificate can tell
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        "FAIL: runs/batch-1/streams.parquet: sha256 does not match the certificate (changed after certification?)",
        "FAIL: runs/batch-1/root.json: sha256 does not match the certificate (changed after certification?)",
        "FAIL: runs/batch-1/root.json: token_root differs from the certificate",
        "FAIL: runs/batch-1/root.json: logit_root differs from the certificate",
    ]


def test_a_resealed_certificate_fails_only_against_the_signers_key(capsys, certified, cert_copy):
    """Whoever rewrites a run and re-seals the certificate cannot re-sign it: pinning the key catches it."""
    run = cert_copy.parent / "runs" / "batch-1"
    rewrite_token(run, "text-greedy", 0)
    cert = json.loads(cert_copy.read_text())
    [entry] = [c for c in cert["configurations"] if c["name"] == "batch-1"]
    root = json.loads((run / "root.json").read_text())
    entry.update(token_root=root["token_root"], logit_root=root["logit_root"], files=file_digests(run),
                 comparison={**entry["comparison"], "equal": 3, "diverged": 1})
    cert["verdict"] = "DIVERGENT"
    cert["verdict_counts"].update(bitwise_equal=1, divergent=1, requests_diverged=1)
    signature = cert.pop("signature")
    write_certificate(cert_copy, {**seal(cert), "signature": signature})  # the old signature, a new seal
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out, err) == (1, "", "FAIL: certificate.json: signature is not valid for its contents\n")
    write_certificate(cert_copy, seal(cert))
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out, err) == (0, f"OK: {cert_copy} is intact\nunsigned: anyone able to write the folder could have "
                                   "made it\n", "")  # unsigned: consistent is all it can say
    code, out, err = audit(capsys, "verify", cert_copy, "--public-key", certified.pub)
    assert (code, out, err) == (1, "", "FAIL: certificate.json: not signed, but a public key was given\n")


def test_verify_of_a_missing_certificate_is_a_user_error(capsys, tmp_path):
    assert_user_error(capsys, ["verify", tmp_path / "none.json"], f"{tmp_path / 'none.json'}: cannot read (No such "
                                                                   "file or directory)")
    assert_user_error(capsys, ["verify", tmp_path], f"{tmp_path / 'certificate.json'}: cannot read (No such file or "
                                                    "directory)")


def test_verify_reports_a_missing_run_folder(capsys, cert_copy):
    shutil.rmtree(cert_copy.parent / "runs" / "chunk-16")
    code, out, err = audit(capsys, "verify", cert_copy)
    assert (code, out, err) == (1, "", "FAIL: runs/chunk-16: run folder of configuration 'chunk-16' is missing\n")


# --- keys and signatures -------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_only_its_owner_can_read(capsys, tmp_path):
    code, out, err = audit(capsys, "keygen", "--out", tmp_path / "k")
    assert (code, out, err) == (0, f"private key: {tmp_path / 'k.key'}\npublic key: {tmp_path / 'k.pub'}\n", "")
    assert stat.S_IMODE((tmp_path / "k.key").stat().st_mode) == 0o600
    assert (tmp_path / "k.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert (tmp_path / "k.pub").read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")


def test_keygen_refuses_to_overwrite_a_key(capsys, tmp_path):
    (tmp_path / "k.pub").write_text("mine")
    assert_user_error(capsys, ["keygen", "--out", tmp_path / "k"],
                      f"{tmp_path / 'k.pub'} exists: refusing to overwrite a key")
    assert (tmp_path / "k.pub").read_text() == "mine" and not (tmp_path / "k.key").exists()
    assert audit(capsys, "keygen", "--out", tmp_path / "j")[0] == 0
    private = (tmp_path / "j.key").read_bytes()
    assert_user_error(capsys, ["keygen", "--out", tmp_path / "j"],
                      f"{tmp_path / 'j.key'} exists: refusing to overwrite a key")
    assert (tmp_path / "j.key").read_bytes() == private


def test_the_signature_verifies_only_with_the_signers_public_key(capsys, certified, tmp_path):
    code, out, err = audit(capsys, "verify", certified.cert, "--public-key", certified.pub)
    assert (code, out, err) == (0, f"OK: {certified.cert} is intact\n{signed_by(certified.pub, pinned=True)}\n", "")
    assert audit(capsys, "keygen", "--out", tmp_path / "other")[0] == 0
    code, out, err = audit(capsys, "verify", certified.cert, "--public-key", tmp_path / "other.pub")
    assert (code, out, err) == (1, "", "FAIL: certificate.json: signed by a different key than the given public key\n")
    assert_user_error(capsys, ["verify", certified.cert, "--public-key", tmp_path / "none.pub"],
                      f"{tmp_path / 'none.pub'}: cannot read (No such file or directory)")


# --- diff and compare ----------------------------------------------------------------------------------


def test_diff_of_identical_runs_exits_0(capsys, certified):
    runs = certified.out / "runs"
    code, out, err = audit(capsys, "diff", "--baseline", certified.cert, "--run", runs / "batch-1")
    assert (code, err) == (0, "")
    assert out == (f"{certified.cert} vs {runs / 'batch-1'}: 4 requests: 4 equal, 0 logprob drift, 0 diverged "
                   "(0 near-tie, 0 hard), 0 missing, 0 error; max logprob drift 0\n")


def test_diff_against_the_fast_control_exits_1_for_logprob_drift(capsys, certified):
    runs = certified.out / "runs"
    code, out, err = audit(capsys, "diff", "--baseline", runs / "ref", "--run", runs / "fast")
    assert (code, err) == (1, "")
    assert out.startswith(f"{runs / 'ref'} vs {runs / 'fast'}: 4 requests: 0 equal, 4 logprob drift, 0 diverged ")


def rewrite_token(run_dir: Path, request_id: str, position: int) -> tuple[int, int]:
    """Change one generated token of a finished run, with every hash and the root recomputed, so the run is
    a self-consistent record of a different stream. Returns (old token, new token)."""
    streams = pl.read_parquet(run_dir / "streams.parquet")
    rows = []
    for row in streams.iter_rows(named=True):
        if row["request_id"] == request_id:
            old = row["token_ids"][position]
            new = old ^ 1
            row["token_ids"] = [*row["token_ids"][:position], new, *row["token_ids"][position + 1:]]
            fields = {k: v for k, v in row.items() if k not in ("prompt_hash", "token_hash", "logit_hash")}
            row = make_row(**{**fields, "params": json.loads(row["params"])})
        rows.append(row)
    frame = pl.from_dicts(rows, schema=STREAM_SCHEMA)
    frame.write_parquet(run_dir / "streams.parquet")
    (run_dir / "root.json").write_text(json.dumps(run_root(frame), indent=2, sort_keys=True) + "\n")
    return old, new


def test_diff_names_the_request_and_position_of_a_changed_token(capsys, certified, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(certified.out / "runs" / "batch-1", changed)
    old, new = rewrite_token(changed, "ids-seeded", 2)
    assert check_run(changed) == []
    code, out, err = audit(capsys, "diff", "--baseline", certified.cert, "--run", changed)
    assert (code, err) == (1, "")
    head, detail = out.splitlines()
    assert head.startswith(f"{certified.cert} vs {changed}: 4 requests: 3 equal, 0 logprob drift, 1 diverged ")
    assert detail.startswith(f"  ids-seeded (#1) at position 2: token {old} (logprob ")
    assert f" vs token {new} (logprob " in detail


def test_diff_of_a_missing_path_is_a_user_error(capsys, certified, tmp_path):
    assert_user_error(capsys, ["diff", "--baseline", tmp_path / "nope", "--run", certified.out / "runs" / "ref"],
                      f"{tmp_path / 'nope'}: neither a certificate nor a run folder")


def test_compare_json_prints_one_object_per_request_and_run(capsys, certified):
    runs = certified.out / "runs"
    code, out, err = audit(capsys, "compare", runs / "ref", runs / "batch-1", runs / "fast", "--json")
    assert (code, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    ids = [r["id"] for r in SUITE]
    assert [(r["run"], r["index"], r["request_id"]) for r in rows] == (
        [(str(runs / "batch-1"), i, rid) for i, rid in enumerate(ids)]
        + [(str(runs / "fast"), i, rid) for i, rid in enumerate(ids)])
    assert {r["baseline"] for r in rows} == {str(runs / "ref")}
    assert [r["status"] for r in rows] == ["equal"] * 4 + ["logprob_drift"] * 4
    assert all(r["max_logprob_drift"] == 0.0 for r in rows[:4])
    assert all(r["max_logprob_drift"] > 0.0 and r["first_divergence"] is None for r in rows[4:])


def test_compare_needs_two_runs_of_one_suite(capsys, certified, uninterrupted):
    assert_user_error(capsys, ["compare", certified.out / "runs" / "ref"], "compare needs at least two runs")
    assert_user_error(capsys, ["compare", certified.cert, uninterrupted],
                      "the runs are not of the same suite: index 0 is request 'text-greedy' in the reference but "
                      "'r00' in the other run")


def test_report_rewrites_the_reports_of_a_certification(capsys, cert_copy, tmp_path):
    folder = cert_copy.parent
    for name in ("report.md", "report.html"):
        (folder / name).unlink()
    code, out, err = audit(capsys, "report", folder)
    assert (code, out, err) == (0, f"report: {folder / 'report.md'} and {folder / 'report.html'}\n", "")
    assert "**Verdict: BITWISE_REPRODUCIBLE**" in (folder / "report.md").read_text()
    assert_user_error(capsys, ["report", tmp_path],
                      f"{tmp_path / 'certificate.json'}: cannot read (No such file or directory)")


# --- recording, kill and --resume ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_suite(tmp_path_factory) -> Path:
    return write_lines(tmp_path_factory.mktemp("long") / "long.jsonl", LONG_SUITE)


@pytest.fixture(scope="module")
def uninterrupted(long_suite, tiny_checkpoint, tmp_path_factory) -> Path:
    """The long suite recorded in one go (batch 1)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["audit", "run", "--model", str(tiny_checkpoint), "--suite", str(long_suite), "--max-num-seqs", "1",
                     "--out", str(out), "--no-progress"])
    assert code == 0
    return out


def run_with_a_part_stored(long_suite: Path, checkpoint: Path, out: Path) -> tuple[list[str], subprocess.Popen]:
    """`audit run` of the long suite into `out` in a child process, once its first part file is stored
    (rows still to serve): the argv, and the child (stdout and stderr piped)."""
    argv = ["audit", "run", "--model", str(checkpoint), "--suite", str(long_suite), "--max-num-seqs", "1",
            "--out", str(out), "--no-progress"]
    # Flush every 3 rows (instead of 16 rows / 2 s) so that a part file appears early, with rows still to serve.
    code = ("import sys; import deepinfer.harness.run_writer as writer; writer.FLUSH_ROWS = 3; "
            "from deepinfer.harness.cli import main; "
            f"sys.exit(main({argv!r}))")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts, deadline = out / "parts", time.monotonic() + 60
    try:
        while not (parts.is_dir() and any(parts.glob("part-*.parquet"))):
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "no part file within 60 s"
            time.sleep(0.01)
    except BaseException:
        child.kill()
        child.communicate()
        raise
    return argv, child


def test_a_killed_run_resumes_to_the_root_of_an_uninterrupted_one(capsys, long_suite, tiny_checkpoint, uninterrupted,
                                                                    tmp_path):
    out = tmp_path / "run"
    argv, child = run_with_a_part_stored(long_suite, tiny_checkpoint, out)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    parts = out / "parts"
    assert child.returncode == -signal.SIGKILL
    assert not (out / "root.json").exists() and not (out / "streams.parquet").exists()
    stored = {i for part in parts.glob("part-*.parquet") for i in pl.read_parquet(part, columns=["index"])["index"]}
    assert 3 <= len(stored) < len(LONG_SUITE)

    code, stdout, err = audit(capsys, *argv[1:], "--resume")
    expected = json.loads((uninterrupted / "root.json").read_text())
    assert (code, err) == (0, "")
    assert stdout == f"run {out}: {len(LONG_SUITE)} requests, logit root {expected['logit_root']}\n"
    assert json.loads((out / "root.json").read_text()) == expected
    streams = pl.read_parquet(out / "streams.parquet")
    assert streams["index"].to_list() == list(range(len(LONG_SUITE)))
    assert streams["request_id"].to_list() == [r["id"] for r in LONG_SUITE]
    assert not parts.exists()
    assert check_run(out) == []


@pytest.fixture
def interrupted(uninterrupted, tmp_path) -> Path:
    """A copy of the uninterrupted run that looks unfinished (no root.json)."""
    run = tmp_path / "interrupted"
    shutil.copytree(uninterrupted, run)
    (run / "root.json").unlink()
    (run / "streams.parquet").unlink()
    return run


@pytest.mark.parametrize("flags, section", [
    (["--max-num-seqs", "4"], "variant"),
    (["--max-num-seqs", "1", "--run-seed", "3"], "seeds"),
])
def test_resume_refuses_a_run_recorded_with_another_configuration(capsys, long_suite, tiny_checkpoint, interrupted,
                                                                  flags, section):
    assert_user_error(
        capsys,
        ["run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", interrupted, "--resume", "--no-progress",
         *flags],
        f"{interrupted}: cannot resume: its {section} differs from this invocation's")
    assert not (interrupted / "root.json").exists()


def test_resume_refuses_a_run_of_another_suite(capsys, certified, tiny_checkpoint, interrupted):
    assert_user_error(
        capsys,
        ["run", "--model", tiny_checkpoint, "--suite", certified.suite, "--out", interrupted, "--resume",
         "--max-num-seqs", "1", "--no-progress"],
        f"{interrupted}: cannot resume: its suite differs from this invocation's")


def test_resume_of_a_complete_run_refuses_another_configuration(capsys, long_suite, tiny_checkpoint, uninterrupted,
                                                                tmp_path):
    run = tmp_path / "complete"
    shutil.copytree(uninterrupted, run)
    code, out, err = audit(capsys, "run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", run, "--resume",
                           "--max-num-seqs", "4", "--run-seed", "3", "--no-progress")
    assert code == 2 and "cannot resume" in err


def test_certify_resume_refuses_another_suite_for_complete_runs(capsys, certified, cert_copy, tiny_checkpoint,
                                                                tmp_path):
    other = write_lines(tmp_path / "other.jsonl", [{**SUITE[0], "sampling": {"max_tokens": 2}}, *SUITE[1:]])
    code, out, err = audit(capsys, "certify", "--model", tiny_checkpoint, "--suite", other, "--sweep", certified.sweep,
                           "--out", cert_copy.parent, "--resume", "--no-progress")
    assert code == 2 and "suite" in err


def test_certify_resume_of_a_complete_certification_reissues_the_same_verdict(capsys, certified, cert_copy,
                                                                            tiny_checkpoint):
    before = json.loads(cert_copy.read_text())
    code, out, err = audit(capsys, "certify", "--model", tiny_checkpoint, "--suite", certified.suite, "--sweep",
                           certified.sweep, "--out", cert_copy.parent, "--resume", "--no-progress")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == certified.stdout.splitlines()[0]
    after = json.loads(cert_copy.read_text())
    assert after["configurations"] == before["configurations"] and "signature" not in after
    assert audit(capsys, "verify", cert_copy)[0] == 0


def test_a_second_certify_of_a_folder_being_written_is_refused_and_the_first_stays_intact(
        capsys, certified, cert_copy, tiny_checkpoint, tmp_path):
    """A certify still running holds its folder's lock (taken here as that process would); a second one
    (here a --resume) is refused before it touches anything, and the folder still verifies afterwards."""
    folder = cert_copy.parent
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    argv = ["certify", "--model", tiny_checkpoint, "--suite", certified.suite, "--sweep", certified.sweep,
            "--no-progress"]
    with folder_lock(folder):
        assert_user_error(capsys, [*argv, "--out", folder, "--resume"],
                          f"{folder}: another process is writing this folder; wait for it to end (or stop it), "
                          "then --resume")
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before
    assert audit(capsys, "verify", cert_copy)[0] == 0
    fresh = tmp_path / "fresh"
    with folder_lock(fresh):
        assert_user_error(capsys, [*argv, "--out", fresh],
                          f"{fresh}: another process is writing this folder; wait for it to end (or stop it), "
                          "then --resume")
    assert not fresh.exists()  # the lock's folder, empty, is removed again


def test_a_resume_beside_a_running_run_is_refused_and_the_run_loses_nothing(capsys, long_suite, tiny_checkpoint,
                                                                            uninterrupted, tmp_path):
    out = tmp_path / "run"
    argv, child = run_with_a_part_stored(long_suite, tiny_checkpoint, out)
    assert_user_error(capsys, [*argv[1:], "--resume"],
                      f"{out}: another process is writing this folder; wait for it to end (or stop it), then --resume")
    stdout, stderr = child.communicate(timeout=120)
    expected = json.loads((uninterrupted / "root.json").read_text())
    assert (child.returncode, stderr) == (0, b"")
    assert stdout.decode() == f"run {out}: {len(LONG_SUITE)} requests, logit root {expected['logit_root']}\n"
    assert check_run(out) == [] and json.loads((out / "root.json").read_text()) == expected


def test_certify_refuses_a_non_empty_folder(capsys, certified, cert_copy, tiny_checkpoint, tmp_path):
    argv = ["certify", "--model", tiny_checkpoint, "--suite", certified.suite, "--sweep", certified.sweep,
            "--no-progress"]
    assert_user_error(capsys, [*argv, "--out", cert_copy.parent],
                      f"{cert_copy.parent} is not empty: pass --resume to continue it, or a new output folder")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert_user_error(capsys, [*argv, "--out", other], f"{other} is not empty: use a new output folder")
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    assert_user_error(capsys, [*argv, "--out", other / "notes.txt"],
                      f"{other / 'notes.txt'}: exists and is not a folder")
    assert (other / "notes.txt").read_text() == "mine"


def test_certify_resume_refuses_another_sweep(capsys, certified, cert_copy, tiny_checkpoint, tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({**SWEEP, "controls": []}))
    assert_user_error(capsys, ["certify", "--model", tiny_checkpoint, "--suite", certified.suite, "--sweep", sweep,
                               "--out", cert_copy.parent, "--resume", "--no-progress"],
                      f"{cert_copy.parent}: cannot resume with a different sweep than the one recorded in sweep.json")


# --- bad input -----------------------------------------------------------------------------------------

REF = {"name": "ref"}


@pytest.mark.parametrize("text, message", [
    ('{"reference": ', "not valid JSON (Expecting value)"),
    ("[]", "expected an object with 'reference', 'variants' and optional 'controls'"),
    (json.dumps({"reference": REF, "variants": [{"name": "b"}], "extra": 1}), "unknown key(s) ['extra']"),
    (json.dumps({"reference": REF, "variants": [{"name": "b", "batch": 1}]}),
     "variants[0]: unknown field(s) ['batch']"),
    (json.dumps({"reference": REF, "variants": [{"name": "b", "numerics": "turbo"}]}),
     "variants[0]: unknown numerics 'turbo' (expected one of batch_invariant, fast)"),
    (json.dumps({"reference": REF, "variants": [{"name": "b", "max_num_seqs": "8"}]}),
     "variants[0]: 'max_num_seqs' must be int, got '8'"),
    (json.dumps({"reference": REF, "variants": [{"name": "b"}], "controls": [{"name": "b"}]}),
     "configuration names must be unique, repeated: ['b']"),
    (json.dumps({"reference": REF, "variants": []}),
     "needs at least one entry in 'variants' to compare with the reference"),
    (json.dumps({"reference": REF, "variants": [{"max_num_seqs": 1}]}), "variants[0]: 'name' is required"),
    (json.dumps({"reference": REF, "variants": [{"name": "b", "threads": 0}]}),
     f"variants[0]: threads must be between 1 and this machine's {os.cpu_count()} CPUs, got 0"),
    (json.dumps({"reference": REF, "variants": [{"name": "b", "threads": 100000}]}),
     f"variants[0]: threads must be between 1 and this machine's {os.cpu_count()} CPUs, got 100000"),
    (json.dumps({"reference": REF, "variants": [{"name": "b", "device": "tpu"}]}),
     "variants[0]: unknown device 'tpu' (expected cpu, cuda or cuda:N)"),
    (json.dumps({"reference": REF, "variants": [{"name": "../b"}]}),
     "variants[0]: 'name' must be a non-empty string of letters, digits, '-', '_', '.' (not starting with '.'), "
     "got '../b'"),
])
def test_bad_sweep_files(capsys, certified, tiny_checkpoint, tmp_path, text, message):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(text)
    out = tmp_path / "out"
    assert_user_error(capsys, ["certify", "--model", tiny_checkpoint, "--suite", certified.suite, "--sweep", sweep,
                               "--out", out, "--no-progress"], f"{sweep}: {message}")
    assert not out.exists()


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a"}', '{"prompt": '], "{path}:2: invalid JSON (Expecting value at column 12)"),
    (['{"prompt": "a", "id": "x"}', "", '{"prompt": "b", "id": "x"}'],
     "{path}:3: duplicate id 'x' (first at {path}:1)"),
    (['{"prompt": "a", "tools": []}'], "{path}:1: 'tools' only goes with 'messages'"),
])
def test_bad_suite_lines_are_named_by_file_and_line(capsys, tiny_checkpoint, tmp_path, lines, message):
    suite = write_lines(tmp_path / "suite.jsonl", lines)
    out = tmp_path / "out"
    assert_user_error(capsys, ["run", "--model", tiny_checkpoint, "--suite", suite, "--out", out, "--no-progress"],
                      message.format(path=suite.resolve()))
    assert not out.exists()


def test_missing_suite_file_and_unknown_suite_kind(capsys, certified, tiny_checkpoint, tmp_path):
    missing = tmp_path / "none.jsonl"
    for command in (["run"], ["certify", "--sweep", certified.sweep]):
        argv = [*command, "--model", tiny_checkpoint, "--out", tmp_path / "out", "--no-progress", "--suite"]
        assert_user_error(capsys, [*argv, missing], f"suite '{missing}': no such file")
        assert_user_error(capsys, [*argv, "foo:bar"],
                          "unknown suite kind 'foo' in 'foo:bar' (known: native, traces, lm-eval)")
        assert_user_error(capsys, [*argv, f"native:{missing}"], f"suite 'native:{missing}': no such file")
    assert not (tmp_path / "out").exists()


def test_bad_run_flags(capsys, long_suite, tiny_checkpoint, tmp_path):
    assert_user_error(capsys, ["run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", tmp_path / "out",
                               "--max-num-seqs", "0"],
                      "flags: max_num_seqs must be a positive integer, got 0")
    assert_user_error(capsys, ["run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", tmp_path / "out",
                               "--stagger", "-1"], "flags: stagger must be >= 0, got -1")
    assert_user_error(capsys, ["run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", tmp_path / "out",
                               "--shards", "0"], "flags: shards must be from 1 to 64 (one engine each), got 0")
    assert_user_error(capsys, ["run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", tmp_path / "out",
                               "--shards", "1000"], "flags: shards must be from 1 to 64 (one engine each), got 1000")
    assert_user_error(capsys, ["run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", tmp_path / "out",
                               "--expert-parallel", "2"],
                      "expert_parallel=2 needs 2 processes (torchrun --nproc-per-node 2); this run has 1")
    assert_user_error(capsys, ["run", "--model", tiny_checkpoint, "--suite", long_suite, "--out", tmp_path / "out",
                               "--name", "a/b"],
                      "flags: 'name' must be a non-empty string of letters, digits, '-', '_', '.' (not starting with "
                      "'.'), got 'a/b'")
    assert not (tmp_path / "out").exists()


def test_resume_with_a_damaged_stats_file_stops_before_any_work(capsys, tiny_checkpoint, tmp_path):
    suite = write_lines(tmp_path / "suite.jsonl", SUITE[:2])
    out = tmp_path / "run"
    argv = ["run", "--model", tiny_checkpoint, "--suite", suite, "--out", out, "--no-progress"]
    code, _, err = audit(capsys, *argv, "--resume")  # nothing there to resume: said, then a new run
    assert (code, err) == (0, f"note: {out}: no run to resume there (no manifest.json); starting a new run\n")
    for finished in ("root.json", "streams.parquet"):  # as if killed before the run was sealed
        (out / finished).unlink()
    (out / "parts").mkdir()
    (out / "stats.json").write_text("{garbage")
    assert_user_error(capsys, [*argv, "--resume"], f"{out / 'stats.json'}: not the run's statistics (a JSON object "
                                                   "with sessions, wall_s and preemptions, verify_lengths mapping "
                                                   "draft counts to chunks); delete it to resume")
    assert list((out / "parts").iterdir()) == []


def test_a_full_disk_is_one_line_and_the_run_resumes(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    import errno

    import deepinfer.harness.run_writer

    suite = write_lines(tmp_path / "suite.jsonl", SUITE[:2])
    out = tmp_path / "run"
    argv = ["run", "--model", tiny_checkpoint, "--suite", suite, "--out", out, "--no-progress"]

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with monkeypatch.context() as patch:
        patch.setattr(deepinfer.harness.run_writer, "atomic_write", full)  # the stats.json write
        assert_user_error(capsys, argv, f"{out / 'stats.json'}: No space left on device")
    assert audit(capsys, *argv, "--resume")[0] == 0
    assert check_run(out) == []


def test_a_piped_certification_reports_progress_on_stderr(capsys, monkeypatch, certified, tiny_checkpoint, tmp_path):
    import deepinfer.progress

    monkeypatch.setattr(deepinfer.progress, "STATUS_SECONDS", 0.0)  # a status line at every request
    code = main(["audit", "certify", "--model", str(tiny_checkpoint), "--suite", str(certified.suite), "--sweep",
                 str(certified.sweep), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.splitlines()
    assert code == 0
    names = list(CONFIGURATIONS)
    assert [line for line in err if line.startswith("configuration ")] == [
        f"configuration {k}/{len(names)}: {name} ({CONFIGURATIONS[name]})" for k, name in enumerate(names, start=1)]
    assert "ref: 1/4 requests" in err and "ref: 4/4 requests (done)" in err


def test_certify_records_the_checkpoint_hash_of_its_bytes_not_a_forged_cache(capsys, tiny_checkpoint, tmp_path):
    from deepinfer.checkpoint import content_hash
    from deepinfer.checkpoint.files import weight_files
    from deepinfer.checkpoint.hashing import cache_path

    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    real = content_hash(model)
    entry = cache_path(weight_files(model))
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "sha256": "0" * 64}))
    later = max(p.stat().st_ctime_ns for p in model.iterdir()) + 10**9
    os.utime(entry, ns=(later, later))
    assert content_hash(model) == "0" * 64  # the forged entry is served to whoever trusts the cache
    suite = write_lines(tmp_path / "suite.jsonl", SUITE[:1])
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(SWEEP))
    code, _, _ = audit(capsys, "certify", "--model", model, "--suite", suite, "--sweep", sweep, "--out",
                       tmp_path / "out", "--no-progress")
    assert code == 0
    assert json.loads((tmp_path / "out" / "certificate.json").read_text())["checkpoint"]["content_hash"] == real
