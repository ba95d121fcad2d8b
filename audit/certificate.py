"""certificate.json: the configurations run, their roots and file digests, the verdict, how to re-run.

The certificate is sealed by `content_hash` (SHA-256 of its canonical JSON without content_hash and
signature) and optionally signed with Ed25519 over the 32 raw bytes of that hash. The file itself is
written in one fixed form (sorted keys, indent 2, ASCII, trailing newline) and verification insists on
that form, so that any change to any byte of the file is reported.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import NoReturn

import polars as pl
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from deepinfer.audit.compare import compare_streams, summarize
from deepinfer.audit.errors import AuditError
from deepinfer.audit.files import atomic_write, json_bytes
from deepinfer.audit.manifest import describe_protocol
from deepinfer.audit.store import MANIFEST, ROOT, STREAMS, Run, check_run, file_digests, read_run, read_stats
from deepinfer.audit.streams import HEX_DIGEST, canonical_json

CERTIFICATE_FORMAT = "deepinfer-certificate/2"
CERTIFICATE = "certificate.json"
ROLES = ("reference", "variant", "control")
BITWISE, TOKEN, DIVERGENT = "BITWISE_REPRODUCIBLE", "TOKEN_REPRODUCIBLE", "DIVERGENT"
NOTHING_SERVED = "NO_REQUESTS_SERVED"  # every request errored (or the suite was empty): nothing was compared
VERDICTS = (BITWISE, TOKEN, DIVERGENT, NOTHING_SERVED)
COMPARISON_KEYS = ("equal", "logprob_drift", "diverged", "near_tie", "missing", "error")
RUN_FILES = (MANIFEST, STREAMS, ROOT)
RUNS = "runs"  # the folder of a certificate or crosscheck that holds its runs

_SEAL_KEYS = ("content_hash", "signature")
_TOP_KEYS = {
    "format", "created", "suite", "checkpoint", "rerun", "reference", "near_tie_threshold",
    "configurations", "verdict", "verdict_counts", "controls", "content_hash",
}
_CONFIG_KEYS = {"name", "role", "config", "run", "count", "token_root", "logit_root", "files", "comparison", "errors"}
# cpu_isa: certificates made before it lack it; speculation: a speculating configuration's drafts (its run's
# stats.json), where the run has them
_OPTIONAL_CONFIG_KEYS = {"cpu_isa", "speculation"}
SPECULATION_COUNTS = {"drafted": "drafted", "kept": "drafts_kept", "verify_chunks": "verify_chunks",
                      "rollbacks": "rollbacks"}  # certificate key: stats.json key
SPECULATION_KEYS = (*SPECULATION_COUNTS, "verify_lengths", "acceptance", "mean_accepted_length", "tokens_per_forward")
_MKL_VARIABLES = (("mkl_enable_instructions", "MKL_ENABLE_INSTRUCTIONS"), ("mkl_cbwr", "MKL_CBWR"))
_SIGNATURE_KEYS = {"algorithm", "public_key", "value"}
_LINKED = "is a symbolic link; run folders and their files must be real paths inside the certificate's folder"


def _config_verdict(reference: dict, configuration: dict) -> str:
    if configuration["token_root"] != reference["token_root"]:
        return DIVERGENT
    return BITWISE if configuration["logit_root"] == reference["logit_root"] else TOKEN


def _reference_of(configurations: list[dict]) -> dict:
    references = [c for c in configurations if c["role"] == "reference"]
    if len(references) != 1:
        raise AuditError(f"a certificate needs exactly one reference configuration, got {len(references)}")
    return references[0]


def verdict(configurations: list[dict]) -> tuple[str, dict]:
    """The verdict over the variant configurations (certificate entries) against the reference.

    BITWISE_REPRODUCIBLE: every variant's logit_root equals the reference's; TOKEN_REPRODUCIBLE: all
    token_roots equal but some logit_root differs; DIVERGENT otherwise; NO_REQUESTS_SERVED where the
    roots agree but the reference served no request (equal roots then only say the errors were
    equal). Controls do not count.
    `requests_diverged` sums the diverged requests over the variants. Errored requests are part of
    the roots (an error row hashes its kind and detail), so equal roots mean they errored identically;
    the counts say how many requests that covers: `requests`, `served` and `errored` (by kind) in the
    reference run, and `requests_errored_differently`, summed over the variants.
    """
    reference = _reference_of(configurations)
    variants = [c for c in configurations if c["role"] == "variant"]
    if not variants:
        raise AuditError("a verdict needs at least one variant configuration")
    verdicts = [_config_verdict(reference, c) for c in variants]
    errored = sum(reference["errors"].values())
    counts = {
        "variants": len(variants),
        "bitwise_equal": verdicts.count(BITWISE),
        "token_only": verdicts.count(TOKEN),
        "divergent": verdicts.count(DIVERGENT),
        "requests_diverged": sum(c["comparison"]["diverged"] for c in variants),
        "requests": reference["count"],
        "served": reference["count"] - errored,
        "errored": errored,
        "errored_by_kind": dict(sorted(reference["errors"].items())),
        "requests_errored_differently": sum(c["comparison"]["error"] for c in variants),
    }
    if counts["divergent"]:
        return DIVERGENT, counts
    if not counts["served"]:
        return NOTHING_SERVED, counts
    return (TOKEN if counts["token_only"] else BITWISE), counts


def verdict_summary(cert: dict) -> str:
    """The verdict in one line that never claims more than what ran: how many requests it covers, and
    every errored request counted by kind."""
    counts = cert["verdict_counts"]
    variants = [c for c in cert["configurations"] if c["role"] == "variant"]
    drift = sum(c["comparison"]["logprob_drift"] for c in variants)
    parts = [f"{cert['verdict']} over " + (f"{counts['served']} of {counts['requests']} requests" if counts["errored"]
                                          else f"all {counts['requests']} requests")]
    if counts["errored"]:
        where = "in the reference" if counts["requests_errored_differently"] else "identically in every variant"
        parts.append(f"{counts['errored']} errored {where} ({describe_errors(counts['errored_by_kind'])})")
    if counts["requests_errored_differently"]:
        parts.append(f"{counts['requests_errored_differently']} request errors differ from the reference's")
    parts.append(f"{_count(len(variants), 'variant')} vs reference {cert['reference']}: "
                 f"{_count(counts['requests_diverged'], 'request divergence')}, {_count(drift, 'logprob-only drift')}")
    return "; ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def describe_errors(by_kind: dict[str, int]) -> str:
    """Error counts as text, e.g. "2 malformed, 26 prompt too long"."""
    return ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in by_kind.items())


def error_counts(streams: pl.DataFrame) -> dict[str, int]:
    """Errored requests of a run by error kind (sorted by kind)."""
    kinds = streams.filter(pl.col("finish_reason") == "error")["error_kind"].to_list()
    return {kind: kinds.count(kind) for kind in sorted(set(kinds))}


def control_verdicts(configurations: list[dict]) -> list[dict]:
    """Each control configuration's own verdict against the reference, with its comparison counts."""
    reference = _reference_of(configurations)
    return [
        {"name": c["name"], "verdict": _config_verdict(reference, c), "comparison": c["comparison"]}
        for c in configurations
        if c["role"] == "control"
    ]


