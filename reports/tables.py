"""The report's tables as polars frames of display strings (renderers only lay them out)."""

from __future__ import annotations

import json

import polars as pl

from deepinfer.audit.structured_check import violation
from deepinfer.reports.groups import Grouping, outcome_text
from deepinfer.reports.load import AuditData, Configuration

MAX_CELL = 160
ROOT_CHARS = 12


def cell(value: object) -> str:
    """One value as short display text: None as an en dash, containers as compact JSON."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def _flatten(obj: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows.extend(_flatten(value, f"{name}."))
        else:
            rows.append((name, cell(value)))
    return rows


def key_value_table(obj: dict) -> pl.DataFrame:
    """Nested dict as (key, value) rows, nested keys dotted."""
    return pl.DataFrame(_flatten(obj), schema={"key": pl.String, "value": pl.String}, orient="row")


def _environment(configuration: Configuration) -> dict:
    manifest = configuration.run.manifest
    return {
        **(manifest.get("environment") or {}),
        "engine_version": manifest.get("engine_version"),
        "git": manifest.get("git"),
    }


def environment_table(reference: Configuration) -> pl.DataFrame:
    """Hardware and software of the reference run, plus the engine build that produced it."""
    return key_value_table(_environment(reference))


def environment_differences(data: AuditData) -> list[str]:
    """One line per configuration whose environment differs from the reference's, naming the keys."""
    reference = dict(_flatten(_environment(data.reference)))
    lines = []
    for c in data.configurations:
        env = dict(_flatten(_environment(c)))
        differing = sorted(k for k in reference.keys() | env.keys() if reference.get(k) != env.get(k))
        if differing:
            lines.append(f"{c.name}: {', '.join(differing)}")
    return lines


def run_stats(configuration: Configuration) -> tuple[int, float | None, float | None]:
    """(generated tokens, tokens per second, median seconds from arrival to first token); None where
    the run has no duration or no first-token times."""
    streams = configuration.run.streams
    tokens = int(streams["token_ids"].list.len().sum() or 0)
    finish = streams["finish_s"].max()
    first_token = (streams["first_token_s"] - streams["arrival_s"]).median()
    return tokens, (tokens / finish if finish else None), first_token


def _knobs(data: AuditData) -> tuple[list[str], dict]:
    """Config keys whose values differ between configurations (in first-seen order), and the settings
    every configuration shares; a key that only repeats each configuration's name is neither."""
    keys: list[str] = []
    for c in data.configurations:
        keys.extend(k for k in c.config if k not in keys)
    varying, shared = [], {}
    for key in keys:
        values = [cell(c.config[key]) if key in c.config else None for c in data.configurations]
        if values == [c.name for c in data.configurations]:
            continue
        if len(set(values)) > 1:
            varying.append(key)
        else:
            shared[key] = data.configurations[0].config[key]
    return varying, shared


def shared_settings(data: AuditData) -> str:
    """The settings every configuration shares, as 'key=value' pairs."""
    return ", ".join(f"{k}={cell(v)}" for k, v in _knobs(data)[1].items())


def configurations_table(data: AuditData) -> pl.DataFrame:
    """One row per configuration: role, the knobs that differ (one `settings` cell of key=value pairs, so
    the table keeps to the page's width however many knobs a sweep turns), short roots, comparison
    counts, throughput and first-token latency."""
    knobs = _knobs(data)[0]
    rows = []
    for c in data.configurations:
        tokens, throughput, first_token = run_stats(c)
        n = data.summary(c.name)
        rows.append(
            {
                "configuration": c.name,
                "role": c.role,
                "settings": ", ".join(f"{k}={cell(c.config[k])}" for k in knobs if k in c.config) or "–",
                "token root": c.token_root[:ROOT_CHARS],
                "logit root": c.logit_root[:ROOT_CHARS],
                "equal": str(n["equal"]),
                "drift": str(n["logprob_drift"]),
                "diverged": str(n["diverged"]),
                "near-tie": str(n["near_tie"]),
                "missing/error": str(n["missing"] + n["error"]),
                "errored": str(errored_rows(c).height),
                "tokens": str(tokens),
                "tok/s": "–" if throughput is None else f"{throughput:.1f}",
                "first token (s)": "–" if first_token is None else f"{first_token:.3f}",
            }
        )
    return pl.DataFrame(rows, schema={key: pl.String for key in rows[0]})


