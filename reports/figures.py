"""The report's figures as PNG bytes, drawn with matplotlib's Agg canvas (no pyplot, no display).
A figure with nothing to show is None, so the report can say so instead of drawing empty axes."""

from __future__ import annotations

import io

import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from deepinfer.reports.load import AuditData

CATEGORIES = [
    ("equal", "#4caf50"),
    ("logprob drift", "#ffd54f"),
    ("near-tie divergence", "#ff9800"),
    ("hard divergence", "#d32f2f"),
    ("missing / error", "#424242"),
]
MAX_LABELLED_REQUESTS = 40


def png_of(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _legend_outside(ax, entries: int) -> None:
    """The legend right of the plot, in columns of at most 12 entries, so it never covers a point."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              ncol=max(1, -(-entries // 12)), frameon=False)


def _others(data: AuditData) -> list[str]:
    """Non-reference configuration names; a configuration's colour is C<its position here> in every plot."""
    return [c.name for c in data.configurations if c.role != "reference"]


def _category() -> pl.Expr:
    status = pl.col("status")
    return (
        pl.when(status == "equal").then(0)
        .when(status == "logprob_drift").then(1)
        .when((status == "diverged") & pl.col("near_tie").fill_null(False)).then(2)
        .when(status == "diverged").then(3)
        .otherwise(4)
    )


def invariance_heatmap(data: AuditData) -> bytes:
    """Configurations (rows) x reference requests (columns), coloured by comparison outcome."""
    names = [c.name for c in data.configurations]
    frame = data.comparisons.with_columns(category=_category()).sort("index")
    matrix = [frame.filter(pl.col("configuration") == name)["category"].to_list() for name in names]
    request_ids = frame.filter(pl.col("configuration") == names[0])["request_id"].to_list()
    labelled = len(request_ids) <= MAX_LABELLED_REQUESTS

    fig = Figure(figsize=(10, 1.6 + 0.45 * len(names) + (1.0 if labelled else 0.0)), layout="constrained")
    ax = fig.add_subplot()
    cmap = ListedColormap([colour for _, colour in CATEGORIES])
    ax.imshow(matrix, cmap=cmap, vmin=-0.5, vmax=len(CATEGORIES) - 0.5, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(names)), labels=names)
    if labelled:
        ax.set_xticks(range(len(request_ids)), labels=request_ids, rotation=90, fontsize=8)
    else:
        ax.set_xlabel("request index")
    ax.set_title("Invariance: each configuration against the reference")
    fig.legend(  # below the tick labels, however tall they are: no gap, no overlap
        handles=[Patch(facecolor=colour, label=label) for label, colour in CATEGORIES],
        loc="outside lower center", ncol=len(CATEGORIES), frameon=False, fontsize=8,
    )
    return png_of(fig)


def divergence_histogram(data: AuditData) -> bytes | None:
    """First divergence positions of every non-reference configuration, stacked; None if none diverged."""
    diverged = data.comparisons.filter(
        (pl.col("configuration") != data.reference.name) & (pl.col("status") == "diverged")
    )
    if diverged.is_empty():
        return None
    present = set(diverged["configuration"])
    shown = [(i, name) for i, name in enumerate(_others(data)) if name in present]
    positions = [diverged.filter(pl.col("configuration") == n)["first_divergence"].to_list() for _, n in shown]
    top = int(diverged["first_divergence"].max())
    step = max(1, -(-(top + 1) // 50))
    bins = list(range(0, top + step + 1, step))

    fig = Figure(figsize=(8, 3.5))
    ax = fig.add_subplot()
    ax.hist(positions, bins=bins, stacked=True, label=[n for _, n in shown], color=[f"C{i}" for i, _ in shown],
            align="left" if step == 1 else "mid")
    ax.set_xlabel("first divergent position (generated token index)")
    ax.set_ylabel("requests")
    ax.set_title("Where streams first diverge")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _legend_outside(ax, len(shown))
    return png_of(fig)


def drift_plot(data: AuditData) -> bytes | None:
    """Max |Δlogprob| per request on the common prefix, log scale; None if every value is zero."""
    others = data.comparisons.filter(pl.col("configuration") != data.reference.name)
    drifting = others.filter(pl.col("max_logprob_drift") > 0)
    if drifting.is_empty():
        return None
    fig = Figure(figsize=(8, 3.5))
    ax = fig.add_subplot()
    for i, name in enumerate(_others(data)):
        points = drifting.filter(pl.col("configuration") == name)
        if not points.is_empty():
            ax.scatter(points["index"].to_list(), points["max_logprob_drift"].to_list(),
                       label=name, s=18, color=f"C{i}")
    ax.set_yscale("log")
    ax.set_xlim(-0.5, data.comparisons["index"].max() + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("request index")
    ax.set_ylabel("max |Δ logprob| on common prefix")
    ax.set_title("Logprob drift against the reference (requests with zero drift not drawn)")
    _legend_outside(ax, len(ax.get_legend_handles_labels()[0]))
    return png_of(fig)
