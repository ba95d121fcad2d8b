"""`render_report`: a certify or crosscheck output folder in, report.md (+ report_files/*.png) and
report.html out.

A certificate (or crosscheck) that does not verify gets no report at all (load_audit refuses it with one AuditError):
a refusal cannot be mistaken for a verdict, where a report marked "unverified" could still be skimmed
for its colour. Every file written, and every stale figure removed, is a real path inside the folder."""

from __future__ import annotations

from pathlib import Path

from deepinfer.audit.crosscheck import is_crosscheck
from deepinfer.audit.errors import AuditError
from deepinfer.audit.files import atomic_write
from deepinfer.reports.crosscheck import build_crosscheck_document
from deepinfer.reports.document import Figure, build_document
from deepinfer.reports.html import render_html
from deepinfer.reports.load import load_audit
from deepinfer.reports.markdown import FIGURE_DIR, render_markdown

REPORTS = ("report.md", "report.html")


def _check_targets(out_dir: Path) -> None:
    """AuditError unless report.md, report.html, report_files/ and its PNGs are real files and a real
    folder (or absent): through a symbolic link the report would overwrite or delete files elsewhere."""
    figure_dir = out_dir / FIGURE_DIR
    pngs = sorted(figure_dir.glob("*.png")) if figure_dir.is_dir() and not figure_dir.is_symlink() else []
    for path in [*(out_dir / name for name in REPORTS), figure_dir, *pngs]:
        if path.is_symlink():
            raise AuditError(f"{path}: is a symbolic link; a report writes only real files inside {out_dir}")
    if figure_dir.exists() and not figure_dir.is_dir():
        raise AuditError(f"{figure_dir}: is not a folder; a report writes its figures into a real folder there")


def render_report(out_dir: Path) -> tuple[Path, Path]:
    """Write OUT/report.md and OUT/report.html for the certificate or crosscheck in `out_dir`; returns
    both paths. Figures this report does not draw (nothing to show) are removed from report_files/."""
    out_dir = Path(out_dir)
    _check_targets(out_dir)
    doc = build_crosscheck_document(out_dir) if is_crosscheck(out_dir) else build_document(load_audit(out_dir))
    figure_dir = out_dir / FIGURE_DIR
    figure_dir.mkdir(exist_ok=True)
    drawn = {b.filename: b.png for s in doc.sections for b in s.blocks if isinstance(b, Figure)}
    for stale in figure_dir.glob("*.png"):
        if stale.name not in drawn:
            stale.unlink()
    for name, png in drawn.items():
        atomic_write(figure_dir / name, png)
    md_path, html_path = (out_dir / name for name in REPORTS)
    atomic_write(md_path, render_markdown(doc).encode("utf-8"))
    atomic_write(html_path, render_html(doc).encode("utf-8"))
    return md_path, html_path
