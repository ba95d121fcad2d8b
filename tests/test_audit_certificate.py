"""certificate.json: building, sealing, signing, verifying against the runs, and the verdict rules."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.audit.certificate import (
    BITWISE,
    DIVERGENT,
    TOKEN,
    build_certificate,
    control_verdicts,
    cpu_isa_statement,
    generate_keypair,
    load_certificate,
    reference_run,
    seal,
    sign,
    verdict,
    verify_certificate,
    write_certificate,
)
from deepinfer.audit.errors import AuditError
from deepinfer.audit.store import RunStore, file_digests, make_row

REF = [[1, 2, 3], [4, 5], [6]]
DRIFTED = 2.0**-20  # added to one logprob: same tokens, other fp32 bits
SUITE = {"name": "t", "content_hash": "5" * 64}
CHECKPOINT = {"content_hash": "c" * 64}


CAPPED = "oneDNN capped at AVX512_CORE_BF16 (AMX available, not used; bf16 matmuls: brg_matmul:avx512_core_bf16)"


def torch_cpu(summary: str | None = CAPPED, **variables) -> dict:
    """A manifest's environment.torch_cpu; `summary` None: as recorded before the effective ISA was."""
    cpu = {"capability": "AVX512", "threads": 2, "mkl_cbwr": None, "mkl_enable_instructions": None,
           "onednn_max_cpu_isa": "AVX512_CORE_BF16", **variables}
    if summary is not None:
        cpu["onednn"] = {"requested": "AVX512_CORE_BF16", "amx_used": False, "summary": summary}
    return cpu


def make_run(path: Path, tokens: list[list[int]], *, bump: tuple[int, int] | None = None,
             cpu: dict | None = None) -> None:
    """A finished run; `bump` = (request, position) whose logprob gets DRIFTED added; `cpu` the
    manifest's environment.torch_cpu (none by default)."""
    manifest = {"variant": {"kernel": path.name}, "suite": SUITE, "checkpoint": CHECKPOINT}
    if cpu is not None:
        manifest["environment"] = {"torch_cpu": cpu}
    store = RunStore.create(path, manifest)
    rows = []
    for i, ids in enumerate(tokens):
        logprobs = [-0.5 - (DRIFTED if bump == (i, p) else 0.0) for p in range(len(ids))]
        rows.append(make_row(i, f"q{i}", [9, 9], {"seed": 1}, ids, logprobs, [[t, t + 1] for t in ids],
                             [[lp, -2.0] for lp in logprobs], None, "length", None, 0.0, 0.1, 0.2))
    store.append(rows)
    store.finalize()


def configuration(name: str, role: str) -> dict:
    return {"name": name, "role": role, "config": {"kernel": name}, "run": f"runs/{name}"}


def certify(base: Path, configs: list[tuple[str, str]], *, key: bytes | None = None, threshold: float = 1e-2) -> dict:
    cert = seal(build_certificate(
        out_dir=base, reference="ref", configurations=[configuration(*c) for c in configs],
        suite=SUITE, checkpoint=CHECKPOINT, rerun={"argv": ["x"]}, near_tie_threshold=threshold,
        created="2025-01-01T00:00:00+00:00",
    ))
    if key is not None:
        cert = sign(cert, key)
    write_certificate(base / "certificate.json", cert)
    return cert


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("certified")
    make_run(base / "runs" / "ref", REF)
    make_run(base / "runs" / "same", REF)
    make_run(base / "runs" / "drift", REF, bump=(1, 1))
    make_run(base / "runs" / "div", [[1, 2, 3], [4, 5], [7]])
    return base


@pytest.fixture(scope="module")
def keys() -> tuple[bytes, bytes]:
    return generate_keypair()


@pytest.fixture
def out(runs, tmp_path) -> Path:
    """A private copy of the runs folder for tests that write or tamper."""
    return Path(shutil.copytree(runs, tmp_path / "out"))