def cpu_isa_statement(manifest: dict) -> str:
    """What a run's manifest records about the CPU and the code paths its kernels took, in one line
    that starts "CPU: ": the CPU's model and vendor, MKL's code path as MKL reported it, oneDNN's cap
    and what was in effect (the engine's own summary, e.g. "oneDNN capped at AVX512_CORE_BF16 (AMX
    available, not used; bf16 matmuls: brg_matmul:avx512_core_bf16)"), MKL_ENABLE_INSTRUCTIONS and
    MKL_CBWR where set, then each start self-test of the batch-invariant primitives. Manifests written
    before a part was recorded leave it out (before the effective ISA: the cap alone)."""
    environment = manifest.get("environment")
    cpu = environment.get("torch_cpu") if isinstance(environment, dict) else None
    if not isinstance(cpu, dict):
        return "CPU: instruction-set caps not recorded"
    parts = []
    if isinstance(environment.get("cpu"), str) and isinstance(environment.get("cpu_vendor"), str):
        parts.append(f"{environment['cpu']} ({environment['cpu_vendor']})")
    mkl = cpu.get("mkl")
    if isinstance(mkl, dict) and isinstance(mkl.get("path"), str):
        parts.append(f"MKL for {mkl['path']}, CNR:{mkl.get('cnr')}")
    onednn = cpu.get("onednn")
    if isinstance(onednn, dict) and isinstance(onednn.get("summary"), str):
        parts.append(onednn["summary"])
    elif cpu.get("onednn_max_cpu_isa"):
        parts.append(f"oneDNN capped at {cpu['onednn_max_cpu_isa']} (the ISA in effect was not recorded)")
    else:
        parts.append("oneDNN not capped (the ISA in effect was not recorded)")
    parts += [f"{name}={cpu[key]}" for key, name in _MKL_VARIABLES if cpu.get(key)]
    selftests = cpu.get("selftest")
    if isinstance(selftests, dict):
        parts += [_selftest_statement(key, record) for key, record in sorted(selftests.items())]
    return "CPU: " + "; ".join(str(part) for part in parts)


