"""Request-by-request comparison of two runs' streams: where they diverge and how close the call was.

Token-level work is vectorised with numpy over the flattened list columns; Python only loops over the
few diverged requests it prints.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from deepinfer.audit.errors import AuditError

STATUSES = ("equal", "logprob_drift", "diverged", "missing", "error")

COMPARISON_SCHEMA: dict[str, pl.DataType] = {
    "index": pl.Int64(),
    "request_id": pl.String(),
    "status": pl.String(),
    "first_divergence": pl.Int64(),
    "token_ref": pl.Int64(),
    "token_other": pl.Int64(),
    "logprob_ref": pl.Float32(),
    "logprob_other": pl.Float32(),
    "margin_ref": pl.Float64(),
    "margin_other": pl.Float64(),
    "near_tie": pl.Boolean(),
    "max_logprob_drift": pl.Float64(),
    "max_logprob_ulps": pl.Int64(),
}

_INPUT_COLUMNS = (
    "index",
    "request_id",
    "prompt_token_ids",
    "token_ids",
    "logprobs",
    "top_token_ids",
    "top_logprobs",
    "finish_reason",
    "error_kind",
    "error",
)
_EQUAL, _DRIFT, _DIVERGED, _MISSING, _ERROR = range(len(STATUSES))
_FORMAT_LIMIT = 10


def compare_streams(ref: pl.DataFrame, other: pl.DataFrame, near_tie_threshold: float = 1e-2) -> pl.DataFrame:
    """One row per reference request (columns `COMPARISON_SCHEMA`), matched to `other` by index.

    Raises AuditError when the two frames are not streams of the same suite (a different request id
    or prompt at the same index) or are malformed.
    """
    _check_input(ref, "reference")
    _check_input(other, "other")
    renamed = {c: f"{c}_o" for c in _INPUT_COLUMNS if c != "index"}
    joined = (
        ref.select(_INPUT_COLUMNS)
        .sort("index")
        .join(
            other.select(_INPUT_COLUMNS).rename(renamed).with_columns(pl.lit(True).alias("present_o")),
            on="index",
            how="left",
            maintain_order="left",
        )
        .with_columns(pl.col("present_o").fill_null(False))
    )
    _check_same_suite(joined)

    n = joined.height
    present = joined["present_o"].to_numpy()
    err_r = (joined["finish_reason"] == "error").to_numpy()
    err_o = (joined["finish_reason_o"] == "error").fill_null(False).to_numpy()
    same_error = (err_r & err_o & joined["error_kind"].eq_missing(joined["error_kind_o"]).to_numpy()
                  & joined["error"].eq_missing(joined["error_o"]).to_numpy())

    status = np.full(n, _EQUAL, dtype=np.int8)
    first = np.full(n, -1, dtype=np.int64)
    drift = np.full(n, np.nan)
    ulps = np.full(n, -1, dtype=np.int64)
    status[~present] = _MISSING
    errored = present & (err_r | err_o)
    status[errored & ~same_error] = _ERROR
    drift[errored & same_error] = 0.0
    ulps[errored & same_error] = 0

    served = np.flatnonzero(present & ~err_r & ~err_o)
    sub_status, sub_first, sub_drift, sub_ulps = _compare_served(_take(joined, served))
    status[served], first[served], drift[served], ulps[served] = sub_status, sub_first, sub_drift, sub_ulps

    labels = np.array(STATUSES, dtype=object)[status]
    position = pl.Series("first_divergence", first, dtype=pl.Int64)
    ulp_distance = pl.Series("max_logprob_ulps", ulps, dtype=pl.Int64)
    base = joined.select("index", "request_id").with_columns(
        pl.Series("status", labels, dtype=pl.String),
        position.set(position < 0, None),
        pl.Series("max_logprob_drift", drift, dtype=pl.Float64, nan_to_null=True),
        ulp_distance.set(ulp_distance < 0, None),
    )
    at = pl.col("first_divergence")
    result = pl.concat([base, joined.drop("index", "request_id")], how="horizontal").with_columns(
        pl.col("token_ids").list.get(at, null_on_oob=True).alias("token_ref"),
        pl.col("token_ids_o").list.get(at, null_on_oob=True).alias("token_other"),
        pl.col("logprobs").list.get(at, null_on_oob=True).alias("logprob_ref"),
        pl.col("logprobs_o").list.get(at, null_on_oob=True).alias("logprob_other"),
        _margin("top_logprobs", at).alias("margin_ref"),
        _margin("top_logprobs_o", at).alias("margin_other"),
    )
    near = (pl.col("status") == "diverged") & (
        pl.min_horizontal("margin_ref", "margin_other") < near_tie_threshold
    ).fill_null(False)
    return result.with_columns(near.alias("near_tie")).select(
        [pl.col(c).cast(t) for c, t in COMPARISON_SCHEMA.items()]
    )


def _check_input(frame: pl.DataFrame, which: str) -> None:
    missing = [c for c in _INPUT_COLUMNS if c not in frame.columns]
    if missing:
        raise AuditError(f"{which} streams lack column(s) {', '.join(missing)}")
    duplicated = frame["index"].is_duplicated()
    if duplicated.any():
        raise AuditError(f"{which} streams hold index {frame['index'].filter(duplicated)[0]} more than once")
    if frame["index"].null_count():
        raise AuditError(f"{which} streams have a row without an index")


def _check_same_suite(joined: pl.DataFrame) -> None:
    both = joined.filter(pl.col("present_o"))
    renamed = both.filter(pl.col("request_id") != pl.col("request_id_o"))
    if renamed.height:
        row = renamed.row(0, named=True)
        raise AuditError(f"the runs are not of the same suite: index {row['index']} is request "
                         f"{row['request_id']!r} in the reference but {row['request_id_o']!r} in the other run")
    reprompted = both.filter(pl.col("prompt_token_ids") != pl.col("prompt_token_ids_o"))
    if reprompted.height:
        row = reprompted.row(0, named=True)
        raise AuditError(f"the runs are not of the same suite: request {row['request_id']!r} "
                         f"(index {row['index']}) has different prompt token ids")


def _take(frame: pl.DataFrame, rows: np.ndarray) -> pl.DataFrame:
    """frame[rows], without copying the list columns when `rows` is every row in order."""
    return frame if len(rows) == frame.height else frame[rows]


def _flat(series: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """Values of a list column laid end to end, and the start offset of each row."""
    lengths = _lengths(series)
    values = series.explode(empty_as_null=False, keep_nulls=False).to_numpy()
    return values, np.cumsum(lengths) - lengths


def _lengths(series: pl.Series) -> np.ndarray:
    return series.list.len().fill_null(0).to_numpy().astype(np.int64)


def _segment_reduce(ufunc: np.ufunc, values: np.ndarray, counts: np.ndarray, empty: float) -> np.ndarray:
    """ufunc-reduce consecutive segments of `values` of sizes `counts`; `empty` for empty segments."""
    out = np.full(len(counts), empty, dtype=np.result_type(values.dtype, type(empty)))
    nonempty = counts > 0
    if nonempty.any():
        starts = (np.cumsum(counts) - counts)[nonempty]
        out[nonempty] = ufunc.reduceat(values, starts)
    return out


def _ordered(values: np.ndarray) -> np.ndarray:
    """float32 values as integers in the order of the floats, one apart for adjacent floats: the
    difference of two is their distance in units in the last place (ulps)."""
    bits = values.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _compare_served(rows: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Status code, first divergence (-1 for none), and the max drift of the chosen tokens' logprobs
    before it, in value and in ulps, of requests both runs served."""
    k = rows.height
    len_r, len_o = _lengths(rows["token_ids"]), _lengths(rows["token_ids_o"])
    for lengths, lps in ((len_r, "logprobs"), (len_o, "logprobs_o")):
        bad = np.flatnonzero(lengths != _lengths(rows[lps]))
        if len(bad):
            raise AuditError(f"request {rows['request_id'][int(bad[0])]!r}: logprobs and token ids differ in length")
    ids_r, off_r = _flat(rows["token_ids"])
    ids_o, off_o = _flat(rows["token_ids_o"])
    lp_r = _flat(rows["logprobs"])[0].astype(np.float32)
    lp_o = _flat(rows["logprobs_o"])[0].astype(np.float32)

    common = np.minimum(len_r, len_o)
    row_of = np.repeat(np.arange(k), common)
    pos = np.arange(int(common.sum()), dtype=np.int64) - np.repeat(np.cumsum(common) - common, common)
    at_r, at_o = off_r[row_of] + pos, off_o[row_of] + pos

    big = np.iinfo(np.int64).max
    mismatch_at = _segment_reduce(np.minimum, np.where(ids_r[at_r] != ids_o[at_o], pos, big), common, big)
    first = np.where(mismatch_at != big, mismatch_at, np.where(len_r != len_o, common, -1))
    same_ids = first < 0
    # Same tokens but a different finish reason is still a different stream (its hashes differ).
    finish_differs = (rows["finish_reason"] != rows["finish_reason_o"]).to_numpy()
    first = np.where(same_ids & finish_differs, len_r, first)

    prefix = np.where(first >= 0, first, common)
    delta = np.abs(lp_r[at_r].astype(np.float64) - lp_o[at_o].astype(np.float64))
    delta[pos >= prefix[row_of]] = 0.0
    drift = _segment_reduce(np.maximum, delta, common, 0.0)
    ulp_delta = np.abs(_ordered(lp_r[at_r]) - _ordered(lp_o[at_o]))
    ulp_delta[pos >= prefix[row_of]] = 0
    ulps = _segment_reduce(np.maximum, ulp_delta, common, 0)

    bits_differ = lp_r[at_r].view(np.uint32) != lp_o[at_o].view(np.uint32)
    chosen_drift = np.bincount(row_of[bits_differ], minlength=k) > 0
    status = np.full(k, _EQUAL, dtype=np.int8)
    status[same_ids & (chosen_drift | _top_differs(rows, same_ids))] = _DRIFT
    status[first >= 0] = _DIVERGED
    return status, first, drift, ulps


