"""Requests rolled up into the groups their ids name: agent-trace episodes (`<episode>/turn-<k>`, the
group is everything before the last '/') or lm-eval tasks (`<task>/<doc>/<type>/<idx>`, the group is
the first component). Outcomes come from the comparisons reports.load computed, nothing else."""

from __future__ import annotations

import re
from dataclasses import dataclass

import polars as pl

from deepinfer.reports.load import AuditData

_TURN = re.compile(r"^(?P<group>.+)/turn-(?P<turn>[0-9]+)$")
BAD = ("diverged", "missing", "error")


@dataclass(frozen=True)
class Grouping:
    """How a suite's request ids group: `noun` names a group ("episode" / "task"), `member` one of its
    requests ("turn" / "request"); `group` and `label` map each grouped request id to its group and to
    how the report names it inside the group ("turn 2", "request 12/loglikelihood/0")."""

    noun: str
    member: str
    group: dict[str, str]
    label: dict[str, str]
    ungrouped: int

    @property
    def title(self) -> str:
        return f"Per-{self.noun} results"


def request_grouping(request_ids: list[str]) -> Grouping | None:
    """The grouping of a suite's ids, or None when no id contains '/'. Episodes when every grouped id
    ends in `/turn-<k>`, tasks otherwise; ids without '/' (a trace file's malformed `line-<N>`) are
    counted as ungrouped."""
    grouped = [r for r in request_ids if "/" in r]
    if not grouped:
        return None
    turns = [_TURN.match(r) for r in grouped]
    if all(turns):
        return Grouping("episode", "turn", {m.string: m["group"] for m in turns},
                        {m.string: f"turn {int(m['turn'])}" for m in turns}, len(request_ids) - len(grouped))
    parts = [r.split("/", 1) for r in grouped]
    return Grouping("task", "request", {r: task for r, (task, _) in zip(grouped, parts)},
                    {r: f"request {rest}" for r, (_, rest) in zip(grouped, parts)}, len(request_ids) - len(grouped))


def group_outcomes(data: AuditData, grouping: Grouping) -> pl.DataFrame:
    """One row per (non-reference configuration, group), configurations in certificate order and groups
    in suite order: `requests`, `drift` (logprob drift only) and `bad` (diverged, missing or errored)
    counts, `kind` (diverged / drift / identical: the group's outcome), and the first bad request in suite
    index order (`first_label`, `first_status`, `first_position`, `first_near_tie`; null when none)."""
    order = {c.name: i for i, c in enumerate(data.configurations)}
    rows = (
        data.comparisons.filter(
            (pl.col("configuration") != data.reference.name) & pl.col("request_id").is_in(list(grouping.group))
        )
        .with_columns(
            group=pl.col("request_id").replace_strict(grouping.group, return_dtype=pl.String),
            label=pl.col("request_id").replace_strict(grouping.label, return_dtype=pl.String),
            config_order=pl.col("configuration").replace_strict(order, return_dtype=pl.Int64),
            bad=pl.col("status").is_in(BAD),
        )
        .sort("config_order", "index")
    )
    bad = pl.col("bad")
    return (
        rows.group_by("config_order", "configuration", "group", maintain_order=True)
        .agg(
            first_index=pl.col("index").min(),
            requests=pl.len(),
            drift=(pl.col("status") == "logprob_drift").sum(),
            bad=bad.sum(),
            first_label=pl.col("label").filter(bad).first(),
            first_status=pl.col("status").filter(bad).first(),
            first_position=pl.col("first_divergence").filter(bad).first(),
            first_near_tie=pl.col("near_tie").filter(bad).first(),
        )
        .sort("config_order", "first_index")
        .drop("config_order", "first_index")
        .with_columns(
            kind=pl.when(pl.col("bad") > 0).then(pl.lit("diverged"))
            .when(pl.col("drift") > 0).then(pl.lit("drift"))
            .otherwise(pl.lit("identical"))
        )
    )


def outcome_text(row: dict) -> str:
    """A group's outcome under one configuration: identical, logprob drift only, or where it first broke."""
    if row["kind"] == "diverged":
        label = row["first_label"]
        if row["first_status"] == "diverged":
            kind = "near-tie" if row["first_near_tie"] else "hard"
            return f"diverged at {label}, token {row['first_position']} ({kind})"
        return f"{label} missing" if row["first_status"] == "missing" else f"{label} errored differently"
    return "logprob drift only" if row["kind"] == "drift" else "identical"
