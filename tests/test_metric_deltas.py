"""Tests for audit/metric_deltas.py: paired bootstrap deltas of two runs' per-sample lm-eval metrics, the
verdicts "unchanged" / "numbers changed" / "quality changed", one-line refusals, and the loader on the
files our lm-eval runs write. Per-sample metrics are built in the tests (no model runs); the loader's
files come from lm-eval itself, scoring the shipped tasks against a fixed fake model."""

from __future__ import annotations

import json
import math
import shutil
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.audit import metric_deltas as md
from deepinfer.audit.errors import AuditError
from deepinfer.audit.metric_deltas import (MetricDelta, bootstrap_ci, format_metric_deltas, metric_deltas,
                                           metric_samples)

KEY = ("mc", "acc,none")
DATE = "2000-01-02T03-04-05.123456"  # before any run the tests make


def binary(n: int = 400, seed: int = 7) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    return {doc: float(rng.integers(2)) for doc in range(n)}


def flipped(values: dict[int, float], up: int, down: int) -> dict[int, float]:
    """`values` with the first `up` zeros set to 1 and the first `down` ones set to 0."""
    zeros = [doc for doc, value in values.items() if value == 0][:up]
    ones = [doc for doc, value in values.items() if value == 1][:down]
    assert len(zeros) == up and len(ones) == down
    return {**values, **{doc: 1.0 for doc in zeros}, **{doc: 0.0 for doc in ones}}


def one(a: dict, b: dict, **kwargs) -> MetricDelta:
    [row] = metric_deltas({KEY: a}, {KEY: b}, **kwargs)
    return row


def test_planted_change_is_a_quality_change():
    a = binary()
    row = one(a, flipped(a, up=120, down=0))  # 30 % of 400 samples flipped from 0 to 1
    assert (row.n, row.changed, row.increased, row.decreased) == (400, 120, 120, 0)
    assert row.delta == pytest.approx(0.3) and row.mean_b - row.mean_a == pytest.approx(0.3)
    assert 0 < row.ci_low < 0.3 < row.ci_high
    assert row.verdict == "quality changed"
    assert format_metric_deltas([row]) == (
        f"mc/acc,none: A {row.mean_a:.3f} -> B {row.mean_b:.3f} (delta +0.300, 95% CI "
        f"[+{row.ci_low:.3f}, +{row.ci_high:.3f}], n=400): quality changed")


def test_unchanged_suite():
    a = binary()
    rows = metric_deltas({KEY: a, ("mc", "acc_norm,none"): a}, {KEY: dict(a), ("mc", "acc_norm,none"): dict(a)})
    for row in rows:
        assert (row.ci_low, row.ci_high, row.delta, row.changed, row.verdict) == (0.0, 0.0, 0.0, 0, "unchanged")
    assert [row.metric for row in rows] == ["acc,none", "acc_norm,none"]
    assert format_metric_deltas(rows).splitlines()[0] == (
        f"mc/acc,none: A {rows[0].mean_a:.3f} -> B {rows[0].mean_a:.3f} (delta +0.000, 95% CI [+0.000, +0.000], "
        f"n=400): unchanged")


def test_noise_is_numbers_changed():
    a = binary()
    row = one(a, flipped(a, up=20, down=20))
    assert (row.changed, row.increased, row.decreased, row.delta) == (40, 20, 20, 0.0)
    assert row.ci_low < 0 < row.ci_high
    assert row.verdict == "numbers changed"


def test_negative_zero_is_a_change_of_the_numbers_only():
    row = one({0: 0.0, 1: 1.0}, {0: -0.0, 1: 1.0})
    assert (row.changed, row.increased, row.decreased, row.ci_low, row.ci_high) == (1, 0, 0, 0.0, 0.0)
    assert row.verdict == "numbers changed"


def test_bootstrap_is_deterministic_and_seeded():
    a = binary()
    b = flipped(a, up=30, down=10)
    first, again = one(a, b), one(a, b)
    assert first == again
    diffs = np.random.default_rng(0).normal(size=50)
    ci = bootstrap_ci(diffs, 1000, 0.95, seed=1)
    assert ci == bootstrap_ci(diffs, 1000, 0.95, seed=1) != bootstrap_ci(diffs, 1000, 0.95, seed=2)
    # pairing is by doc id: the order the records come in does not matter
    assert one(dict(reversed(a.items())), dict(reversed(b.items()))) == first