def _top_differs(rows: pl.DataFrame, candidates: np.ndarray) -> np.ndarray:
    """Per row: do the top-k ids or the fp32 bits of the top-k logprobs differ (checked on candidates)?"""
    differs = np.zeros(rows.height, dtype=bool)
    idx = np.flatnonzero(candidates)
    sub = _take(rows, idx)
    sizes = [
        sub[c].list.eval(pl.element().list.len()).list.sum().fill_null(0).to_numpy()
        for c in ("top_logprobs", "top_logprobs_o")
    ]
    same_shape = sub["top_token_ids"].eq_missing(sub["top_token_ids_o"]).to_numpy() & (sizes[0] == sizes[1])
    differs[idx[~same_shape]] = True
    keep = np.flatnonzero(same_shape)
    if len(keep):
        flat = [
            _take(sub, keep)[c].explode(empty_as_null=False, keep_nulls=False)
            .explode(empty_as_null=False, keep_nulls=False)
            .to_numpy()
            .astype(np.float32)
            for c in ("top_logprobs", "top_logprobs_o")
        ]
        row_of = np.repeat(np.arange(len(keep)), sizes[0][keep])
        changed = flat[0].view(np.uint32) != flat[1].view(np.uint32)
        differs[idx[keep]] = np.bincount(row_of[changed], minlength=len(keep)) > 0
    return differs


