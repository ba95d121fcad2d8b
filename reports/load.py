"""Everything a report shows, read from a certify output folder: the certificate, each
configuration's run, and every configuration compared against the reference run.

A report is only made of a certificate that verifies (audit.certificate.check_certificate: exact form,
content hash, signature when present, derived verdict) and of runs that are real folders inside the
certification folder with the file digests it certifies; anything else is refused with one AuditError,
so no report can show a verdict that `deepinfer audit verify` rejects."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from deepinfer.audit.certificate import CERTIFICATE, check_certificate, cpu_isa_statement, digest_problems, run_path_problems
from deepinfer.audit.compare import compare_streams, summarize
from deepinfer.audit.errors import AuditError
from deepinfer.audit.store import Run, read_run, read_stats

@dataclass(frozen=True)
class Configuration:
    """One certified configuration and its run."""

    name: str
    role: str
    config: dict
    token_root: str
    logit_root: str
    run: Run
    cpu_isa: str  # audit.certificate.cpu_isa_statement of the run's manifest
    stats: dict | None = None  # the engine's counters (stats.json); None when absent or unreadable


@dataclass(frozen=True)
class AuditData:
    """`comparisons` has one row per (configuration, reference request): compare_streams' columns
    plus `configuration`; the reference is compared with itself, so every configuration has rows."""

    certificate: dict
    configurations: list[Configuration]
    comparisons: pl.DataFrame

    @property
    def reference(self) -> Configuration:
        return next(c for c in self.configurations if c.role == "reference")

    def summary(self, name: str) -> dict:
        """deepinfer.audit.compare.summarize of one configuration against the reference (the certificate's counts)."""
        return summarize(self.comparisons.filter(pl.col("configuration") == name))


def _verified_certificate(file: Path) -> dict:
    """The certificate, refused unless it verifies on its own (its runs are checked as they are read)."""
    cert, problems = check_certificate(file)
    if cert is None:
        raise AuditError(problems[0])
    if problems:
        raise AuditError(f"{file} does not verify, no report written: {'; '.join(problems)}")
    return cert


def _read_configuration(out_dir: Path, entry: dict) -> Configuration:
    name = entry["name"]
    where = f"configuration {name!r} ({entry['run']})"
    run_dir = out_dir / entry["run"]
    problems = run_path_problems(out_dir, entry["run"]) or digest_problems(entry, run_dir)
    if problems:
        raise AuditError(f"{where}: {'; '.join(problems)}")
    try:
        run = read_run(run_dir)
    except AuditError as err:
        raise AuditError(f"{where}: {err}") from err
    for key in ("token_root", "logit_root"):
        if run.root[key] != entry[key]:
            raise AuditError(f"{where}: root.json {key} does not match the certificate")
    cpu_isa = cpu_isa_statement(run.manifest)
    if entry.get("cpu_isa", cpu_isa) != cpu_isa:
        raise AuditError(f"{where}: the certificate's CPU instruction-set statement does not match its manifest")
    return Configuration(
        name=name,
        role=entry["role"],
        config=entry["config"],
        token_root=entry["token_root"],
        logit_root=entry["logit_root"],
        run=run,
        cpu_isa=cpu_isa,
        stats=read_stats(run_dir),
    )


def _compare(reference: Configuration, other: Configuration, near_tie_threshold: float) -> pl.DataFrame:
    try:
        comparison = compare_streams(reference.run.streams, other.run.streams, near_tie_threshold)
    except AuditError as err:
        raise AuditError(f"configuration {other.name!r} against reference {reference.name!r}: {err}") from err
    return comparison.with_columns(configuration=pl.lit(other.name))


def load_audit(out_dir: Path) -> AuditData:
    """Read `out_dir/certificate.json` (refused unless it verifies) and its runs, and compare every run
    with the reference's under the certificate's near-tie threshold; AuditError names the file or run at
    fault."""
    cert = _verified_certificate(out_dir / CERTIFICATE)
    configurations = [_read_configuration(out_dir, entry) for entry in cert["configurations"]]
    reference = next(c for c in configurations if c.role == "reference")
    threshold = cert["near_tie_threshold"]
    comparisons = pl.concat([_compare(reference, c, threshold) for c in configurations], how="vertical")
    return AuditData(certificate=cert, configurations=configurations, comparisons=comparisons)
