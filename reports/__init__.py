"""Reports: render a certify output folder (certificate.json + runs/) into report.md and a
self-contained report.html with tables and figures. Modules, one job each: load (certificate, runs,
comparisons), groups (requests rolled up into episodes or tasks), tables and figures (content),
document (sections), markdown and html (layout), render."""

from deepinfer.reports.render import render_report

__all__ = ["render_report"]
