"""`render_report`: a certify output folder in, report.md (+ report_files/*.png) and report.html out."""

from __future__ import annotations

from pathlib import Path

from audit.files import atomic_write
from reports.document import Figure, build_document
from reports.html import render_html
from reports.load import load_audit
from reports.markdown import FIGURE_DIR, render_markdown


def render_report(out_dir: Path) -> tuple[Path, Path]:
    """Write OUT/report.md and OUT/report.html for the certificate in `out_dir`; returns both paths.
    Figures this report does not draw (nothing to show) are removed from report_files/."""
    out_dir = Path(out_dir)
    doc = build_document(load_audit(out_dir))
    figure_dir = out_dir / FIGURE_DIR
    figure_dir.mkdir(exist_ok=True)
    drawn = {b.filename: b.png for s in doc.sections for b in s.blocks if isinstance(b, Figure)}
    for stale in figure_dir.glob("*.png"):
        if stale.name not in drawn:
            stale.unlink()
    for name, png in drawn.items():
        atomic_write(figure_dir / name, png)
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    atomic_write(md_path, render_markdown(doc).encode("utf-8"))
    atomic_write(html_path, render_html(doc).encode("utf-8"))
    return md_path, html_path