def _margin(column: str, at: pl.Expr) -> pl.Expr:
    top = pl.col(column).list.get(at, null_on_oob=True)
    return top.list.get(0, null_on_oob=True).cast(pl.Float64) - top.list.get(1, null_on_oob=True).cast(pl.Float64)


def summarize(comparison: pl.DataFrame) -> dict:
    """Counts per status, near ties, hard divergences, max drift and the diverged positions (index order)."""
    counts = dict.fromkeys(STATUSES, 0)
    for status, count in comparison["status"].value_counts().iter_rows():
        counts[status] = count
    near_tie = int(comparison["near_tie"].sum())
    max_drift = comparison["max_logprob_drift"].max()
    max_ulps = comparison["max_logprob_ulps"].max()
    return {
        "requests": comparison.height,
        **counts,
        "near_tie": near_tie,
        "hard_divergences": counts["diverged"] - near_tie,
        "max_logprob_drift": float(max_drift) if max_drift is not None else 0.0,
        "max_logprob_ulps": int(max_ulps) if max_ulps is not None else 0,
        "first_divergences": comparison.filter(pl.col("status") == "diverged")["first_divergence"].to_list(),
    }


def format_comparison(comparison: pl.DataFrame, name_ref: str, name_other: str) -> str:
    """A counts line, then up to ten diverged requests with both tokens, logprobs and margins."""
    s = summarize(comparison)
    lines = [
        f"{name_ref} vs {name_other}: {s['requests']} requests: {s['equal']} equal, "
        f"{s['logprob_drift']} logprob drift, {s['diverged']} diverged "
        f"({s['near_tie']} near-tie, {s['hard_divergences']} hard), {s['missing']} missing, "
        f"{s['error']} error; max logprob drift {s['max_logprob_drift']:.3g}"
    ]
    diverged = comparison.filter(pl.col("status") == "diverged")
    for row in diverged.head(_FORMAT_LIMIT).iter_rows(named=True):
        kind = "near-tie" if row["near_tie"] else "hard"
        lines.append(
            f"  {row['request_id']} (#{row['index']}) at position {row['first_divergence']}: "
            f"{_side(row, 'ref')} vs {_side(row, 'other')}  [{kind}]"
        )
    if diverged.height > _FORMAT_LIMIT:
        lines.append(f"  ... and {diverged.height - _FORMAT_LIMIT} more diverged")
    return "\n".join(lines)


def _side(row: dict, side: str) -> str:
    token = row[f"token_{side}"]
    if token is None:
        return "end of stream"
    margin = row[f"margin_{side}"]
    margin_text = "n/a" if margin is None else f"{margin:.4g}"
    return f"token {token} (logprob {row[f'logprob_{side}']:.6g}, margin {margin_text})"
