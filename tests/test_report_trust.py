"""What `audit report` and `audit verify` trust in a certification folder: a report is refused (one-line
error, exit 2) for a certificate that does not verify; nothing is written or deleted through a symbolic
link; run folders reached through a link are a problem; verify names the key that signed.

Each test lays out tmp_path/cert (the certification folder) and tmp_path/outside, and checks that the
command left every file of tmp_path/outside as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from deepinfer.audit.certificate import generate_keypair, seal, sign, verdict, verify_certificate, write_certificate
from deepinfer.audit.files import json_bytes
from deepinfer.harness.cli import main
from test_reports import CONFIGURATIONS, _certify_folder

LINK_PROBLEM = "is a symbolic link; run folders and their files must be real paths inside the certificate's folder"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _audit(capsys, *argv: object) -> tuple[int, str, str]:
    code = main(["audit", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def layout(tmp_path) -> tuple[Path, Path]:
    """A certified folder whose verdict is DIVERGENT (chunked-prefill diverges), and an outside folder."""
    cert = _certify_folder(tmp_path / "cert", CONFIGURATIONS[:3])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.png").write_bytes(b"\x89PNG not mine")
    return cert, outside


def test_report_refuses_a_certificate_whose_verdict_was_edited(capsys, layout):
    folder, outside = layout
    before = _snapshot(outside)
    file = folder / "certificate.json"
    cert = json.loads(file.read_bytes())
    assert cert["verdict"] == "DIVERGENT"
    file.write_bytes(json_bytes({**cert, "verdict": "BITWISE_REPRODUCIBLE"}))  # exact form, stale content hash
    problems = [
        "certificate.json: content hash does not match its contents (edited after sealing?)",
        f"certificate.json: verdict BITWISE_REPRODUCIBLE {cert['verdict_counts']} does not follow from the "
        f"configurations' roots (expected DIVERGENT {verdict(cert['configurations'])[1]})",
    ]
    assert verify_certificate(file) == problems
    code, out, err = _audit(capsys, "report", folder)
    assert (code, out) == (2, "")
    assert err == f"error: {file} does not verify, no report written: {'; '.join(problems)}\n"
    assert not (folder / "report.md").exists() and not (folder / "report.html").exists()
    assert not (folder / "report_files").exists()
    assert _snapshot(outside) == before


def test_report_refuses_a_cpu_isa_statement_its_manifest_does_not_make(capsys, layout):
    """A re-sealed certificate that claims another CPU instruction set than its run recorded."""
    folder, _ = layout
    file = folder / "certificate.json"
    cert = json.loads(file.read_bytes())
    cert["configurations"][1]["cpu_isa"] = "CPU: oneDNN capped at AVX2 (AMX available, not used)"
    write_certificate(file, seal(cert))
    assert verify_certificate(file) == [
        "runs/batch-8/manifest.json: its CPU instruction-set statement differs from what certificate.json certifies"]
    code, out, err = _audit(capsys, "report", folder)
    assert (code, out) == (2, "")
    assert err == ("error: configuration 'batch-8' (runs/batch-8): the certificate's CPU instruction-set statement "
                   "does not match its manifest\n")
    assert not (folder / "report.md").exists()


@pytest.mark.parametrize("target", ["report_files", "report.md", "report_files/invariance.png"])
def test_report_writes_nothing_through_a_symbolic_link(capsys, layout, target):
    folder, outside = layout
    if target != "report_files":
        (folder / "report_files").mkdir()
    (folder / target).symlink_to(outside if target == "report_files" else outside / "keep.png")
    before = _snapshot(outside)
    code, out, err = _audit(capsys, "report", folder)
    assert (code, out, err) == (
        2, "", f"error: {folder / target}: is a symbolic link; a report writes only real files inside {folder}\n")
    assert _snapshot(outside) == before
    assert not (folder / "report.html").exists()


def test_report_files_must_be_a_folder(capsys, layout):
    folder, _ = layout
    (folder / "report_files").write_bytes(b"a file")
    code, out, err = _audit(capsys, "report", folder)
    assert (code, out) == (2, "")
    assert err == (f"error: {folder / 'report_files'}: is not a folder; a report writes its figures into a real "
                   "folder there\n")
    assert (folder / "report_files").read_bytes() == b"a file"


@pytest.mark.parametrize(("linked", "named"), [
    ("runs/batch-8", "runs/batch-8"),
    ("runs/batch-8/streams.parquet", "runs/batch-8/streams.parquet"),
    ("runs", "runs"),
])
def test_a_run_reached_through_a_symbolic_link_is_a_problem(capsys, layout, linked, named):
    folder, outside = layout
    moved = outside / "moved"
    shutil.move(folder / linked, moved)
    (folder / linked).symlink_to(moved)  # same bytes: only the link is wrong
    before = _snapshot(outside)
    problems = [f"{named}: {LINK_PROBLEM}"] * (3 if linked == "runs" else 1)  # once per configuration under it
    assert verify_certificate(folder) == problems
    code, out, err = _audit(capsys, "verify", folder / "certificate.json")
    assert (code, out, err) == (1, "", "".join(f"FAIL: {problem}\n" for problem in problems))
    code, out, err = _audit(capsys, "report", folder)
    run = "runs/reference" if linked == "runs" else "runs/batch-8"
    assert (code, out, err) == (2, "", f"error: configuration {run.split('/')[1]!r} ({run}): {named}: {LINK_PROBLEM}\n")
    assert _snapshot(outside) == before


def test_a_certificate_that_is_a_symbolic_link_is_refused(capsys, layout):
    """A link could point at any certificate, vouching for runs of another folder: verify fails (exit 1)
    and report refuses (exit 2), both in one line, and nothing is written."""
    folder, outside = layout
    file = folder / "certificate.json"
    shutil.move(file, outside / "certificate.json")
    file.symlink_to(outside / "certificate.json")  # the same bytes, only reached through the link
    before = _snapshot(outside)
    problem = f"{file}: is a symbolic link; a certificate must be a real file in its certification folder"
    assert verify_certificate(folder) == [problem]
    assert _audit(capsys, "verify", file) == (1, "", f"FAIL: {problem}\n")
    code, out, err = _audit(capsys, "report", folder)
    assert (code, out, err) == (2, "", f"error: {problem}\n")
    assert not (folder / "report.md").exists() and _snapshot(outside) == before


def _fingerprint(public_pem: bytes) -> str:
    key = serialization.load_pem_public_key(public_pem)
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "SHA256:" + hashlib.sha256(raw).hexdigest()


def test_verify_names_the_signer_and_whether_it_was_pinned(capsys, layout, tmp_path):
    folder, _ = layout
    file = folder / "certificate.json"
    code, out, err = _audit(capsys, "verify", file)
    assert (code, out, err) == (0, f"OK: {file} is intact\nunsigned: anyone able to write the folder could have "
                                   "made it\n", "")
    unsigned = json.loads(file.read_bytes())
    for who in ("signer", "someone-else"):  # re-signing by another key verifies too: only pinning tells
        private, public = generate_keypair()
        (tmp_path / f"{who}.pub").write_bytes(public)
        write_certificate(file, sign(unsigned, private))
        code, out, err = _audit(capsys, "verify", file)
        assert (code, out, err) == (0, f"OK: {file} is intact\nsigned by key {_fingerprint(public)}, not pinned: "
                                       "pass --public-key to require it\n", "")
    code, out, err = _audit(capsys, "verify", file, "--public-key", tmp_path / "someone-else.pub")
    assert (code, out, err) == (0, f"OK: {file} is intact\nsigned by the pinned key {_fingerprint(public)}\n", "")
    code, out, err = _audit(capsys, "verify", file, "--public-key", tmp_path / "signer.pub")
    assert (code, out, err) == (1, "", "FAIL: certificate.json: signed by a different key than the given public key\n")


def test_the_report_names_the_signer(layout):
    folder, _ = layout
    file = folder / "certificate.json"
    private, public = generate_keypair()
    write_certificate(file, sign(json.loads(file.read_bytes()), private))
    main(["audit", "report", str(folder)])
    assert (f"signed by key {_fingerprint(public)} (not pinned: audit verify --public-key pins it)"
            in (folder / "report.md").read_text(encoding="utf-8"))