def reference_ci(diffs: list[float], resamples: int, confidence: float, seed: int) -> tuple[float, float]:
    """The bootstrap one resample at a time, in plain Python (indices as bootstrap_ci's docstring says)."""
    rng = np.random.default_rng(seed)
    n = len(diffs)
    means = []
    for _ in range(resamples):
        picks = [min(int(u * n), n - 1) for u in rng.random(n)]
        means.append(sum(diffs[i] for i in picks) / n)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


@pytest.mark.parametrize("chunk", [md.CHUNK, 5, 1])  # one block, blocks of one resample, and a block smaller than n
def test_bootstrap_matches_a_reference_loop(monkeypatch, chunk):
    diffs = [0.5, -1.0, 0.0, 2.0, 0.25, -0.75, 1.0]
    monkeypatch.setattr(md, "CHUNK", chunk)
    for confidence in (0.95, 0.8):
        fast = bootstrap_ci(np.array(diffs), 500, confidence, 3)
        assert fast == pytest.approx(reference_ci(diffs, 500, confidence, 3), abs=1e-12)


dyadic = st.integers(-64, 64).map(lambda k: k / 8)  # sums and differences of these are exact


@settings(max_examples=40, deadline=None)
@given(values=st.lists(dyadic, min_size=1, max_size=60), shift=st.integers(-16, 16).map(lambda k: k / 8))
def test_a_shifted_copy_has_the_shift_as_its_interval(values, shift):
    a = dict(enumerate(values))
    row = one(a, {doc: value + shift for doc, value in a.items()}, resamples=200)
    assert (row.delta, row.ci_low, row.ci_high) == (shift, shift, shift)
    assert row.verdict == ("unchanged" if shift == 0 else "quality changed")
    assert row.changed == (0 if shift == 0 else len(values))


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(dyadic, dyadic), min_size=1, max_size=60), seed=st.integers(0, 2**32))
def test_swapping_the_runs_mirrors_the_result(pairs, seed):
    a = {doc: x for doc, (x, _) in enumerate(pairs)}
    b = {doc: y for doc, (_, y) in enumerate(pairs)}
    forward, backward = one(a, b, resamples=300, seed=seed), one(b, a, resamples=300, seed=seed)
    assert backward.delta == -forward.delta
    assert (backward.ci_low, backward.ci_high) == pytest.approx((-forward.ci_high, -forward.ci_low), abs=1e-12)
    assert (backward.increased, backward.decreased) == (forward.decreased, forward.increased)
    assert backward.verdict == forward.verdict
    assert (forward.verdict == "unchanged") == (a == b)
    assert forward.ci_low <= forward.ci_high