def _count(stats: dict, key: str) -> int | None:
    value = stats.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _share(part: int | None, whole: int | None) -> str:
    return "–" if part is None or not whole else f"{part / whole:.1%}"


def _verify_lengths(lengths: object) -> str:
    """"1 draft: 3, 2 drafts: 5" from stats.json's {"1": 3, "2": 5}; "–" when there are none to show."""
    if not isinstance(lengths, dict) or not lengths or not all(
            isinstance(k, str) and k.isdigit() and _count({"n": n}, "n") is not None for k, n in lengths.items()):
        return "–"
    return ", ".join(f"{k} draft{'s' if k != '1' else ''}: {lengths[k]}" for k in sorted(lengths, key=int))


def engine_counters_table(data: AuditData) -> pl.DataFrame:
    """One row per configuration that speculated or cached prefixes, from its run's stats.json:
    drafts made and kept, kept drafts per verify step (mean accepted length), tokens per target
    forward of a verifying sequence, how many verify steps carried each number of drafts, rollbacks,
    and the prompt tokens taken from the prefix cache."""
    rows = []
    for c in data.configurations:
        stats = c.stats or {}
        speculation = c.config.get("speculation", "off")
        drafted, kept, verify = (_count(stats, k) for k in ("drafted", "drafts_kept", "verify_chunks"))
        hits, looked_up = _count(stats, "prefix_hit_tokens"), _count(stats, "prefix_query_tokens")
        if speculation == "off" and not looked_up:
            continue
        rows.append({
            "configuration": c.name,
            "speculation": cell(speculation),
            "draft tokens": cell(c.config.get("draft_tokens")) if speculation != "off" else "–",
            "drafted": cell(drafted),
            "kept": cell(kept),
            "acceptance": _share(kept, drafted),
            "kept per verify": "–" if kept is None or not verify else f"{kept / verify:.2f}",
            "tokens per forward": "–" if kept is None or not verify else f"{1 + kept / verify:.2f}",
            "verify lengths": _verify_lengths(stats.get("verify_lengths")) if speculation != "off" else "–",
            "rollbacks": cell(_count(stats, "rollbacks")),
            "prefix hits": "–" if not looked_up else f"{hits} of {looked_up} ({_share(hits, looked_up)})",
        })
    return pl.DataFrame(rows, schema={key: pl.String for key in rows[0]}) if rows else pl.DataFrame()


def structured_table(data: AuditData) -> pl.DataFrame:
    """One row per configuration whose suite has structured requests: how many there were, and how
    many finished with a text their constraint accepts (`audit.structured_check`), finished with one
    it does not, were cut by max_tokens or the context before their constraint could end, errored,
    or finished under a constraint the checker cannot read (a tool-call grammar uses llguidance's own
    Lark). The validity rate is over the checkable ones: one that errored or was cut is not valid."""
    rows = []
    for c in data.configurations:
        counts = dict.fromkeys(("requests", "valid", "invalid", "cut", "errored", "unchecked"), 0)
        for row in c.run.streams.select("params", "text", "finish_reason", "error_kind").iter_rows(named=True):
            constraint = json.loads(row["params"]).get("structured")
            if constraint is None:
                continue
            counts["requests"] += 1
            if row["error_kind"] is not None:
                counts["errored"] += 1
            elif row["finish_reason"] != "stop":
                counts["cut"] += 1
            else:
                try:
                    counts["valid" if violation(constraint, row["text"] or "") is None else "invalid"] += 1
                except ValueError:
                    counts["unchecked"] += 1
        if counts["requests"]:
            rows.append({"configuration": c.name, **{key: str(value) for key, value in counts.items()},
                         "validity": _share(counts["valid"], counts["requests"] - counts["unchecked"])})
    return pl.DataFrame(rows, schema={key: pl.String for key in rows[0]}) if rows else pl.DataFrame()


