"""Certification: run a suite under every configuration of a sweep, compare each run with the
reference run, and write a sealed (optionally signed) certificate. The report is the command line's
to render (reports/ depends on the harness's output, never the other way round).

Layout of the output folder:
    OUT/sweep.json            the sweep that was run (a resumed certification must use the same one)
    OUT/runs/<name>/          one audit-store run per configuration
    OUT/certificate.json      configurations, roots, comparison counts, verdict, how to re-run
    OUT/report.md, report.html   written by `deepinfer audit certify` (reports.render_report)

How to re-run (the certificate's `rerun` block): `model` (an absolute checkpoint path, a preset name or
null for the embedded checkpoint), `suite` (the suite's spec, file kinds with an absolute path),
`run_seed`, `reference` (the reference configuration), and `from_certificate`: the model and suite
paths relative to the certificate's folder (null where there is no file path), so a certification
moved together with its inputs still re-runs. `verify --rerun` tries the certificate-relative path
first, then the recorded one (absolute; older certificates lack `from_certificate` and record the model
as typed, which is then relative to the working directory); `--suite` and `--model` override both.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from deepinfer.audit.certificate import (CERTIFICATE, RUNS, build_certificate, gather_runs, load_certificate,
                                         reference_run, seal, sign, write_certificate)
from deepinfer.audit.files import atomic_write, folder_lock, json_bytes
from deepinfer.audit.store import read_run
from deepinfer.checkpoint import DEFAULT_PRESET, content_hash, default_checkpoint
from deepinfer.engine.host import PRESET_PREFIX, model_reference
from deepinfer.errors import DeepInferError
from deepinfer.parallel import process_rank
from deepinfer.harness.record import record_run
from deepinfer.harness.run_writer import read_stats
from deepinfer.harness.suite_registry import Suite, load_suite
from deepinfer.harness.sweep import Sweep, Variant, check_variant, variant_from_dict

SWEEP_FILE = "sweep.json"
NOTHING_TO_RERUN = {"recorded_elsewhere": True}  # the rerun block of a certificate over runs it did not record


def certify(
    model: str | Path | None, suite_spec: str, sweep: Sweep, out_dir: Path, *, run_seed: int = 0,
    resume: bool = False, sign_key: Path | None = None, progress: bool = True,
) -> dict | None:
    """Run `suite_spec` under every configuration of `sweep` into `out_dir` and write
    OUT/certificate.json; returns the certificate (sealed, and signed with `sign_key` when given).
    In a torchrun launch every rank calls it: rank 0 checks, writes and returns the certificate, the
    others serve their share of each configuration and return None.

    Everything that can be checked is checked before anything is written; a start that fails before
    any configuration stored a file leaves `out_dir` as it found it, so a retry (or `resume`) works."""
    out_dir = Path(out_dir)
    if process_rank() != 0:  # another rank of a torchrun launch: it serves its share, rank 0 writes
        suite = load_suite(suite_spec)
        for _, variant in sweep.configurations():
            record_run(model, suite, variant, out_dir / RUNS / variant.name, run_seed=run_seed, resume=resume,
                       progress=False)
        return None
    with folder_lock(out_dir, resumable=True):  # a second certify (or --resume) of the same folder is refused meanwhile
        return _certify(model, suite_spec, sweep, out_dir, run_seed, resume, sign_key, progress)


def _certify(model: str | Path | None, suite_spec: str, sweep: Sweep, out_dir: Path, run_seed: int, resume: bool,
             sign_key: Path | None, progress: bool) -> dict:
    resuming = _check_out(out_dir, sweep, resume)  # before hashing what may be a large checkpoint
    suite = load_suite(suite_spec)
    for _, variant in sweep.configurations():
        check_variant(variant, f"configuration {variant.name!r}")
    if not str(model).startswith(PRESET_PREFIX):  # a certificate's checkpoint hash comes from the bytes
        content_hash(model if model is not None else default_checkpoint(), trust_cache=False)
    signing_key = _read_key(sign_key) if sign_key else None
    undo = (lambda: None) if resuming else _start(out_dir, sweep)
    try:
        entries = _run_configurations(model, suite, sweep, out_dir, run_seed, resume, progress)
    except BaseException:
        if not _started(out_dir):
            undo()
        raise
    reference = read_run(out_dir / RUNS / sweep.reference.name)
    certificate = build_certificate(
        out_dir=out_dir, reference=sweep.reference.name, configurations=entries, suite=suite.describe(),
        checkpoint=reference.manifest["checkpoint"], rerun=_rerun_block(model, suite, out_dir, run_seed, sweep),
    )
    certificate = seal(certificate)
    if signing_key is not None:
        certificate = sign(certificate, signing_key)
    write_certificate(out_dir / CERTIFICATE, certificate)
    return certificate


def _run_configurations(model: str | Path | None, suite: Suite, sweep: Sweep, out_dir: Path, run_seed: int,
                        resume: bool, progress: bool) -> list[dict]:
    entries = []
    configurations = sweep.configurations()
    for number, (role, variant) in enumerate(configurations, start=1):
        if progress:
            print(f"configuration {number}/{len(configurations)}: {variant.name} ({role})", file=sys.stderr,
                  flush=True)
        record_run(model, suite, variant, out_dir / RUNS / variant.name, run_seed=run_seed, resume=resume,
                   progress=progress)
        if progress and variant.engine.speculation != "off":
            print(f"  {speculation_summary(read_stats(out_dir / RUNS / variant.name))}", file=sys.stderr, flush=True)
        if progress and variant.engine.prefix_caching:
            print(f"  {prefix_summary(read_stats(out_dir / RUNS / variant.name))}", file=sys.stderr, flush=True)
        entries.append({"name": variant.name, "role": role, "config": variant.to_dict(),
                        "run": f"{RUNS}/{variant.name}"})
    return entries


def speculation_summary(stats: dict) -> str:
    """What a speculating run's drafts did (from its `stats.json`): a variant whose drafter proposed
    nothing checked plain decoding only, and says so."""
    drafted, kept, chunks = stats["drafted"], stats["drafts_kept"], stats["verify_chunks"]
    if not drafted:
        return "speculation: no drafts were proposed, so this configuration ran as plain decoding"
    return (f"speculation: {kept} of {drafted} drafts kept ({kept / drafted:.0%}), "
            f"{1 + kept / chunks:.2f} tokens per step with drafts")


def prefix_summary(stats: dict) -> str:
    """How much of a run's prompt computing the prefix cache saved (from its `stats.json`)."""
    hit, query = stats["prefix_hit_tokens"], stats["prefix_query_tokens"]
    share = f" ({hit / query:.0%})" if query else ""
    return f"prefix cache: {hit} of {query} tokens of admitted requests taken from cached prefixes{share}"