def _selftest_statement(key: str, record: object) -> str:
    if not isinstance(record, dict):
        return f"self-test ({key}) not readable"
    if record.get("passed"):
        tiles = record.get("row_tiles")
        if isinstance(tiles, list) and tiles:
            return f"self-test passed ({key}; row tiles {', '.join(str(tile) for tile in tiles)})"
        return f"self-test passed ({key})"
    variant = ", ".join(str(name) for name in record.get("variant") or []) or "some primitive"
    waiver = ", waived by DEEPINFER_ALLOW_VARIANT_CPU=1" if record.get("waived") else ""
    return f"self-test FAILED ({key}: {variant} depend on the batch{waiver})"


def speculation_figures(stats: dict | None) -> dict | None:
    """What a speculating run's drafts did, from its stats.json: the counts, how many chunks verified each
    number of drafts, and the rates (acceptance: kept of drafted; mean accepted length: kept per verifying
    chunk; tokens per forward: that plus the token the target adds), rounded to 4 decimals, None where
    nothing was drafted. None when the stats do not hold them."""
    if not isinstance(stats, dict):
        return None
    counts = {key: stats.get(name) for key, name in SPECULATION_COUNTS.items()}
    lengths = stats.get("verify_lengths", {})
    if not all(_is_count(n) for n in counts.values()) or not isinstance(lengths, dict) or not all(
            isinstance(k, str) and k.isdigit() and _is_count(n) for k, n in lengths.items()):
        return None
    drafted, kept, chunks = counts["drafted"], counts["kept"], counts["verify_chunks"]
    return {**counts, "verify_lengths": lengths,
            "acceptance": round(kept / drafted, 4) if drafted else None,
            "mean_accepted_length": round(kept / chunks, 4) if chunks else None,
            "tokens_per_forward": round(1 + kept / chunks, 4) if chunks else None}


def _speculates(configuration: dict) -> bool:
    return configuration["config"].get("speculation", "off") != "off"


def _run_dir(base: Path, run: object, where: str) -> Path:
    """The run folder of a configuration: a relative path inside `base`."""
    if not isinstance(run, str) or not run:
        raise AuditError(f"{where}: run must be a non-empty relative path, got {run!r}")
    relative = PurePosixPath(run)
    if relative.is_absolute() or ".." in relative.parts or "\\" in run:
        raise AuditError(f"{where}: run {run!r} must be a relative path inside the certificate's folder")
    return base / relative