def flip(file: Path, position: int, mask: int = 0x01) -> None:
    data = bytearray(file.read_bytes())
    data[position] ^= mask
    file.write_bytes(bytes(data))


def test_build_write_verify_round_trip(out):
    cert = certify(out, [("ref", "reference"), ("same", "variant"), ("drift", "variant"), ("div", "control")])
    assert verify_certificate(out / "certificate.json") == []
    assert verify_certificate(out) == []  # the folder works too
    assert load_certificate(out / "certificate.json") == cert
    assert cert["verdict"] == TOKEN
    assert cert["verdict_counts"] == {"variants": 2, "bitwise_equal": 1, "token_only": 1, "divergent": 0,
                                      "requests_diverged": 0, "requests": 3, "served": 3, "errored": 0,
                                      "errored_by_kind": {}, "requests_errored_differently": 0}
    assert cert["controls"] == [{"name": "div", "verdict": DIVERGENT, "comparison": {
        "equal": 2, "logprob_drift": 0, "diverged": 1, "near_tie": 0, "missing": 0, "error": 0}}]
    by_name = {c["name"]: c for c in cert["configurations"]}
    assert by_name["drift"]["comparison"] == {"equal": 2, "logprob_drift": 1, "diverged": 0, "near_tie": 0,
                                              "missing": 0, "error": 0}
    assert by_name["ref"]["comparison"]["equal"] == 3
    assert by_name["same"]["files"] == file_digests(out / "runs" / "same")
    assert by_name["same"]["token_root"] == by_name["ref"]["token_root"]
    assert not list(out.glob("*.tmp"))


def test_seal_is_idempotent_and_drops_a_signature(runs, keys):
    cert = seal(build_certificate(out_dir=runs, reference="ref", suite={}, checkpoint={}, rerun={},
                                  configurations=[configuration("ref", "reference"), configuration("same", "variant")]))
    assert seal(cert) == cert
    signed = sign(cert, keys[0])
    assert seal(signed) == cert


def entry(name: str, role: str, token: str, logit: str, diverged: int = 0) -> dict:
    return {"name": name, "role": role, "token_root": token * 64, "logit_root": logit * 64, "count": 10,
            "errors": {}, "comparison": {"diverged": diverged, "near_tie": 0, "error": 0}}


@pytest.mark.parametrize(
    ("variants", "expected", "counts"),
    [
        ([("a", "a")], BITWISE, (1, 0, 0, 0)),
        ([("a", "a"), ("a", "b")], TOKEN, (1, 1, 0, 0)),
        ([("a", "b"), ("c", "c", 4), ("a", "a")], DIVERGENT, (1, 1, 1, 4)),
        ([("c", "c", 2), ("c", "d", 3)], DIVERGENT, (0, 0, 2, 5)),
    ],
)
def test_verdict_rules(variants, expected, counts):
    configs = [entry("ref", "reference", "a", "a")]
    configs += [entry(f"v{i}", "variant", *v) for i, v in enumerate(variants)]
    configs += [entry("ctl", "control", "z", "z", 9)]  # controls never change the main verdict
    overall, got = verdict(configs)
    assert overall == expected
    assert (got["bitwise_equal"], got["token_only"], got["divergent"], got["requests_diverged"]) == counts
    assert got["variants"] == len(variants)
    assert control_verdicts(configs) == [
        {"name": "ctl", "verdict": DIVERGENT, "comparison": {"diverged": 9, "near_tie": 0, "error": 0}}
    ]


def test_verdict_needs_one_reference_and_a_variant():
    with pytest.raises(AuditError, match="at least one variant"):
        verdict([entry("ref", "reference", "a", "a"), entry("c", "control", "a", "a")])
    with pytest.raises(AuditError, match="exactly one reference"):
        verdict([entry("r1", "reference", "a", "a"), entry("r2", "reference", "a", "a"),
                 entry("v", "variant", "a", "a")])


