"""Everything a report shows, read from a certify output folder: the certificate, each
configuration's run, and every configuration compared against the reference run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from audit.certificate import load_certificate
from audit.compare import compare_streams, summarize
from audit.errors import AuditError
from audit.store import Run, read_run

@dataclass(frozen=True)
class Configuration:
    """One certified configuration and its run."""

    name: str
    role: str
    config: dict
    token_root: str
    logit_root: str
    run: Run


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
        """audit.compare.summarize of one configuration against the reference (the certificate's counts)."""
        return summarize(self.comparisons.filter(pl.col("configuration") == name))


def _read_configuration(out_dir: Path, entry: dict) -> Configuration:
    name = entry["name"]
    run_dir = out_dir / entry["run"]
    try:
        run = read_run(run_dir)
    except AuditError as err:
        raise AuditError(f"configuration {name!r} ({entry['run']}): {err}") from err
    for key in ("token_root", "logit_root"):
        if run.root[key] != entry[key]:
            raise AuditError(
                f"configuration {name!r} ({entry['run']}): root.json {key} does not match the certificate"
            )
    return Configuration(
        name=name,
        role=entry["role"],
        config=entry["config"],
        token_root=entry["token_root"],
        logit_root=entry["logit_root"],
        run=run,
    )


def _compare(reference: Configuration, other: Configuration, near_tie_threshold: float) -> pl.DataFrame:
    try:
        comparison = compare_streams(reference.run.streams, other.run.streams, near_tie_threshold)
    except AuditError as err:
        raise AuditError(f"configuration {other.name!r} against reference {reference.name!r}: {err}") from err
    return comparison.with_columns(configuration=pl.lit(other.name))


def load_audit(out_dir: Path) -> AuditData:
    """Read `out_dir/certificate.json` and its runs, and compare every run with the reference's under
    the certificate's near-tie threshold; AuditError names the file or run at fault."""
    cert = load_certificate(out_dir / "certificate.json")
    configurations = [_read_configuration(out_dir, entry) for entry in cert["configurations"]]
    reference = next(c for c in configurations if c.role == "reference")
    threshold = cert["near_tie_threshold"]
    comparisons = pl.concat([_compare(reference, c, threshold) for c in configurations], how="vertical")
    return AuditData(certificate=cert, configurations=configurations, comparisons=comparisons)
