"""Markdown layout of a report document; tables are padded so report.md reads well as plain text."""

from __future__ import annotations

import polars as pl

from deepinfer.reports.document import Block, Bullets, Document, Figure, Note, Paragraph, Table, Verdict

FIGURE_DIR = "report_files"


def _text(text: str) -> str:
    """Inline text with the characters Markdown would act on escaped; plain-text readers see little change."""
    for char in "\\`*<":
        text = text.replace(char, "\\" + char)
    return text


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pl.DataFrame) -> str:
    """A pipe table with every column padded to its widest cell."""
    header = [_cell(c) for c in frame.columns]
    rows = [[_cell(v) for v in row] for row in frame.iter_rows()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, rows)])


def _block(block: Block) -> str:
    match block:
        case Verdict(primary=True):
            return f"**{_text(block.label)}: {_text(block.verdict)}**"
        case Verdict():
            detail = f", {_text(block.detail)}" if block.detail else ""
            return f"- **{_text(block.label)}: {_text(block.verdict)}**{detail}"
        case Paragraph():
            return _text(block.text)
        case Bullets():
            return "\n".join(f"- {_text(item)}" for item in block.items)
        case Note():
            return f"*{_text(block.text)}*"
        case Table():
            return markdown_table(block.frame)
        case Figure():
            return f"![{_text(block.caption)}]({FIGURE_DIR}/{block.filename})"
    raise TypeError(f"not a report block: {block!r}")


def render_markdown(doc: Document) -> str:
    """The whole report as Markdown; figures are referenced as report_files/<name>.png."""
    parts = [f"# {_text(doc.title)}", *map(_block, doc.intro)]
    for section in doc.sections:
        parts.append(f"## {_text(section.title)}")
        parts.extend(map(_block, section.blocks))
    return "\n\n".join(parts) + "\n"