def _token(row: dict, column: str) -> str:
    """A token at the divergence; a stream that already ended there shows as 'end'."""
    if row[column] is None and row["status"] == "diverged":
        return "end"
    return cell(row[column])


def divergence_table(data: AuditData) -> pl.DataFrame:
    """Every non-equal, non-drift request of every non-reference configuration, in config then index order."""
    order = {c.name: i for i, c in enumerate(data.configurations)}
    bad = (
        data.comparisons.filter(
            (pl.col("configuration") != data.reference.name)
            & pl.col("status").is_in(["diverged", "missing", "error"])
        )
        .with_columns(order=pl.col("configuration").replace_strict(order, return_dtype=pl.Int64))
        .sort("order", "index")
    )
    rows = []
    for r in bad.iter_rows(named=True):
        kind = ("near-tie" if r["near_tie"] else "hard") if r["status"] == "diverged" else r["status"]
        rows.append(
            {
                "configuration": r["configuration"],
                "request": r["request_id"],
                "position": cell(r["first_divergence"]),
                "token ref → other": f"{_token(r, 'token_ref')} → {_token(r, 'token_other')}",
                "logprob ref": cell(r["logprob_ref"]),
                "logprob other": cell(r["logprob_other"]),
                "margin ref": cell(r["margin_ref"]),
                "margin other": cell(r["margin_other"]),
                "kind": kind,
            }
        )
    columns = ["configuration", "request", "position", "token ref → other", "logprob ref", "logprob other",
               "margin ref", "margin other", "kind"]
    return pl.DataFrame(rows, schema={key: pl.String for key in columns})


def errored_rows(configuration: Configuration) -> pl.DataFrame:
    """The rows of a configuration's run that are errors (index, request id, kind, detail)."""
    return (configuration.run.streams.filter(pl.col("finish_reason") == "error")
            .select("index", "request_id", "error_kind", "error"))


def errored_table(data: AuditData) -> pl.DataFrame:
    """One row per request that errored in any configuration, in suite order: its error kind and detail
    (from the first configuration where it errored) and where it errored."""
    names = [c.name for c in data.configurations]
    errored = pl.concat([errored_rows(c).with_columns(configuration=pl.lit(c.name)) for c in data.configurations])
    rows = []
    for (index, request_id), group in errored.group_by("index", "request_id", maintain_order=True):
        where = group["configuration"].to_list()
        kinds = sorted(set(zip(group["error_kind"].to_list(), group["error"].to_list())))
        rows.append({
            "index": index,
            "request": request_id,
            "kind": group["error_kind"][0],
            "detail": cell(group["error"][0]),
            "errored in": f"all {len(names)}" if len(where) == len(names) else ", ".join(where),
            "same error everywhere": "yes" if len(kinds) == 1 else "no",
        })
    columns = ["request", "kind", "detail", "errored in", "same error everywhere"]
    rows.sort(key=lambda row: row["index"])
    return pl.DataFrame([{key: row[key] for key in columns} for row in rows], schema={key: pl.String for key in columns})


def group_table(outcomes: pl.DataFrame, grouping: Grouping) -> pl.DataFrame:
    """One row per (configuration, group) that is not identical to the reference, in the outcomes' order."""
    members = f"{grouping.member}s"
    rows = [
        {
            "configuration": r["configuration"],
            grouping.noun: r["group"],
            members: str(r["requests"]),
            "outcome": outcome_text(r),
            f"diverged {members}": str(r["bad"]),
            f"drift-only {members}": str(r["drift"]),
        }
        for r in outcomes.filter(pl.col("kind") != "identical").iter_rows(named=True)
    ]
    columns = ["configuration", grouping.noun, members, "outcome", f"diverged {members}", f"drift-only {members}"]
    return pl.DataFrame(rows, schema={key: pl.String for key in columns})
