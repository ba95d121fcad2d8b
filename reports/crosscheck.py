"""The report of a crosscheck folder: where each run ran, then per pair its verdict, the classes, a
histogram of the logprob drift in ulps, the divergence positions and what differed. A crosscheck that
does not verify gets no report (one AuditError), as a certificate does not."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
from matplotlib.figure import Figure as MplFigure

from deepinfer.audit.certificate import signer_fingerprint
from deepinfer.audit.compare import compare_streams
from deepinfer.audit.crosscheck import CLASSES, crosscheck_file, format_pair, load_crosscheck, verify_crosscheck
from deepinfer.audit.errors import AuditError
from deepinfer.audit.store import read_run
from deepinfer.reports.document import Block, Bullets, Document, Figure, Note, Paragraph, Section, Table, Verdict
from deepinfer.reports.figures import png_of

CLASS_WORDS = {"bitwise": "bitwise equal", "logprob_drift": "same tokens, logprob drift",
               "near_tie": "diverged at a near-tie", "diverged": "diverged", "missing": "missing", "error": "error"}


def build_crosscheck_document(folder: Path) -> Document:
    """The report of the verified crosscheck in `folder`."""
    file = crosscheck_file(Path(folder))
    problems = verify_crosscheck(file)
    if problems:
        raise AuditError(f"{file} does not verify, no report written: {'; '.join(problems)}")
    crosscheck = load_crosscheck(file)
    runs = {entry["name"]: read_run(file.parent / entry["run"]) for entry in crosscheck["runs"]}
    signer = signer_fingerprint(crosscheck) or "unsigned"
    intro: list[Block] = [
        Paragraph(f"{len(runs)} runs of one suite ({crosscheck['suite']['content_hash']}) from one checkpoint "
                  f"({crosscheck['checkpoint']['content_hash']}), each request classified against "
                  f"{crosscheck['reference']!r}; a divergence is a near-tie where either side's top-2 logprob gap is "
                  f"below {crosscheck['near_tie_threshold']:g}."),
        Paragraph(f"Sealed {crosscheck['content_hash']} ({signer}); created {crosscheck['created']}."),
        Table(_where_table(crosscheck["runs"])),
    ]
    sections = [_pair_section(pair, runs, crosscheck["near_tie_threshold"], number)
                for number, pair in enumerate(crosscheck["pairs"])]
    return Document("Crosscheck report", intro, sections)


def _where_table(entries: list[dict]) -> pl.DataFrame:
    """One row per fact of where a run ran, one column per run."""
    keys = list(dict.fromkeys(key for entry in entries for key in entry["where"]))
    return pl.DataFrame({"": keys, **{entry["name"]: [_text(entry["where"].get(key)) for key in keys]
                                     for entry in entries}})


def _text(value: object) -> str:
    return "–" if value is None else str(value)


def _pair_section(pair: dict, runs: dict, threshold: float, number: int) -> Section:
    classes = pair["classes"]
    if classes["bitwise"] == pair["requests"]:
        verdict, level = "BITWISE EQUAL", "good"
    elif classes["bitwise"] + classes["logprob_drift"] == pair["requests"]:
        verdict, level = "SAME TOKENS", "warn"
    else:
        verdict, level = "DIVERGED", "bad"
    comparison = compare_streams(runs[pair["reference"]].streams, runs[pair["other"]].streams, threshold)
    blocks: list[Block] = [
        Verdict(f"{pair['reference']} vs {pair['other']}", verdict, level, primary=True),
        Paragraph(format_pair(pair) + "."),
        Table(pl.DataFrame({"class": [CLASS_WORDS[c] for c in CLASSES], "requests": [str(classes[c]) for c in CLASSES]})),
    ]
    png = drift_histogram(comparison)
    caption = "Requests by their largest chosen-token logprob drift before any divergence, in ulps (log scale)"
    blocks.append(Note("No logprob drifted: no histogram.") if png is None else
                  Figure(f"crosscheck_drift_{number}.png", png, caption))
    if pair["divergences"]:
        blocks.append(Table(pl.DataFrame({
            "request": [d["request_id"] for d in pair["divergences"]],
            "first divergent position": [str(d["position"]) for d in pair["divergences"]],
            "top-2 gap (reference)": [_gap(d["gap_reference"]) for d in pair["divergences"]],
            "top-2 gap (other)": [_gap(d["gap_other"]) for d in pair["divergences"]],
            "near-tie": ["yes" if d["near_tie"] else "no" for d in pair["divergences"]],
        })))
    else:
        blocks.append(Note("No request diverged."))
    differs = [f"{key}: {_text(a)} → {_text(b)}" for key, (a, b) in pair["differs"].items()]
    blocks += [Paragraph("What differed between the two runs:"), Bullets(differs or ["nothing recorded"])]
    return Section(f"{pair['reference']} vs {pair['other']}", blocks)


def _gap(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def drift_histogram(comparison: pl.DataFrame) -> bytes | None:
    """Requests per power-of-two bin of their max drift in ulps; None when no logprob drifted."""
    ulps = comparison["max_logprob_ulps"].drop_nulls().to_numpy()
    ulps = ulps[ulps > 0]
    if not len(ulps):
        return None
    top = max(1, math.ceil(math.log2(int(ulps.max()) + 1)))
    edges = 2.0 ** np.arange(top + 1)
    counts, _ = np.histogram(ulps, bins=np.append(edges, edges[-1] * 2))
    fig = MplFigure(figsize=(7, 3))
    ax = fig.add_subplot()
    ax.bar(range(len(counts)), counts, color="#ffd54f", edgecolor="#795548")
    ax.set_xticks(range(len(counts)), [f"≥{int(e)}" for e in edges[:len(counts)]], fontsize=7, rotation=45)
    ax.set_xlabel("max logprob drift (ulps)")
    ax.set_ylabel("requests")
    return png_of(fig)