def build_certificate(
    *,
    out_dir: str | os.PathLike,
    reference: str,
    configurations: list[dict],
    suite: dict,
    checkpoint: dict,
    rerun: dict,
    near_tie_threshold: float = 1e-2,
    created: str | None = None,
) -> dict:
    """An unsealed certificate for finished runs under `out_dir` (where certificate.json will live).

    Each configuration is {"name", "role", "config", "run"} with `run` relative to out_dir; roots, file
    digests and the comparison against the reference run are read and computed here. `checkpoint` (the
    reference run's manifest section) states what prompts were rendered with: a configuration whose run
    was rendered with another protocol (encoding, deepseek-recipe version) or tokenizer is refused,
    since the certificate states one.
    """
    base = Path(out_dir)
    names = [c.get("name") for c in configurations]
    if len(set(names)) != len(names):
        raise AuditError(f"configuration names must be unique, got {names}")
    runs: dict[str, Run] = {}
    for given in configurations:
        if set(given) != {"name", "role", "config", "run"}:
            raise AuditError(f"configuration {given.get('name')!r} must have exactly name, role, config, run")
        if given["role"] not in ROLES:
            raise AuditError(f"configuration {given['name']!r}: role {given['role']!r} is not one of {ROLES}")
        runs[given["name"]] = read_run(_run_dir(base, given["run"], f"configuration {given['name']!r}"))
        _check_rendering(given["name"], checkpoint, runs[given["name"]].manifest)
    if [c["name"] for c in configurations if c["role"] == "reference"] != [reference]:
        raise AuditError(f"{reference!r} must be the one configuration with role 'reference'")
    reference_streams = runs[reference].streams
    entries = []
    for given in configurations:
        run = runs[given["name"]]
        summary = summarize(compare_streams(reference_streams, run.streams, near_tie_threshold))
        entries.append({
            **given,
            "count": run.root["count"],
            "token_root": run.root["token_root"],
            "logit_root": run.root["logit_root"],
            "files": file_digests(run.path),
            "comparison": {key: summary[key] for key in COMPARISON_KEYS},
            "errors": error_counts(run.streams),
            "cpu_isa": cpu_isa_statement(run.manifest),
        })
        figures = speculation_figures(read_stats(run.path)) if _speculates(given) else None
        if figures is not None:  # a run without readable counts (one not recorded by deepinfer) states none
            entries[-1]["speculation"] = figures
    overall, counts = verdict(entries)
    cert = {
        "format": CERTIFICATE_FORMAT,
        "created": created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "suite": suite,
        "checkpoint": checkpoint,
        "rerun": rerun,
        "reference": reference,
        "near_tie_threshold": float(near_tie_threshold),
        "configurations": entries,
        "verdict": overall,
        "verdict_counts": counts,
        "controls": control_verdicts(entries),
    }
    _check_structure(seal(cert), base / CERTIFICATE)  # what is built here must load again
    return cert


def _rendering_claims(checkpoint: dict, manifest: dict) -> list[tuple[str, object, object]]:
    """(what, the run's manifest, the certificate's checkpoint) for what prompts were rendered with:
    the protocol (encoding and deepseek-recipe version) and the tokenizer's content hash. Manifests and
    certificates made before either was recorded lack it on both sides, and agree."""
    recorded = manifest.get("checkpoint") if isinstance(manifest.get("checkpoint"), dict) else {}
    return [("prompt protocol", recorded.get("protocol"), checkpoint.get("protocol")),
            ("tokenizer", _tokenizer_hash(recorded), _tokenizer_hash(checkpoint))]


def _tokenizer_hash(checkpoint: dict) -> object:
    tokenizer = checkpoint.get("tokenizer")
    return tokenizer.get("content_hash") if isinstance(tokenizer, dict) else None


def _check_rendering(name: str, checkpoint: dict, manifest: dict) -> None:
    """AuditError when the run of configuration `name` rendered its prompts otherwise than `checkpoint` states."""
    for what, found, stated in _rendering_claims(checkpoint, manifest):
        if found != stated:
            raise AuditError(f"configuration {name!r}: its run rendered prompts with {_in_words(what, found)}, the "
                             f"certified checkpoint states {_in_words(what, stated)}; a certificate states one: "
                             "record every configuration with it")


def _in_words(what: str, value: object) -> str:
    if what == "prompt protocol":
        return describe_protocol(value)
    return f"tokenizer {value}" if value is not None else "no tokenizer"


def content_hash(cert: dict) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in cert.items() if k not in _SEAL_KEYS})).hexdigest()