def _rerun_block(model: str | Path | None, suite: Suite, out_dir: Path, run_seed: int, sweep: Sweep) -> dict:
    """How `verify --rerun` re-runs the reference: absolute paths, and the same paths relative to the
    certificate's folder."""
    recorded_model = None if model is None else model_reference(str(model))
    relative_model = None
    if model is not None and not str(model).startswith(PRESET_PREFIX):
        relative_model = _relative(Path(recorded_model), out_dir)
    relative_suite = None
    if suite.target is None:  # a file kind: KIND:PATH
        relative = _relative(suite.path, out_dir)
        relative_suite = None if relative is None else f"{suite.kind}:{relative}"
    return {"model": recorded_model, "suite": suite.spec, "run_seed": run_seed,
            "reference": sweep.reference.to_dict(),
            "from_certificate": {"model": relative_model, "suite": relative_suite}}


def _relative(path: Path, out_dir: Path) -> str | None:
    try:
        return Path(os.path.relpath(Path(path).resolve(), out_dir.resolve())).as_posix()
    except ValueError:  # another drive (Windows): no relative path
        return None


def certify_runs(given: list[tuple[str, Path]], out_dir: Path, *, sign_key: Path | None = None,
                 near_tie_threshold: float = 1e-2) -> dict:
    """A certificate over runs recorded already (another engine's, imported with `audit import`; or
    `audit run`s made apart), the first the reference and the others variants, gathered into
    OUT/runs/NAME. Its rerun block says there is nothing to re-run: this engine did not make them."""
    signing_key = _read_key(sign_key) if sign_key else None
    runs = gather_runs(out_dir, given)
    manifests = {name: read_run(out_dir / relative).manifest for name, relative in runs}
    reference = manifests[runs[0][0]]
    for section in ("suite", "checkpoint"):  # every run's, as verification will check them
        stated = (reference.get(section) or {}).get("content_hash")
        for name, manifest in manifests.items():
            found = (manifest.get(section) or {}).get("content_hash")
            if found != stated:
                raise DeepInferError(f"run {name!r} is of {section} {found}, the reference {runs[0][0]!r} of {section} "
                                     f"{stated}: a certificate covers one {section}")
    configurations = [{"name": name, "role": "variant" if k else "reference", "config": manifests[name].get("variant", {}),
                       "run": relative} for k, (name, relative) in enumerate(runs)]
    certificate = seal(build_certificate(
        out_dir=out_dir, reference=runs[0][0], configurations=configurations, suite=reference["suite"],
        checkpoint=reference.get("checkpoint") or {}, rerun=NOTHING_TO_RERUN, near_tie_threshold=near_tie_threshold))
    if signing_key is not None:
        certificate = sign(certificate, signing_key)
    write_certificate(out_dir / CERTIFICATE, certificate)
    return certificate


