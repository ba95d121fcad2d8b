"""compare_streams / summarize / format_comparison on synthetic stream frames built with make_row."""

from __future__ import annotations

import struct

import numpy as np
import polars as pl
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deepinfer.audit.compare import COMPARISON_SCHEMA, compare_streams, format_comparison, summarize
from deepinfer.audit.errors import AuditError
from deepinfer.audit.store import make_row
from deepinfer.audit.streams import STREAM_SCHEMA

SECOND = 1.0  # top-2 logprob sits this far below the chosen one unless a test says otherwise


def stream(tokens, logprobs=None, *, tops=None, finish="length", error=None, error_kind="invalid_request",
           prompt=(1, 2)) -> dict:
    """One request's content; `tops` is a list of (top1, top2) logprob pairs per position."""
    logprobs = [-0.5] * len(tokens) if logprobs is None else logprobs
    tops = [(lp, lp - SECOND) for lp in logprobs] if tops is None else tops
    return {"tokens": list(tokens), "logprobs": [f32(lp) for lp in logprobs],
            "tops": [[f32(lp) for lp in pair] for pair in tops], "finish": finish,
            "error": error, "error_kind": error_kind, "prompt": list(prompt)}


def f32(x: float) -> float:
    return float(np.float32(x))


def frame(streams: list[dict], *, indices=None, ids=None) -> pl.DataFrame:
    indices = range(len(streams)) if indices is None else indices
    rows = []
    for n, (index, s) in enumerate(zip(indices, streams)):
        request_id = f"r{index}" if ids is None else ids[n]
        rows.append(make_row(
            index, request_id, s["prompt"], {"seed": 0}, s["tokens"], s["logprobs"],
            [[t, t + 1] for t in s["tokens"]], [list(pair) for pair in s["tops"]], None,
            "error" if s["error"] else s["finish"], s["error"], 0.0, None, 1.0,
            error_kind=s["error_kind"] if s["error"] else None,
        ))
    return pl.from_dicts(rows, schema=STREAM_SCHEMA)


def next_fp32(x: float) -> float:
    """The fp32 neighbour of x one bit away in the mantissa."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return struct.unpack("<f", struct.pack("<I", bits ^ 1))[0]


def default_margin(logprob: float) -> float:
    """top1 - top2 of `stream`'s default tops, as both are stored in fp32."""
    return f32(logprob) - f32(logprob - SECOND)


def one(cmp: pl.DataFrame, index: int = 0) -> dict:
    return cmp.filter(pl.col("index") == index).row(0, named=True)


def test_identical_runs_are_equal_with_the_spec_columns():
    f = frame([stream([1, 2, 3]), stream([]), stream([4], error=None, finish="stop"), stream([], error="boom")])
    cmp = compare_streams(f, f)
    assert cmp.schema == pl.Schema(COMPARISON_SCHEMA)
    assert cmp["status"].to_list() == ["equal"] * 4
    assert cmp["max_logprob_drift"].to_list() == [0.0] * 4
    assert cmp["first_divergence"].null_count() == 4
    assert not cmp["near_tie"].any()


def test_one_bit_of_one_logprob_is_drift():
    ref = frame([stream([1, 2, 3], [-0.25, -0.5, -0.75]), stream([7])])
    other = frame([stream([1, 2, 3], [-0.25, next_fp32(-0.5), -0.75]), stream([7])])
    cmp = compare_streams(ref, other)
    assert cmp["status"].to_list() == ["logprob_drift", "equal"]
    assert one(cmp)["max_logprob_drift"] == abs(next_fp32(-0.5) + 0.5) > 0
    assert (one(cmp)["max_logprob_ulps"], one(cmp, 1)["max_logprob_ulps"]) == (1, 0)
    assert one(cmp)["first_divergence"] is None


@settings(max_examples=50, deadline=None)
@given(st.floats(-60.0, 0.0, width=32), st.integers(-3000, 3000))
@example(-2e-45, 5)  # through zero: the walk visits -0.0 (0.0's value), then positive denormals
def test_drift_in_ulps_counts_the_floats_between_the_logprobs(logprob, steps):
    """k steps of np.nextafter are k ulps apart, across zero too."""
    moved = np.float32(logprob)
    for _ in range(abs(steps)):
        moved = np.nextafter(moved, np.float32(np.inf if steps > 0 else -np.inf), dtype=np.float32)
    cmp = compare_streams(frame([stream([1], [float(logprob)])]), frame([stream([1], [float(moved)])]))
    assert one(cmp)["max_logprob_ulps"] == abs(steps)


def test_negative_zero_is_drift_of_size_zero():
    cmp = compare_streams(frame([stream([1], [0.0])]), frame([stream([1], [-0.0])]))
    assert one(cmp)["status"] == "logprob_drift"
    assert one(cmp)["max_logprob_drift"] == 0.0 and one(cmp)["max_logprob_ulps"] == 0