def make_error_run(path: Path, errors: list[tuple[str, str] | None]) -> None:
    """A finished run of len(errors) requests: None serves [1, 2], (kind, detail) is an error row."""
    store = RunStore.create(path, {"variant": {"kernel": path.name}, "suite": SUITE, "checkpoint": CHECKPOINT})
    rows = []
    for i, error in enumerate(errors):
        if error is None:
            rows.append(make_row(i, f"q{i}", [9], {"seed": 1}, [1, 2], [-0.5, -0.5], [[1, 2], [2, 3]],
                                 [[-0.5, -2.0], [-0.5, -2.0]], None, "length", None, 0.0, 0.1, 0.2))
        else:
            rows.append(make_row(i, f"q{i}", [], {"seed": 1}, [], [], [], [], None, "error", error[1], 0.0, None,
                                 0.0, error_kind=error[0]))
    store.append(rows)
    store.finalize()


def test_errored_requests_are_counted_by_kind_and_compared_by_kind_and_detail(tmp_path):
    long, bad = ("prompt_too_long", "prompt has 9000 tokens"), ("malformed", "messages[2].role: unknown")
    reference = [None, long, long, bad]
    make_error_run(tmp_path / "runs" / "ref", reference)
    make_error_run(tmp_path / "runs" / "same", reference)
    make_error_run(tmp_path / "runs" / "other", [None, long, ("malformed", "prompt has 9000 tokens"), bad])
    cert = certify(tmp_path, [("ref", "reference"), ("same", "variant")])
    assert cert["verdict"] == BITWISE
    counts = cert["verdict_counts"]
    assert (counts["requests"], counts["served"], counts["errored"]) == (4, 1, 3)
    assert counts["errored_by_kind"] == {"malformed": 1, "prompt_too_long": 2}
    assert counts["requests_errored_differently"] == 0
    assert {c["name"]: c["errors"] for c in cert["configurations"]} == {
        "ref": {"malformed": 1, "prompt_too_long": 2}, "same": {"malformed": 1, "prompt_too_long": 2}}
    assert verify_certificate(tmp_path) == []

    (tmp_path / "certificate.json").unlink()
    cert = certify(tmp_path, [("ref", "reference"), ("other", "variant")])
    assert cert["verdict"] == DIVERGENT  # same detail, other kind: not the same error
    assert cert["verdict_counts"]["requests_errored_differently"] == 1

    forged = seal({**cert, "configurations": [{**c, "errors": {}} for c in cert["configurations"]],
                   "verdict_counts": {**cert["verdict_counts"], "errored": 0, "served": 4, "errored_by_kind": {}}})
    write_certificate(tmp_path / "certificate.json", forged)
    problems = verify_certificate(tmp_path)
    assert any("errors of 'ref' {} do not match its run" in p for p in problems)


def test_a_divergent_control_keeps_the_verdict_bitwise(out):
    cert = certify(out, [("ref", "reference"), ("same", "variant"), ("div", "control")])
    assert cert["verdict"] == BITWISE
    assert cert["controls"][0]["verdict"] == DIVERGENT
    assert verify_certificate(out) == []


@pytest.fixture
def signed_small(out, keys) -> Path:
    certify(out, [("ref", "reference"), ("same", "variant")], key=keys[0])
    return out / "certificate.json"


def test_flipping_any_byte_of_the_certificate_is_reported(signed_small):
    original = signed_small.read_bytes()
    assert verify_certificate(signed_small) == []
    unnoticed = []
    for position in range(len(original)):
        flip(signed_small, position)
        if not verify_certificate(signed_small):
            unnoticed.append(position)
        signed_small.write_bytes(original)
    assert unnoticed == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_replacing_any_byte_of_the_certificate_is_reported(signed_small, data):
    original = signed_small.read_bytes()
    position = data.draw(st.integers(0, len(original) - 1))
    mask = data.draw(st.integers(1, 255))
    try:
        flip(signed_small, position, mask)
        assert verify_certificate(signed_small) != []
    finally:
        signed_small.write_bytes(original)