def rerun_reference(certificate_path: Path, model: str | Path | None = None, suite: str | None = None,
                    progress: bool = True) -> list[str]:
    """Re-execute the certificate's reference configuration in a scratch folder and compare roots;
    returns the problems found ([] when the roots match). `model` (a checkpoint folder) and `suite`
    (a suite spec) override the recorded ones, e.g. for inputs moved since certification."""
    certificate_path = Path(certificate_path)
    file = certificate_path / CERTIFICATE if certificate_path.is_dir() else certificate_path
    certificate = load_certificate(file)
    rerun = certificate["rerun"]
    if rerun == NOTHING_TO_RERUN:
        raise DeepInferError(f"{file}: certifies runs recorded elsewhere (audit certify-runs): there is nothing to "
                             "re-run")
    reference = _rerun_variant(rerun, file)
    loaded = load_suite(suite) if suite is not None else _recorded_suite(rerun, file)
    checkpoint_path = model if model is not None else _recorded_model(rerun, file)
    expected_suite = certificate["suite"]["content_hash"]
    if loaded.content_hash != expected_suite:
        return [f"suite {loaded.path} has content hash {loaded.content_hash[:12]}…, the certificate says "
                f"{expected_suite[:12]}…"]
    certified = next(c for c in certificate["configurations"] if c["name"] == certificate["reference"])
    # the max_model_len the reference ran with, not a default this machine might resolve differently
    recorded = reference_run(file).manifest["engine"]["max_model_len"]
    reference = reference.derive(reference.name, max_model_len=recorded)
    mismatch = _checkpoint_mismatch(checkpoint_path, certificate["checkpoint"]["content_hash"])
    if mismatch is not None:
        return [mismatch]
    with tempfile.TemporaryDirectory(prefix="deepinfer-rerun-") as scratch:
        run_dir = Path(scratch) / "run"
        root = record_run(checkpoint_path, loaded, reference, run_dir, run_seed=rerun["run_seed"], progress=progress)
        checkpoint = read_run(run_dir).manifest["checkpoint"]["content_hash"]
    problems = []
    if checkpoint != certificate["checkpoint"]["content_hash"]:
        problems.append(f"the checkpoint's content hash {checkpoint[:12]}… differs from the certified "
                        f"{certificate['checkpoint']['content_hash'][:12]}…")
    for key in ("token_root", "logit_root"):
        if root[key] != certified[key]:
            problems.append(f"re-run {key} {root[key][:12]}… differs from the certified {certified[key][:12]}…")
    return problems


def _checkpoint_mismatch(model: str | Path | None, certified: str) -> str | None:
    """Why the checkpoint a re-run would load is not the certified one (None when it is, or when only
    running can tell: a preset's weights are generated). Checked before running, so a wrong checkpoint
    costs a hash, not a run; a certificate made with an earlier version's embedded default needs --model."""
    if model is not None and str(model).startswith(PRESET_PREFIX):
        return None
    found = content_hash(default_checkpoint() if model is None else model)
    if found == certified:
        return None
    problem = f"the checkpoint's content hash {found[:12]}… differs from the certified {certified[:12]}…"
    if model is None:
        problem += (f": the certificate was made with the embedded default checkpoint, which is now "
                    f"{DEFAULT_PRESET}; pass --model DIR with the checkpoint it was made with")
    return problem


def _candidates(recorded: str, relative: str | None, base: Path) -> list[Path]:
    """Where a recorded path may be now: at its recorded path relative to the certificate's folder
    `base`, then as recorded (an absolute path; in older certificates, as typed)."""
    found = [Path(os.path.normpath(base.resolve() / relative))] if relative is not None else []
    return found + [Path(recorded)] if Path(recorded) not in found else found