def test_a_changed_top2_logprob_alone_is_drift():
    ref = frame([stream([1, 2], tops=[(-0.5, -1.5), (-0.5, -1.5)])])
    other = frame([stream([1, 2], tops=[(-0.5, -1.5), (-0.5, next_fp32(-1.5))])])
    assert one(compare_streams(ref, other))["status"] == "logprob_drift"


def test_hard_divergence_reports_both_sides_at_the_first_differing_token():
    ref_tops = [(-0.25, -2), (-0.25, -2), (-0.75, -1.0), (-1, -2)]
    other_tops = [(-0.25, -2), (-0.25, -2), (-0.875, -1.5), (-9, -10)]
    ref = frame([stream([1, 2, 3, 4], [-0.25, -0.5, -0.75, -1.0], tops=ref_tops)])
    other = frame([stream([1, 2, 9, 9], [-0.25, -0.625, -0.875, -9.0], tops=other_tops)])
    row = one(compare_streams(ref, other))
    assert row["status"] == "diverged"
    assert row["first_divergence"] == 2
    assert (row["token_ref"], row["token_other"]) == (3, 9)
    assert (row["logprob_ref"], row["logprob_other"]) == (-0.75, -0.875)
    assert (row["margin_ref"], row["margin_other"]) == (0.25, 0.625)
    assert row["near_tie"] is False
    assert row["max_logprob_drift"] == 0.125  # over the common prefix [0, 2) only


@pytest.mark.parametrize(
    ("threshold", "near"),
    [(0.125, False), (0.12500001, True), (0.1, False), (1.0, True)],
)
def test_near_tie_is_the_smaller_margin_strictly_below_the_threshold(threshold, near):
    ref = frame([stream([1, 5], tops=[(-0.5, -1.5), (-0.5, -3.5)])])  # margin_ref 2.0 at position 1
    other = frame([stream([1, 6], tops=[(-0.5, -1.5), (-0.5, -0.625)])])  # margin_other 0.125
    cmp = compare_streams(ref, other, near_tie_threshold=threshold)
    assert one(cmp)["near_tie"] is near
    assert summarize(cmp)["hard_divergences"] == (0 if near else 1)


@pytest.mark.parametrize("ref_longer", [False, True])
def test_a_strict_prefix_diverges_at_the_shorter_length(ref_longer):
    short = stream([1, 2, 3], finish="stop")
    long = stream([1, 2, 3, 4, 5], tops=[(-0.5, -1.5)] * 3 + [(-0.5, -0.5001), (-1, -2)])
    ref, other = (long, short) if ref_longer else (short, long)
    row = one(compare_streams(frame([ref]), frame([other])))
    assert row["status"] == "diverged" and row["first_divergence"] == 3
    present, absent = ("ref", "other") if ref_longer else ("other", "ref")
    assert row[f"token_{present}"] == 4 and row[f"token_{absent}"] is None
    assert row[f"logprob_{absent}"] is None and row[f"margin_{absent}"] is None
    assert row[f"margin_{present}"] == pytest.approx(0.0001, rel=1e-2)
    assert row["near_tie"] is True  # the one margin there is tiny


def test_same_tokens_with_a_different_finish_reason_diverge_at_the_end():
    row = one(compare_streams(frame([stream([1, 2], finish="stop")]), frame([stream([1, 2], finish="length")])))
    assert row["status"] == "diverged" and row["first_divergence"] == 2 and row["token_ref"] is None


def test_a_request_absent_from_the_other_run_is_missing():
    ref = frame([stream([1]), stream([2]), stream([3])])
    other = frame([stream([1]), stream([3])], indices=[0, 2])
    cmp = compare_streams(ref, other)
    assert cmp["status"].to_list() == ["equal", "missing", "equal"]
    assert one(cmp, 1)["max_logprob_drift"] is None


def test_extra_requests_in_the_other_run_are_not_rows():
    cmp = compare_streams(frame([stream([1])]), frame([stream([1]), stream([2])]))
    assert cmp["index"].to_list() == [0]


def test_error_rows():
    ref = frame([stream([], error="oom"), stream([1, 2]), stream([], error="oom"), stream([], error="oom"),
                 stream([], error="too long", error_kind="prompt_too_long")])
    other = frame([stream([1, 2]), stream([], error="oom"), stream([], error="timeout"), stream([], error="oom"),
                   stream([], error="too long", error_kind="malformed")])
    cmp = compare_streams(ref, other)
    assert cmp["status"].to_list() == ["error", "error", "error", "equal", "error"]  # kind and detail must match
    assert cmp["max_logprob_drift"].to_list() == [None, None, None, 0.0, None]


def test_a_different_request_id_at_an_index_is_a_suite_mismatch():
    with pytest.raises(AuditError, match="not of the same suite"):
        compare_streams(frame([stream([1]), stream([2])]), frame([stream([1]), stream([2])], ids=["r0", "x1"]))


def test_a_different_prompt_at_an_index_is_a_suite_mismatch():
    with pytest.raises(AuditError, match="prompt token ids"):
        compare_streams(frame([stream([1])]), frame([stream([1], prompt=(1, 3))]))