def seal(cert: dict) -> dict:
    """The certificate with its content_hash; any previous seal and signature are dropped."""
    body = {k: v for k, v in cert.items() if k not in _SEAL_KEYS}
    return {**body, "content_hash": content_hash(body)}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _public_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sign(cert: dict, private_key_pem: bytes) -> dict:
    """The sealed certificate with an Ed25519 signature over the raw bytes of its content hash."""
    try:
        key = serialization.load_pem_private_key(private_key_pem, password=None)
    except (ValueError, TypeError):
        raise AuditError("private key: not an unencrypted PEM-encoded Ed25519 private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AuditError(f"private key: expected an Ed25519 key, got {type(key).__name__}")
    if cert.get("content_hash") != content_hash(cert):
        raise AuditError("the certificate must be sealed, and unchanged since, before it is signed")
    value = key.sign(bytes.fromhex(cert["content_hash"]))
    signature = {"algorithm": "ed25519", "public_key": _b64(_public_raw(key.public_key())), "value": _b64(value)}
    return {**cert, "signature": signature}


def generate_keypair() -> tuple[bytes, bytes]:
    """A new Ed25519 key pair as (PKCS#8 private PEM, SubjectPublicKeyInfo public PEM)."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


def gather_runs(out_dir: Path, given: list[tuple[str, Path]]) -> list[tuple[str, str]]:
    """Copy each run folder into OUT/runs/NAME (its manifest, streams and root), so that a certificate or
    crosscheck over runs recorded elsewhere verifies wherever its folder goes; the (name, relative folder)
    pairs `build_certificate` and `build_crosscheck` take. The folder must be new or empty."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise AuditError(f"{out_dir}: exists and is not an empty folder; runs are gathered into a new one")
    names = [name for name, _ in given]
    if len(set(names)) != len(names):
        raise AuditError(f"run names must be unique, got {names}: name them NAME=PATH")
    for name, path in given:
        problems = check_run(path)
        if problems:
            raise AuditError(f"run {name!r}: {problems[0]}")
    collected = []
    for name, path in given:
        relative = f"{RUNS}/{name}"
        (out_dir / relative).mkdir(parents=True)
        for file in RUN_FILES:
            shutil.copyfile(path / file, out_dir / relative / file)
        collected.append((name, relative))
    return collected


def write_certificate(path: str | os.PathLike, cert: dict) -> None:
    """Write a sealed certificate atomically (tmp file, fsync, rename, fsync of the folder)."""
    path = Path(path)
    if cert.get("content_hash") != content_hash(cert):
        raise AuditError(f"{path}: refusing to write a certificate that is not sealed (or changed since)")
    atomic_write(path, json_bytes(cert))


def _certificate_file(path: Path) -> Path:
    return path / CERTIFICATE if path.is_dir() else path


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def read_sealed(path: Path) -> tuple[bytes, object]:
    """A sealed file's bytes and its JSON (finite numbers only); AuditError when it is a symbolic link
    (what it vouches for would be read from wherever the link points), unreadable or not JSON."""
    if path.is_symlink():
        raise AuditError(f"{path}: is a symbolic link; a certificate must be a real file in its certification folder")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise AuditError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return raw, json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise AuditError(f"{path}: not valid JSON ({exc})") from None


def _read(path: Path) -> tuple[bytes, dict]:
    raw, cert = read_sealed(path)
    _check_structure(cert, path)
    return raw, cert


def load_certificate(path: str | os.PathLike) -> dict:
    """A certificate whose structure is valid (hashes, signature and runs are not checked here)."""
    return _read(_certificate_file(Path(path)))[1]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_hex(value: object) -> bool:
    return isinstance(value, str) and HEX_DIGEST.fullmatch(value) is not None


def check_sealed_fields(sealed: object, path: Path, format_name: str, keys: set[str]) -> None:
    """AuditError naming `path` unless `sealed` is an object of format `format_name` with exactly `keys`
    (and optionally a signature): the first check of every sealed file (certificate, crosscheck)."""
    if not isinstance(sealed, dict):
        raise AuditError(f"{path}: not a JSON object")
    if sealed.get("format") != format_name:
        raise AuditError(f"{path}: format {sealed.get('format')!r} is not {format_name!r}")
    missing, unknown = sorted(keys - set(sealed)), sorted(set(sealed) - keys - {"signature"})
    if missing:
        raise AuditError(f"{path}: missing field(s) {', '.join(missing)}")
    if unknown:
        raise AuditError(f"{path}: unknown field(s) {', '.join(unknown)}")


def _check_structure(cert: object, path: Path) -> None:
    """AuditError naming `path` and the first field that does not have the certificate format."""

    def fail(problem: str) -> NoReturn:
        raise AuditError(f"{path}: {problem}")

    check_sealed_fields(cert, path, CERTIFICATE_FORMAT, _TOP_KEYS)
    for key in ("suite", "checkpoint", "rerun", "verdict_counts"):
        if not isinstance(cert[key], dict):
            fail(f"{key} must be an object")
    for key in ("created", "reference"):
        if not isinstance(cert[key], str):
            fail(f"{key} must be a string")
    threshold = cert["near_tie_threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        fail("near_tie_threshold must be a finite number")
    if cert["verdict"] not in VERDICTS:
        fail(f"verdict {cert['verdict']!r} is not one of {', '.join(VERDICTS)}")
    if not isinstance(cert["controls"], list):
        fail("controls must be a list")
    if not _is_hex(cert["content_hash"]):
        fail("content_hash is not 64 lower-case hex digits")
    signature = cert.get("signature")
    if "signature" in cert and (not isinstance(signature, dict) or set(signature) != _SIGNATURE_KEYS):
        fail(f"signature must be an object with exactly {', '.join(sorted(_SIGNATURE_KEYS))}")
    configurations = cert["configurations"]
    if not isinstance(configurations, list) or not configurations:
        fail("configurations must be a non-empty list")
    for number, c in enumerate(configurations):
        if not isinstance(c, dict) or not _CONFIG_KEYS <= set(c) <= _CONFIG_KEYS | _OPTIONAL_CONFIG_KEYS:
            fail(f"configuration {number} must be an object with exactly {', '.join(sorted(_CONFIG_KEYS))} "
                 f"(and optionally {', '.join(sorted(_OPTIONAL_CONFIG_KEYS))})")
        where = f"configuration {c['name']!r}"
        if not isinstance(c["name"], str) or c["role"] not in ROLES or not isinstance(c["config"], dict):
            fail(f"configuration {number}: name must be a string, role one of {ROLES}, config an object")
        if not _is_count(c["count"]) or not _is_hex(c["token_root"]) or not _is_hex(c["logit_root"]):
            fail(f"{where}: count must be a non-negative integer and the roots 64 lower-case hex digits")
        if not isinstance(c["files"], dict) or set(c["files"]) != set(RUN_FILES) or not all(
            _is_hex(v) for v in c["files"].values()
        ):
            fail(f"{where}: files must map {', '.join(RUN_FILES)} to sha256 hex digests")
        comparison = c["comparison"]
        if not isinstance(comparison, dict) or set(comparison) != set(COMPARISON_KEYS) or not all(
            _is_count(v) for v in comparison.values()
        ):
            fail(f"{where}: comparison must map {', '.join(COMPARISON_KEYS)} to counts")
        errors = c["errors"]
        if not isinstance(errors, dict) or not all(isinstance(k, str) and _is_count(v) for k, v in errors.items()):
            fail(f"{where}: errors must map error kinds to counts")
        if not isinstance(c.get("cpu_isa", ""), str):
            fail(f"{where}: cpu_isa must be a string")
        if "speculation" in c and (not isinstance(c["speculation"], dict)
                                   or set(c["speculation"]) != set(SPECULATION_KEYS)):
            fail(f"{where}: speculation must be an object with exactly {', '.join(SPECULATION_KEYS)}")
        try:
            _run_dir(path.parent, c["run"], where)
        except AuditError as exc:
            fail(str(exc))
    names = [c["name"] for c in configurations]
    if len(set(names)) != len(names):
        fail("configuration names are not unique")
    if [c["name"] for c in configurations if c["role"] == "reference"] != [cert["reference"]]:
        fail(f"reference {cert['reference']!r} is not the one configuration with role 'reference'")


def signature_problems(cert: dict, public_key_pem: bytes | None, name: str) -> list[str]:
    signature = cert.get("signature")
    pinned = None
    if public_key_pem is not None:
        try:
            pinned = serialization.load_pem_public_key(public_key_pem)
        except (ValueError, TypeError):
            raise AuditError("public key: not a PEM-encoded Ed25519 public key") from None
        if not isinstance(pinned, Ed25519PublicKey):
            raise AuditError(f"public key: expected an Ed25519 key, got {type(pinned).__name__}")
    if signature is None:
        return [f"{name}: not signed, but a public key was given"] if pinned else []
    if signature["algorithm"] != "ed25519":
        return [f"{name}: signature algorithm {signature['algorithm']!r} is not 'ed25519'"]
    try:
        raw_key = base64.b64decode(signature["public_key"], validate=True)
        value = base64.b64decode(signature["value"], validate=True)
        # Only the canonical base64 spelling is accepted, so no character of the signature can change unnoticed.
        if _b64(raw_key) != signature["public_key"] or _b64(value) != signature["value"]:
            raise ValueError("not canonical base64")
        key = Ed25519PublicKey.from_public_bytes(raw_key)
    except (binascii.Error, TypeError, ValueError):
        return [f"{name}: signature public key or value is not valid base64 of an Ed25519 key/signature"]
    problems = []
    if pinned is not None and _public_raw(pinned) != raw_key:
        problems.append(f"{name}: signed by a different key than the given public key")
    try:
        key.verify(value, bytes.fromhex(content_hash(cert)))
    except InvalidSignature:
        problems.append(f"{name}: signature is not valid for its contents")
    return problems


def _derived_problems(cert: dict, name: str) -> list[str]:
    """The verdict, its counts and the controls must follow from the configurations."""
    try:
        overall, counts = verdict(cert["configurations"])
    except AuditError as exc:
        return [f"{name}: {exc}"]
    problems = []
    if (overall, counts) != (cert["verdict"], cert["verdict_counts"]):
        problems.append(f"{name}: verdict {cert['verdict']} {cert['verdict_counts']} does not follow from the "
                        f"configurations' roots (expected {overall} {counts})")
    if control_verdicts(cert["configurations"]) != cert["controls"]:
        problems.append(f"{name}: controls do not follow from the control configurations")
    return problems


def signer_fingerprint(cert: dict) -> str | None:
    """The key a certificate names as its signer, as people compare keys: SHA256: and the hex SHA-256
    of the raw 32-byte Ed25519 public key; None when unsigned. Only meaningful once the certificate
    verifies: the signature block itself is not checked here."""
    signature = cert.get("signature")
    if signature is None:
        return None
    return "SHA256:" + hashlib.sha256(base64.b64decode(signature["public_key"])).hexdigest()


def signer_statement(cert: dict, pinned: bool) -> str:
    """Who signed a verified certificate, in one line: a valid signature by a key nobody pinned proves
    only that someone signed it (anyone can re-sign), so that is said too."""
    signer = signer_fingerprint(cert)
    if signer is None:
        return "unsigned: anyone able to write the folder could have made it"
    if pinned:
        return f"signed by the pinned key {signer}"
    return f"signed by key {signer}, not pinned: pass --public-key to require it"


def run_path_problems(base: Path, run: str) -> list[str]:
    """A run folder, and each file of it that is read, must be a real path inside `base`: a symbolic
    link could point anywhere, so a certificate would vouch for files outside its folder."""
    path = base
    for part in PurePosixPath(run).parts:
        path = path / part
        if path.is_symlink():
            return [f"{path.relative_to(base).as_posix()}: {_LINKED}"]
    return [f"{run}/{file}: {_LINKED}" for file in RUN_FILES if (path / file).is_symlink()]


def digest_problems(c: dict, run_dir: Path) -> list[str]:
    """Where the run's files differ from the SHA-256 digests the certificate records for them."""
    try:
        digests = file_digests(run_dir)
    except AuditError as exc:
        return [str(exc)]
    return [f"{c['run']}/{file}: sha256 does not match the certificate (changed after certification?)"
            for file in RUN_FILES if digests[file] != c["files"][file]]


def _configuration_problems(c: dict, base: Path, name: str) -> list[str]:
    """Real paths, file digests, check_run and the roots of one configuration's run."""
    label = c["run"]
    run_dir = _run_dir(base, label, name)
    linked = run_path_problems(base, label)
    if linked:  # nothing behind a link is read
        return linked
    if not run_dir.is_dir():
        return [f"{label}: run folder of configuration {c['name']!r} is missing"]
    problems = digest_problems(c, run_dir)
    problems.extend(check_run(run_dir))
    try:
        root = json.loads((run_dir / ROOT).read_bytes())
        differing = [key for key in ("count", "token_root", "logit_root") if root.get(key) != c[key]]
    except (OSError, ValueError, AttributeError):
        differing = []  # check_run has reported the unreadable root.json
    problems.extend(f"{label}/{ROOT}: {key} differs from the certificate" for key in differing)
    return problems


def check_certificate(cert_path: str | os.PathLike,
                      public_key_pem: bytes | None = None) -> tuple[dict | None, list[str]]:
    """The certificate as read (None when unreadable) and every problem with the certificate itself:
    format and exact form, content hash, signature (required and pinned when `public_key_pem` is
    given) and the derived verdict. Its runs are not read; verify_certificate checks them too."""
    file = _certificate_file(Path(cert_path))
    try:
        raw, cert = _read(file)
    except AuditError as exc:
        return None, [str(exc)]
    name = file.name
    problems = []
    if raw != json_bytes(cert):
        problems.append(f"{name}: not in the exact form it is written in (bytes changed after writing?)")
    if cert["content_hash"] != content_hash(cert):
        problems.append(f"{name}: content hash does not match its contents (edited after sealing?)")
    problems.extend(signature_problems(cert, public_key_pem, name))
    problems.extend(_derived_problems(cert, name))
    return cert, problems


def verify_certificate(cert_path: str | os.PathLike, public_key_pem: bytes | None = None) -> list[str]:
    """Every problem with a certificate and its runs; [] when it is valid.

    check_certificate's checks; then, if the certificate itself is intact, per configuration that its
    run is a real folder inside the certificate's, the run's file digests, check_run, its roots and
    the comparison counts recomputed from the streams.
    """
    file = _certificate_file(Path(cert_path))
    cert, problems = check_certificate(file, public_key_pem)
    if problems:  # the runs are checked against the certificate's claims, which cannot be trusted now
        return problems
    name = file.name
    intact: dict[str, Run] = {}
    for c in cert["configurations"]:
        found = _configuration_problems(c, file.parent, name)
        problems.extend(found)
        if not found:
            intact[c["name"]] = read_run(_run_dir(file.parent, c["run"], name))
            problems.extend(_manifest_problems(cert, c, intact[c["name"]].manifest, name))
    reference = intact.get(cert["reference"])
    for c in cert["configurations"]:
        if reference is None or c["name"] not in intact:
            continue
        summary = summarize(compare_streams(reference.streams, intact[c["name"]].streams, cert["near_tie_threshold"]))
        recomputed = {key: summary[key] for key in COMPARISON_KEYS}
        if recomputed != c["comparison"]:
            problems.append(f"{name}: comparison of {c['name']!r} {c['comparison']} does not match its run "
                            f"(recomputed {recomputed})")
        errors = error_counts(intact[c["name"]].streams)
        if errors != c["errors"]:
            problems.append(f"{name}: errors of {c['name']!r} {c['errors']} do not match its run (recomputed {errors})")
        if "speculation" in c:  # certificates made before it was sealed lack it
            figures = speculation_figures(read_stats(intact[c["name"]].path))
            if figures != c.get("speculation"):
                problems.append(f"{name}: speculation figures of {c['name']!r} {c.get('speculation')} do not match "
                                f"its run's stats.json (recomputed {figures})")
    return problems


def _manifest_problems(cert: dict, configuration: dict, manifest: dict, name: str) -> list[str]:
    """A run must be of the certified suite and checkpoint, its prompts rendered with the protocol and
    tokenizer the certified checkpoint states, under the configuration it is listed as, and (where the
    certificate states it) on the CPU instruction sets it states."""
    claims = [
        ("suite", (manifest.get("suite") or {}).get("content_hash"), cert["suite"].get("content_hash")),
        ("checkpoint", (manifest.get("checkpoint") or {}).get("content_hash"), cert["checkpoint"].get("content_hash")),
        *_rendering_claims(cert["checkpoint"], manifest),
        ("configuration", manifest.get("variant"), configuration["config"]),
    ]
    if "cpu_isa" in configuration:
        claims.append(("CPU instruction-set statement", cpu_isa_statement(manifest), configuration["cpu_isa"]))
    return [f"{configuration['run']}/{MANIFEST}: its {what} differs from what {name} certifies"
            for what, found, certified in claims if found != certified]


def reference_run(path: str | os.PathLike) -> Run:
    """The run diffs are taken against: a certificate's (file or folder) reference run, or a run folder."""
    path = Path(path)
    if path.is_file() or (path / CERTIFICATE).is_file():
        file = _certificate_file(path)
        cert = load_certificate(file)
        c = _reference_of(cert["configurations"])
        run = read_run(_run_dir(file.parent, c["run"], str(file)))
        if any(run.root[key] != c[key] for key in ("count", "token_root", "logit_root")):
            raise AuditError(f"{run.path / ROOT}: the run's root differs from {file}'s reference configuration")
        return run
    if (path / MANIFEST).is_file():
        return read_run(path)
    raise AuditError(f"{path}: neither a certificate nor a run folder")