def _recorded_model(rerun: dict, file: Path) -> str | None:
    """The checkpoint folder the certificate records, found from here; one-line error naming the
    paths tried and --model when it is not found."""
    recorded = rerun["model"]
    if recorded is None or recorded.startswith(PRESET_PREFIX):
        return recorded
    tried = _candidates(recorded, rerun.get("from_certificate", {}).get("model"), file.parent)
    for path in tried:
        if path.is_dir():
            return str(path)
    raise DeepInferError(f"{file}: rerun.model: checkpoint folder not found (tried {', '.join(map(str, tried))}); "
                         "pass --model DIR to point at it")


def _recorded_suite(rerun: dict, file: Path) -> Suite:
    """The suite the certificate records, found from here; one-line error naming the paths tried and
    --suite when its file is not found. A file kind's spec is `KIND:` and an absolute path (with a
    certificate-relative one next to it); other kinds (lm-eval:TASKS) load from the spec as recorded."""
    recorded = rerun["suite"]
    relative = rerun.get("from_certificate", {}).get("suite")
    kind, _, path = recorded.partition(":")
    if relative is None and not Path(path).is_absolute():
        return load_suite(recorded)
    relative_kind, _, relative_path = (relative or "").partition(":")
    tried = _candidates(path, relative_path if relative_kind == kind else None, file.parent)
    for candidate in tried:
        if candidate.is_file():
            return load_suite(f"{kind}:{candidate}")
    raise DeepInferError(f"{file}: rerun.suite: suite file not found (tried {', '.join(map(str, tried))}); "
                         "pass --suite KIND:PATH to point at it")


def _rerun_variant(rerun: dict, certificate_path: Path) -> Variant:
    """The reference configuration of a certificate's `rerun` block, which must say how to re-run it:
    `model` (a path or null), `suite`, `run_seed` and `reference` (a configuration); `from_certificate`
    (certificate-relative paths) is optional, since older certificates lack it."""
    where = f"{certificate_path}: rerun"
    types = {"model": (str, type(None)), "suite": str, "run_seed": int, "reference": dict}
    for key, expected in types.items():
        if key not in rerun or not isinstance(rerun[key], expected) or isinstance(rerun[key], bool):
            raise DeepInferError(f"{where}.{key}: missing or of the wrong type (cannot re-run)")
    relative = rerun.get("from_certificate", {})
    if not isinstance(relative, dict) or not all(
            isinstance(relative.get(key), (str, type(None))) for key in ("model", "suite")):
        raise DeepInferError(f"{where}.from_certificate: not an object of model and suite paths or nulls "
                             "(cannot re-run)")
    try:
        return variant_from_dict(rerun["reference"], f"{where}.reference")
    except DeepInferError as err:
        raise DeepInferError(f"{err} (cannot re-run)") from None


def _check_out(out_dir: Path, sweep: Sweep, resume: bool) -> bool:
    """Refuse to mix two certifications in one folder; True when `resume` continues the one in it."""
    sweep_path = out_dir / SWEEP_FILE
    if out_dir.exists() and not out_dir.is_dir():
        raise DeepInferError(f"{out_dir}: exists and is not a folder")
    if resume and sweep_path.exists():
        if json.loads(sweep_path.read_text()) != sweep.to_dict():
            raise DeepInferError(f"{out_dir}: cannot resume with a different sweep than the one recorded in {SWEEP_FILE}")
        return True
    if out_dir.exists() and any(out_dir.iterdir()):
        hint = "pass --resume to continue it, or" if sweep_path.exists() else "use"
        raise DeepInferError(f"{out_dir} is not empty: {hint} a new output folder")
    return False


def _start(out_dir: Path, sweep: Sweep):
    """Record the sweep for a later --resume in the new or empty `out_dir`. Returns a function that
    undoes this (for a start that fails before any run stored a file)."""
    sweep_path = out_dir / SWEEP_FILE
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(sweep_path, json_bytes(sweep.to_dict()))

    def undo() -> None:
        _remove_empty_folders(out_dir / RUNS)
        sweep_path.unlink(missing_ok=True)
        if created:
            _remove_empty_folders(out_dir)

    return undo


def _started(out_dir: Path) -> bool:
    """Whether any configuration has stored a file (the certification can then only be resumed)."""
    runs = out_dir / RUNS
    return runs.is_dir() and any(path.is_file() or path.is_symlink() for path in runs.rglob("*"))


def _remove_empty_folders(folder: Path) -> None:
    """Remove `folder` and the folders in it, when they hold no files."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        try:
            sub.rmdir()
        except OSError:
            return
    try:
        folder.rmdir()
    except OSError:
        pass


def _read_key(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise DeepInferError(f"{path}: cannot read the signing key ({err.strerror or err})") from None