def test_other_spellings_of_the_same_content_are_reported(out, keys):
    """Changes that JSON or base64 decoding would hide: exponent case, whitespace, key order, pad bits."""
    cert = certify(out, [("ref", "reference"), ("same", "variant")], key=keys[0], threshold=1e-5)
    path = out / "certificate.json"
    text = path.read_text()
    value = cert["signature"]["value"]  # 64 bytes: the last character before "==" carries 4 unused bits
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    padded = value[:-3] + alphabet[alphabet.index(value[-3]) | 1] + "=="
    assert base64.b64decode(padded) == base64.b64decode(value)
    spellings = [
        text.replace("1e-05", "1E-05"),
        text.replace('\n  "checkpoint"', '\n \t"checkpoint"'),
        json.dumps(cert),
        text.replace(value, padded),
    ]
    for spelling in spellings:
        assert spelling != text
        path.write_text(spelling)
        assert verify_certificate(path) != [], spelling


def test_signatures_and_pinned_keys(out, keys):
    private, public = keys
    certify(out, [("ref", "reference"), ("same", "variant")], key=private)
    path = out / "certificate.json"
    assert verify_certificate(path, public) == []
    other_public = generate_keypair()[1]
    assert verify_certificate(path, other_public) == [
        "certificate.json: signed by a different key than the given public key"
    ]
    unsigned = certify(out, [("ref", "reference"), ("same", "variant")])
    assert verify_certificate(path) == []
    assert verify_certificate(path, public) == ["certificate.json: not signed, but a public key was given"]
    with pytest.raises(AuditError, match="Ed25519"):
        verify_certificate(path, b"not a key")
    # An edited, resealed certificate that keeps the old signature: the seal is fine, the signature is not.
    signed = sign(unsigned, private)
    forged = {**seal({**signed, "rerun": {"argv": ["evil"]}}), "signature": signed["signature"]}
    write_certificate(path, forged)
    assert verify_certificate(path) == ["certificate.json: signature is not valid for its contents"]


def test_sign_needs_a_sealed_certificate_and_an_ed25519_key(runs, keys):
    cert = build_certificate(out_dir=runs, reference="ref", suite={}, checkpoint={}, rerun={},
                             configurations=[configuration("ref", "reference"), configuration("same", "variant")])
    with pytest.raises(AuditError, match="must be sealed"):
        sign(cert, keys[0])
    with pytest.raises(AuditError, match="private key"):
        sign(seal(cert), keys[1])
    with pytest.raises(AuditError, match="not sealed"):
        write_certificate(runs / "unused.json", cert)


def test_edited_then_resealed_claims_are_checked_against_the_runs(out):
    cert = certify(out, [("ref", "reference"), ("same", "variant"), ("drift", "variant")])
    path = out / "certificate.json"
    write_certificate(path, seal({**cert, "verdict": BITWISE}))
    assert any("does not follow from the configurations' roots" in p for p in verify_certificate(path))
    configs = [dict(c) for c in cert["configurations"]]
    configs[1]["comparison"] = {**configs[1]["comparison"], "equal": 2, "logprob_drift": 1}
    write_certificate(path, seal({**cert, "configurations": configs}))
    assert [p for p in verify_certificate(path) if "comparison of 'same'" in p]