def test_malformed_input_is_an_audit_error():
    f = frame([stream([1]), stream([2])])
    with pytest.raises(AuditError, match="more than once"):
        compare_streams(pl.concat([f, f]), f)
    with pytest.raises(AuditError, match="lack column"):
        compare_streams(f, f.drop("logprobs"))


token_lists = st.lists(st.integers(0, 20), min_size=1, max_size=25)
fp32 = st.floats(-20.0, 0.0, width=32, allow_nan=False)


@st.composite
def mutated_pairs(draw):
    """Several requests; some get one token replaced at a random position (later tokens also change)."""
    pairs, expected = [], []
    for _ in range(draw(st.integers(1, 6))):
        tokens = draw(token_lists)
        logprobs = draw(st.lists(fp32, min_size=len(tokens), max_size=len(tokens)))
        if draw(st.booleans()):
            pos = draw(st.integers(0, len(tokens) - 1))
            tail = draw(st.lists(st.integers(0, 20), max_size=10))
            changed = tokens[:pos] + [tokens[pos] + 21] + tail
            other_lps = logprobs[:pos] + draw(st.lists(fp32, min_size=len(changed) - pos, max_size=len(changed) - pos))
            pairs.append((stream(tokens, logprobs), stream(changed, other_lps)))
            expected.append(pos)
        else:
            pairs.append((stream(tokens, logprobs), stream(tokens, logprobs)))
            expected.append(None)
    return pairs, expected


@settings(max_examples=60, deadline=None)
@given(mutated_pairs())
def test_first_divergence_is_the_mutated_position(case):
    pairs, expected = case
    cmp = compare_streams(frame([a for a, _ in pairs]), frame([b for _, b in pairs]))
    assert cmp["first_divergence"].to_list() == expected
    assert cmp["status"].to_list() == ["equal" if p is None else "diverged" for p in expected]
    for row, (a, b), pos in zip(cmp.iter_rows(named=True), pairs, expected):
        assert row["max_logprob_drift"] == 0.0  # the prefix logprobs were copied bit for bit
        if pos is not None:
            assert (row["token_ref"], row["token_other"]) == (a["tokens"][pos], b["tokens"][pos])
            assert (row["logprob_ref"], row["logprob_other"]) == (a["logprobs"][pos], b["logprobs"][pos])
            assert row["margin_ref"] == default_margin(a["logprobs"][pos])
            assert row["margin_other"] == default_margin(b["logprobs"][pos])


@settings(max_examples=40, deadline=None)
@given(token_lists, st.data())
def test_truncation_diverges_at_the_cut_and_drift_is_the_largest_prefix_difference(tokens, data):
    cut = data.draw(st.integers(0, len(tokens) - 1))
    lps = data.draw(st.lists(fp32, min_size=len(tokens), max_size=len(tokens)))
    other_lps = data.draw(st.lists(fp32, min_size=cut, max_size=cut))
    row = one(compare_streams(frame([stream(tokens, lps)]), frame([stream(tokens[:cut], other_lps)])))
    assert row["status"] == "diverged" and row["first_divergence"] == cut
    assert row["token_ref"] == tokens[cut] and row["token_other"] is None
    assert row["max_logprob_drift"] == max([abs(a - b) for a, b in zip(lps, other_lps)], default=0.0)


def test_summarize_and_format():
    refs = [stream([1, 2]) for _ in range(14)] + [stream([5]), stream([6]), stream([], error="oom")]
    others = [stream([1, 3], tops=[(-0.5, -1.5), (-0.5, -0.5)]) for _ in range(12)] + [stream([1, 4])] * 2
    others += [stream([5], [next_fp32(-0.5)])]
    cmp = compare_streams(frame(refs), frame(others))
    summary = summarize(cmp)
    assert {k: summary[k] for k in ("requests", "equal", "logprob_drift", "diverged", "missing", "error")} == {
        "requests": 17, "equal": 0, "logprob_drift": 1, "diverged": 14, "missing": 2, "error": 0,
    }
    assert (summary["near_tie"], summary["hard_divergences"]) == (12, 2)
    assert summary["first_divergences"] == [1] * 14
    assert summary["max_logprob_drift"] == abs(next_fp32(-0.5) + 0.5)
    text = format_comparison(cmp, "ref", "var")
    lines = text.splitlines()
    assert lines[0].startswith("ref vs var: 17 requests") and "14 diverged (12 near-tie, 2 hard)" in lines[0]
    assert len(lines) == 1 + 10 + 1 and lines[-1] == "  ... and 4 more diverged"
    assert "r0 (#0) at position 1: token 2 (logprob -0.5, margin 1) vs token 3" in lines[1]
    assert lines[1].endswith("[near-tie]")


def test_summarize_of_an_empty_comparison():
    empty = frame([])
    summary = summarize(compare_streams(empty, empty))
    assert summary["requests"] == 0 and summary["max_logprob_drift"] == 0.0 and summary["first_divergences"] == []
