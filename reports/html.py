"""Self-contained HTML layout of a report document: inline CSS, figures as base64 data: URIs,
no scripts, no external fetches; every piece of text is escaped."""

from __future__ import annotations

import base64
from html import escape

import polars as pl

from deepinfer.reports.document import Block, Bullets, Document, Figure, Note, Paragraph, Table, Verdict

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0;
       color: #212121; background: #fafafa; }
main { max-width: 1400px; margin: 0 auto; padding: 1.5rem 1.2rem 3rem; }
h1 { margin-bottom: 0.2rem; }
h2 { margin-top: 2rem; border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; }
.verdict { border-radius: 6px; margin: 0.6rem 0; }
.verdict .value { font-weight: 700; }
.verdict.primary { font-size: 2rem; font-weight: 700; padding: 1rem 1.5rem; color: #fff; }
.verdict.primary.good { background: #2e7d32; }
.verdict.primary.warn { background: #f9a825; color: #212121; }
.verdict.primary.bad { background: #c62828; }
.verdict.primary.unknown { background: #616161; }
.verdict.control { font-size: 1.05rem; padding: 0.4rem 1rem; background: #fff; border: 1px solid #ddd;
                   border-left: 8px solid #616161; }
.verdict.control.good { border-left-color: #2e7d32; }
.verdict.control.warn { border-left-color: #f9a825; }
.verdict.control.bad { border-left-color: #c62828; }
.note { font-style: italic; color: #555; background: #f0f0f0; padding: 0.5rem 1rem; border-radius: 4px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.8rem; margin: 0.5rem 0; background: #fff; }
th, td { border: 1px solid #ddd; padding: 0.2rem 0.4rem; text-align: left; white-space: nowrap; }
th { background: #eeeeee; white-space: normal; vertical-align: bottom; }
td.wrap { white-space: normal; min-width: 14rem; max-width: 28rem; overflow-wrap: anywhere; }
td { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
tbody tr:nth-child(even) { background: #f7f7f7; }
figure { margin: 0.5rem 0; }
figure img { max-width: 100%; height: auto; background: #fff; }
figcaption { font-size: 0.85rem; color: #555; }
"""


WRAP_CHARS = 48  # a cell longer than this may wrap: the others keep to one line


def html_table(frame: pl.DataFrame) -> str:
    """A plain HTML table of the frame's string cells, all escaped; a long cell wraps (`td.wrap`)."""
    head = "".join(f"<th>{escape(c)}</th>" for c in frame.columns)
    body = "".join(
        "<tr>" + "".join(f'<td class="wrap">{escape(v)}</td>' if len(v) > WRAP_CHARS else f"<td>{escape(v)}</td>"
                         for v in row) + "</tr>" for row in frame.iter_rows()
    )
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _block(block: Block) -> str:
    match block:
        case Verdict():
            kind = "primary" if block.primary else "control"
            detail = f", {escape(block.detail)}" if block.detail else ""
            return (
                f'<div class="verdict {kind} {escape(block.level)}">{escape(block.label)}: '
                f'<span class="value">{escape(block.verdict)}</span>{detail}</div>'
            )
        case Paragraph():
            return f"<p>{escape(block.text)}</p>"
        case Bullets():
            return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in block.items) + "</ul>"
        case Note():
            return f'<p class="note">{escape(block.text)}</p>'
        case Table():
            return html_table(block.frame)
        case Figure():
            data = base64.b64encode(block.png).decode("ascii")
            caption = escape(block.caption)
            return (
                f'<figure><img src="data:image/png;base64,{data}" alt="{caption}">'
                f"<figcaption>{caption}</figcaption></figure>"
            )
    raise TypeError(f"not a report block: {block!r}")


def render_html(doc: Document) -> str:
    """The whole report as one HTML page that needs no other file."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(doc.title)}</title>",
        f"<style>{STYLE}</style></head>",
        "<body><main>",
        f"<h1>{escape(doc.title)}</h1>",
        *map(_block, doc.intro),
    ]
    for section in doc.sections:
        parts.append(f"<section><h2>{escape(section.title)}</h2>")
        parts.extend(map(_block, section.blocks))
        parts.append("</section>")
    parts.append("</main></body></html>")
    return "\n".join(parts) + "\n"