@pytest.mark.parametrize("name", ["streams.parquet", "root.json", "manifest.json"])
def test_a_flipped_byte_in_a_run_file_is_reported_naming_it(out, name):
    certify(out, [("ref", "reference"), ("same", "variant")])
    file = out / "runs" / "same" / name
    flip(file, len(file.read_bytes()) // 2)
    problems = verify_certificate(out)
    assert f"runs/same/{name}: sha256 does not match the certificate (changed after certification?)" in problems


def test_rewritten_streams_fail_check_run(out):
    certify(out, [("ref", "reference"), ("same", "variant")])
    streams = out / "runs" / "same" / "streams.parquet"
    frame = pl.read_parquet(streams)
    frame.with_columns(pl.col("logprobs").list.eval(pl.element() - 1.0)).write_parquet(streams)
    problems = verify_certificate(out)
    assert any("logit_hash does not match" in p for p in problems)
    assert any(p.startswith("runs/same/streams.parquet: sha256") for p in problems)


def test_a_replaced_run_shows_root_mismatch(out):
    certify(out, [("ref", "reference"), ("same", "variant")])
    shutil.rmtree(out / "runs" / "same")
    make_run(out / "runs" / "same", [[1, 2, 3], [4, 6], [6]])
    problems = verify_certificate(out)
    assert "runs/same/root.json: token_root differs from the certificate" in problems
    assert "runs/same/root.json: logit_root differs from the certificate" in problems
    shutil.rmtree(out / "runs" / "same")
    assert verify_certificate(out) == ["runs/same: run folder of configuration 'same' is missing"]


def test_unreadable_or_invalid_certificates(out):
    path = out / "certificate.json"
    with pytest.raises(AuditError, match="cannot read"):
        load_certificate(path)
    path.write_text("{not json")
    with pytest.raises(AuditError, match="not valid JSON"):
        load_certificate(path)
    assert verify_certificate(path)[0].startswith(f"{path}: not valid JSON")
    for number in ("NaN", "1e999"):
        path.write_text(f'{{"format": "deepinfer-certificate/2", "near_tie_threshold": {number}}}')
        with pytest.raises(AuditError, match="not valid JSON"):
            load_certificate(path)
    path.write_text('{"format": "deepinfer-certificate/2", "reference": "ref"}')
    with pytest.raises(AuditError, match="missing field"):
        load_certificate(path)
    cert = certify(out, [("ref", "reference"), ("same", "variant")])
    configs = [dict(c) for c in cert["configurations"]]
    configs[1]["run"] = "../elsewhere"
    path.write_text(json.dumps({**cert, "configurations": configs}))
    with pytest.raises(AuditError, match="relative path inside"):
        load_certificate(path)


def test_reference_run_from_a_certificate_or_a_run(out):
    certify(out, [("ref", "reference"), ("same", "variant")])
    assert reference_run(out / "certificate.json").path == out / "runs" / "ref"
    assert reference_run(out).path == out / "runs" / "ref"
    assert reference_run(out / "runs" / "same").path == out / "runs" / "same"
    with pytest.raises(AuditError, match="neither a certificate nor a run"):
        reference_run(out / "runs")
    (out / "notes.txt").write_text("hello")
    with pytest.raises(AuditError, match="not valid JSON"):
        reference_run(out / "notes.txt")
    make_run(out / "other", [[1]])
    shutil.rmtree(out / "runs" / "ref")
    shutil.copytree(out / "other", out / "runs" / "ref")
    with pytest.raises(AuditError, match="root differs"):
        reference_run(out)


@pytest.mark.parametrize(
    ("configs", "reference", "match"),
    [
        ([configuration("ref", "reference"), configuration("same", "variant")], "same", "role 'reference'"),
        ([configuration("ref", "reference"), {**configuration("same", "variant"), "run": "../x"}], "ref", "relative"),
        ([configuration("ref", "reference"), configuration("same", "judge")], "ref", "role 'judge'"),
        ([configuration("ref", "reference"), configuration("nope", "variant")], "ref", "missing"),
        ([configuration("ref", "reference"), configuration("ref", "variant")], "ref", "unique"),
        ([configuration("ref", "reference")], "ref", "at least one variant"),
    ],
)
def test_build_rejects_bad_configurations(runs, configs, reference, match):
    with pytest.raises(AuditError, match=match):
        build_certificate(out_dir=runs, reference=reference, configurations=configs, suite={}, checkpoint={}, rerun={})



@pytest.mark.parametrize(("section", "value", "what"), [
    ("suite", {"name": "t", "content_hash": "6" * 64}, "suite"),
    ("checkpoint", {"content_hash": "d" * 64}, "checkpoint"),
    ("variant", {"kernel": "other"}, "configuration"),
])
def test_verify_rejects_a_run_of_another_suite_checkpoint_or_configuration(out, section, value, what) -> None:
    """A run swapped in with its digests and roots re-certified is still caught by its manifest."""
    make_run(out / "runs" / "other", REF)
    manifest_path = out / "runs" / "other" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest[section] = value
    manifest_path.write_text(json.dumps(manifest))
    shutil.rmtree(out / "runs" / "same")
    (out / "runs" / "other").rename(out / "runs" / "same")
    if section != "variant":
        manifest = json.loads((out / "runs" / "same" / "manifest.json").read_text())
        manifest["variant"] = {"kernel": "same"}
        (out / "runs" / "same" / "manifest.json").write_text(json.dumps(manifest))
    certify(out, [("ref", "reference"), ("same", "variant")])
    assert verify_certificate(out / "certificate.json") == [
        f"runs/same/manifest.json: its {what} differs from what certificate.json certifies"]


@pytest.mark.parametrize(("manifest", "statement"), [
    ({"environment": {"torch_cpu": torch_cpu()}}, f"CPU: {CAPPED}"),
    ({"environment": {"torch_cpu": torch_cpu(mkl_enable_instructions="AVX2", mkl_cbwr="AVX2,STRICT")}},
     f"CPU: {CAPPED}; MKL_ENABLE_INSTRUCTIONS=AVX2; MKL_CBWR=AVX2,STRICT"),
    ({"environment": {"torch_cpu": torch_cpu(None)}},
     "CPU: oneDNN capped at AVX512_CORE_BF16 (the ISA in effect was not recorded)"),
    ({"environment": {"torch_cpu": torch_cpu(None, onednn_max_cpu_isa=None)}},
     "CPU: oneDNN not capped (the ISA in effect was not recorded)"),
    ({"environment": {"torch_cpu": None}}, "CPU: instruction-set caps not recorded"),
    ({}, "CPU: instruction-set caps not recorded"),
])
def test_cpu_isa_statement(manifest, statement):
    assert cpu_isa_statement(manifest) == statement


def test_certificates_state_each_runs_cpu_isa_and_verify_checks_the_statement(tmp_path):
    make_run(tmp_path / "runs" / "ref", REF, cpu=torch_cpu())
    make_run(tmp_path / "runs" / "same", REF, cpu=torch_cpu(mkl_cbwr="AVX2,STRICT"))
    cert = certify(tmp_path, [("ref", "reference"), ("same", "variant")])
    assert [c["cpu_isa"] for c in cert["configurations"]] == [f"CPU: {CAPPED}", f"CPU: {CAPPED}; MKL_CBWR=AVX2,STRICT"]
    assert verify_certificate(tmp_path) == []
    forged = json.loads((tmp_path / "certificate.json").read_text())
    forged["configurations"][1]["cpu_isa"] = f"CPU: {CAPPED}"
    write_certificate(tmp_path / "certificate.json", seal(forged))
    assert verify_certificate(tmp_path) == [
        "runs/same/manifest.json: its CPU instruction-set statement differs from what certificate.json certifies"]
    forged["configurations"][1]["cpu_isa"] = ["not", "a", "string"]
    write_certificate(tmp_path / "certificate.json", seal(forged))
    assert verify_certificate(tmp_path) == [
        f"{tmp_path / 'certificate.json'}: configuration 'same': cpu_isa must be a string"]


def test_certificates_made_before_the_cpu_isa_statement_still_verify(out):
    cert = certify(out, [("ref", "reference"), ("same", "variant"), ("div", "control")])
    older = seal({**cert, "configurations": [{k: v for k, v in c.items() if k != "cpu_isa"}
                                             for c in cert["configurations"]]})
    write_certificate(out / "certificate.json", older)
    assert verify_certificate(out) == []
    assert load_certificate(out) == older
