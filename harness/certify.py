"""Certification: run a suite under every configuration of a sweep, compare each run with the
reference run, and write a sealed (optionally signed) certificate plus its report.

Layout of the output folder:
    OUT/sweep.json            the sweep that was run (a resumed certification must use the same one)
    OUT/runs/<name>/          one audit-store run per configuration
    OUT/certificate.json      configurations, roots, comparison counts, verdict, how to re-run
    OUT/report.md, report.html
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from audit.certificate import build_certificate, load_certificate, reference_run, seal, sign, write_certificate
from audit.files import atomic_write, json_bytes
from audit.store import read_run
from deepinfer.checkpoint import content_hash, default_checkpoint
from deepinfer.engine.llm import PRESET_PREFIX
from deepinfer.errors import DeepInferError
from harness.record import record_run
from harness.suites import load_suite
from harness.sweep import Sweep, Variant, check_variant
from reports import render_report

SWEEP_FILE = "sweep.json"


@dataclass
class Certification:
    certificate_path: Path
    certificate: dict
    report_paths: tuple[Path, Path]


def certify(
    model: str | Path | None, suite_spec: str, sweep: Sweep, out_dir: Path, *, run_seed: int = 0,
    resume: bool = False, sign_key: Path | None = None, progress: bool = True,
) -> Certification:
    out_dir = Path(out_dir)
    suite = load_suite(suite_spec)
    if not str(model).startswith(PRESET_PREFIX):  # a certificate's checkpoint hash comes from the bytes
        content_hash(model if model is not None else default_checkpoint(), trust_cache=False)
    signing_key = _read_key(sign_key) if sign_key else None
    _prepare(out_dir, sweep, resume)
    entries = []
    configurations = sweep.configurations()
    for number, (role, variant) in enumerate(configurations, start=1):
        if progress:
            print(f"configuration {number}/{len(configurations)}: {variant.name} ({role})", file=sys.stderr,
                  flush=True)
        record_run(model, suite, variant, out_dir / "runs" / variant.name, run_seed=run_seed, resume=resume,
                   progress=progress)
        entries.append({"name": variant.name, "role": role, "config": variant.to_dict(), "run": f"runs/{variant.name}"})
    reference = read_run(out_dir / "runs" / sweep.reference.name)
    certificate = build_certificate(
        out_dir=out_dir, reference=sweep.reference.name, configurations=entries, suite=suite.describe(),
        checkpoint=reference.manifest["checkpoint"],
        rerun={"model": str(model) if model is not None else None, "suite": suite.spec, "run_seed": run_seed,
               "reference": sweep.reference.to_dict()},
    )
    certificate = seal(certificate)
    if signing_key is not None:
        certificate = sign(certificate, signing_key)
    path = out_dir / "certificate.json"
    write_certificate(path, certificate)
    return Certification(path, certificate, render_report(out_dir))


def rerun_reference(certificate_path: Path, model: str | Path | None = None, progress: bool = True) -> list[str]:
    """Re-execute the certificate's reference configuration in a scratch folder and compare roots;
    returns the problems found ([] when the roots match). `model` overrides the recorded path."""
    certificate = load_certificate(certificate_path)
    rerun = certificate["rerun"]
    reference = _rerun_variant(rerun, certificate_path)
    suite = load_suite(rerun["suite"])
    expected_suite = certificate["suite"]["content_hash"]
    if suite.content_hash != expected_suite:
        return [f"suite {suite.path} has content hash {suite.content_hash[:12]}…, the certificate says "
                f"{expected_suite[:12]}…"]
    certified = next(c for c in certificate["configurations"] if c["name"] == certificate["reference"])
    # the max_model_len the reference ran with, not a default this machine might resolve differently
    recorded = reference_run(certificate_path).manifest["engine"]["max_model_len"]
    reference = replace(reference, max_model_len=recorded)
    with tempfile.TemporaryDirectory(prefix="deepinfer-rerun-") as scratch:
        run_dir = Path(scratch) / "run"
        root = record_run(model if model is not None else rerun["model"], suite, reference, run_dir,
                          run_seed=rerun["run_seed"], progress=progress)
        checkpoint = read_run(run_dir).manifest["checkpoint"]["content_hash"]
    problems = []
    if checkpoint != certificate["checkpoint"]["content_hash"]:
        problems.append(f"the checkpoint's content hash {checkpoint[:12]}… differs from the certified "
                        f"{certificate['checkpoint']['content_hash'][:12]}…")
    for key in ("token_root", "logit_root"):
        if root[key] != certified[key]:
            problems.append(f"re-run {key} {root[key][:12]}… differs from the certified {certified[key][:12]}…")
    return problems


def _rerun_variant(rerun: dict, certificate_path: Path) -> Variant:
    """The reference configuration of a certificate's `rerun` block, which must say how to re-run it:
    `model` (a path or null), `suite`, `run_seed` and `reference` (a configuration)."""
    where = f"{certificate_path}: rerun"
    types = {"model": (str, type(None)), "suite": str, "run_seed": int, "reference": dict}
    for key, expected in types.items():
        if key not in rerun or not isinstance(rerun[key], expected) or isinstance(rerun[key], bool):
            raise DeepInferError(f"{where}.{key}: missing or of the wrong type (cannot re-run)")
    try:
        return check_variant(Variant(**rerun["reference"]), f"{where}.reference")
    except TypeError:
        raise DeepInferError(f"{where}.reference: not a configuration (cannot re-run)") from None


def _prepare(out_dir: Path, sweep: Sweep, resume: bool) -> None:
    """Refuse to mix two certifications in one folder; record the sweep for a later --resume."""
    sweep_path = out_dir / SWEEP_FILE
    if out_dir.exists() and not out_dir.is_dir():
        raise DeepInferError(f"{out_dir}: exists and is not a folder")
    if resume and sweep_path.exists():
        if json.loads(sweep_path.read_text()) != sweep.to_dict():
            raise DeepInferError(f"{out_dir}: cannot resume with a different sweep than the one recorded in {SWEEP_FILE}")
        return
    if out_dir.exists() and any(out_dir.iterdir()):
        hint = "pass --resume to continue it, or" if sweep_path.exists() else "use"
        raise DeepInferError(f"{out_dir} is not empty: {hint} a new output folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(sweep_path, json_bytes(sweep.to_dict()))


def _read_key(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise DeepInferError(f"{path}: cannot read the signing key ({err.strerror or err})") from None