@pytest.mark.parametrize(("a", "b", "message"), [
    ({}, {KEY: {0: 1.0}}, "no per-sample metrics to compare: A is empty"),
    ({}, {}, "no per-sample metrics to compare: A and B are empty"),
    ({KEY: {0: 1.0}, ("gen", "exact_match,none"): {0: 1.0}}, {KEY: {0: 1.0}, ("ppl", "bits_per_byte,none"): {0: 1.0}},
     "different tasks: only in A: gen; only in B: ppl"),
    ({KEY: {0: 1.0}}, {KEY: {0: 1.0}, ("mc", "acc_norm,none"): {0: 1.0}},
     "different metrics: only in A: none; only in B: mc/acc_norm,none"),
    ({KEY: {0: 1.0, 1: 0.0, 5: 1.0, 3: 0.0}}, {KEY: {0: 1.0, 1: 0.0, 9: 1.0}},
     "mc/acc,none: different samples: 2 only in A (first: doc 3), 1 only in B (first: doc 9)"),
    ({KEY: {0: 1.0}}, {KEY: {0: 1.0, 1: 0.0}}, "mc/acc,none: different samples: 1 only in B (first: doc 1)"),
    ({KEY: {}}, {KEY: {}}, "mc/acc,none: no samples to compare"),
    ({KEY: {0: 1.0, 1: [-10.0, 9]}}, {KEY: {0: 1.0, 1: [-10.0, 9]}},
     "mc/acc,none: doc 1 in A is not a finite number: [-10.0, 9]"),
    ({KEY: {0: 1.0}}, {KEY: {0: "1.0"}}, "mc/acc,none: doc 0 in B is not a finite number: '1.0'"),
    ({KEY: {0: 1.0}}, {KEY: {0: math.nan}}, "mc/acc,none: doc 0 in B is not a finite number: nan"),
])
def test_refusals(a, b, message):
    with pytest.raises(AuditError) as err:
        metric_deltas(a, b)
    assert str(err.value) == message


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"resamples": 0}, "resamples must be a positive integer, got 0"),
    ({"confidence": 95}, "confidence must be between 0 and 1, got 95"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(AuditError, match=f"^{message}$"):
        metric_deltas({KEY: {0: 1.0}}, {KEY: {0: 0.0}}, **kwargs)


def test_ten_thousand_samples_are_fast():
    a = binary(10_000)
    start = time.perf_counter()
    row = one(a, flipped(a, up=100, down=100))
    assert time.perf_counter() - start < 10  # about 1 s on one core
    assert row.verdict == "numbers changed" and row.n == 10_000


# --- the loader, on the files lm-eval writes for our runs ---------------------------------------------------

@pytest.fixture(scope="module")
def lm_eval_outputs(tmp_path_factory):
    """The shipped tasks deepinfer_mc, deepinfer_gen and deepinfer_ppl (3 docs each) scored by lm-eval
    against a fake model, written as `deepinfer audit eval` writes OUT (summary.json, lm_eval/batch-1.json)
    and as lm-eval's CLI writes `deepinfer lm-eval --output_path CLI --log_samples` (CLI/<model>/...)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.model import LM
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import handle_non_serializable

    from deepinfer.harness import evaluate

    class Fixed(LM):
        def loglikelihood(self, requests, disable_tqdm=False):
            return [(-float(len(request.args[1])), False) for request in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return [-10.0] * len(requests)

        def generate_until(self, requests, disable_tqdm=False):
            return ["5"] * len(requests)

    results = lm_eval.simple_evaluate(model=Fixed(), tasks=["deepinfer_mc", "deepinfer_gen", "deepinfer_ppl"],
                                      task_manager=evaluate.task_manager(), limit=3, bootstrap_iters=0,
                                      log_samples=True)
    base = tmp_path_factory.mktemp("metric-samples")
    out = base / "eval"
    (out / "lm_eval").mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps({"reference": "batch-1"}))
    record = {"results": results["results"], "samples": results["samples"]}  # as harness/evaluate.py writes it
    (out / "lm_eval" / "batch-1.json").write_text(json.dumps(record, indent=2, sort_keys=True,
                                                             default=handle_non_serializable))
    tracker = EvaluationTracker(output_path=str(base / "cli"))
    tracker.general_config_tracker.model_name_sanitized = "model__tiny"
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    return out, base / "cli"


def test_loader_reads_audit_eval_and_lm_eval_cli_outputs(lm_eval_outputs):
    out, cli = lm_eval_outputs
    loaded = metric_samples(out)
    assert sorted(loaded) == [
        ("deepinfer_gen", "exact_match,none"), ("deepinfer_mc", "acc,none"), ("deepinfer_mc", "acc_norm,none"),
        ("deepinfer_ppl", "bits_per_byte,none"), ("deepinfer_ppl", "byte_perplexity,none"),
        ("deepinfer_ppl", "word_perplexity,none")]
    assert all(sorted(docs) == [0, 1, 2] for docs in loaded.values())
    assert loaded["deepinfer_gen", "exact_match,none"] == {0: 1.0, 1: 0.0, 2: 0.0}  # "5" answers doc 0 only
    assert loaded["deepinfer_ppl", "word_perplexity,none"][0] == [-10.0, 9]  # lm-eval keeps (loglikelihood, words)
    assert metric_samples(out / "lm_eval" / "batch-1.json") == loaded
    [results_file] = cli.glob("model__tiny/results_*.json")
    for path in (cli, cli / "model__tiny", results_file):
        assert metric_samples(path) == loaded
    numeric = {key: docs for key, docs in loaded.items() if key[0] != "deepinfer_ppl"}
    assert {row.verdict for row in metric_deltas(numeric, dict(numeric))} == {"unchanged"}
    with pytest.raises(AuditError, match=r"^deepinfer_ppl/bits_per_byte,none: doc 0 in A is not a finite number: "):
        metric_deltas(loaded, loaded)


def test_loader_needs_one_run(lm_eval_outputs, tmp_path):
    _, cli = lm_eval_outputs
    both = shutil.copytree(cli, tmp_path / "both")
    [results_file] = both.glob("model__tiny/results_*.json")
    date = results_file.stem.removeprefix("results_")
    for file in list(both.glob("model__tiny/*")):
        shutil.copy(file, file.with_name(file.name.replace(date, DATE)))
    with pytest.raises(AuditError) as err:
        metric_samples(both)
    assert str(err.value).startswith(f"{both}: holds 2 lm-eval runs' samples; give one's results file: "
                                     f"model__tiny/results_{DATE}.json, model__tiny/results_")
    assert metric_samples(both / "model__tiny" / f"results_{DATE}.json") == metric_samples(cli)


def test_loader_refusals(tmp_path):
    (tmp_path / "record.json").write_text(json.dumps({"results": {}}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "eval" / "lm_eval").mkdir(parents=True)
    (tmp_path / "eval" / "summary.json").write_text(json.dumps({"reference": "batch-1"}))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / f"samples_mc_{DATE}.jsonl").write_text(json.dumps({"doc_id": 0, "filter": "none"}) + "\n")
    (tmp_path / "twice.json").write_text(json.dumps({"samples": {"mc": [
        {"doc_id": 0, "filter": "none", "metrics": ["acc"], "acc": 1.0}] * 2}}))
    cases = {
        tmp_path / "record.json": f"{tmp_path / 'record.json'}: no per-sample records (a 'samples' object, as in "
                                  f"deepinfer audit eval's OUT/lm_eval/batch-N.json)",
        tmp_path / "empty": f"{tmp_path / 'empty'}: no lm-eval per-sample files (samples_<task>_<date>.jsonl, "
                            f"written with --log_samples)",
        tmp_path / "empty" / f"results_{DATE}.json": f"{tmp_path / 'empty'}: no lm-eval per-sample files "
                                                     f"(samples_<task>_{DATE}.jsonl, written with --log_samples)",
        tmp_path / "eval": f"{tmp_path / 'eval' / 'lm_eval' / 'batch-1.json'}: no such file",
        tmp_path / "bad": f"{tmp_path / 'bad'}: task mc: a sample record lacks 'metrics'",
        tmp_path / "twice.json": f"{tmp_path / 'twice.json'}: mc/acc,none: doc 0 recorded twice",
    }
    for path, message in cases.items():
        with pytest.raises(AuditError) as err:
            metric_samples(path)
        assert str(err.value) == message


def test_metric_diff_command_fails_a_quality_change_and_names_what_it_cannot_compare(lm_eval_outputs, tmp_path,
                                                                                     capsys):
    """`deepinfer audit metric-diff` over `audit eval` folders: the same run is unchanged (exit 0); a
    candidate whose exact-match answers all flipped right is a quality change (exit 1); perplexities,
    aggregated over the corpus, are named and left out."""
    from deepinfer.harness.cli import main

    out, _ = lm_eval_outputs
    assert main(["audit", "metric-diff", str(out), str(out), "--resamples", "200"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("deepinfer_gen/exact_match,none: A 0.333 -> B 0.333 (delta +0.000, 95% CI [+0.000, +0.000], "
                          "n=3): unchanged")
    assert printed[-1] == ("not compared (not one number per sample): deepinfer_ppl/bits_per_byte,none, "
                           "deepinfer_ppl/byte_perplexity,none, deepinfer_ppl/word_perplexity,none")
    better = tmp_path / "better.json"
    record = json.loads((out / "lm_eval" / "batch-1.json").read_text())
    for sample in record["samples"]["deepinfer_gen"]:
        sample["exact_match"] = 1.0
    better.write_text(json.dumps(record))
    assert main(["audit", "metric-diff", str(out), str(better), "--resamples", "200"]) == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        "deepinfer_gen/exact_match,none: A 0.333 -> B 1.000 (delta +0.667, 95% CI [+0.333, +1.000], n=3): "
        "quality changed")
