"""Tests for the lm-eval adapter (`harness.lm_eval_model.DeepInferLM`, model "deepinfer"), the shipped
offline tasks and `deepinfer audit eval`: scores equal the engine's own prompt logprobs, every request
lands in the run store, and metrics plus per-request stream hashes are identical at batch sizes 1/8/64,
for the shipped tasks and for a user's own task folder (`--include-path`).

Everything runs offline on the tiny checkpoint with a few documents per task.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from deepinfer.audit.errors import AuditError  # noqa: E402
from deepinfer.audit.files import folder_lock  # noqa: E402
from deepinfer.audit.store import check_run, read_run  # noqa: E402
from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer import cli as engine_cli  # noqa: E402
from deepinfer.harness.eval_cli import add_eval_command  # noqa: E402
from deepinfer.harness.evaluate import VERDICTS, parse_batch_sizes, suite_hash, task_manager  # noqa: E402
from deepinfer.harness.lm_eval_model import FORCED, DeepInferLM, EvalError  # noqa: E402

LIMIT = 4
USER_TASKS = Path(__file__).parent / "fixtures" / "lm_eval_tasks"
CONTEXT = "Question: What color is the sky?\nAnswer:"


def request(kind: str, args: tuple, doc_id: int = 0, idx: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx, metadata=("t", doc_id, 1))


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`deepinfer audit eval ...` with the audit group holding only the eval command."""
    def add_audit(commands: argparse._SubParsersAction) -> None:
        add_eval_command(commands.add_parser("audit").add_subparsers(required=True))

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = engine_cli.main(["audit", "eval", *argv], more_commands=(add_audit,), user_errors=(AuditError,))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def lm(tiny_checkpoint) -> DeepInferLM:
    return DeepInferLM(model=str(tiny_checkpoint), batch_size=4)


@pytest.fixture(scope="module")
def certified(tiny_checkpoint, tmp_path_factory):
    """The acceptance run: all shipped tasks at batch sizes 1/8/64."""
    out = tmp_path_factory.mktemp("eval") / "out"
    code, stdout, _ = run_cli("--tasks", "deepinfer", "--batch-sizes", "1,8,64", "--limit", str(LIMIT),
                              "--model", str(tiny_checkpoint), "--out", str(out))
    return code, stdout, out


# --------------------------------------------------------------------------------------- adapter


def test_registered_as_deepinfer_next_to_lm_evals_own_models():
    assert get_model("deepinfer") is DeepInferLM
    assert get_model("dummy").__name__ == "DummyLM"  # registering ours must not hide lm-eval's models


def test_loglikelihood_is_the_engines_teacher_forced_score(lm, tiny_checkpoint):
    context_ids = lm.text.with_bos(lm.tok_encode(CONTEXT))
    greedy = LLM(tiny_checkpoint).generate([context_ids], SamplingParams(temperature=0, max_tokens=3))[0]
    # the greedy continuation scores exactly what generating it reported
    [(score, is_greedy)] = lm._loglikelihood_tokens([(("", ""), context_ids, greedy.token_ids)])
    assert is_greedy and score == sum(greedy.logprobs)
    [(score, is_greedy)] = lm.loglikelihood([request("loglikelihood", (CONTEXT, " blue"))])
    scored = LLM(tiny_checkpoint).generate(
        [context_ids + lm.tok_encode(" blue")], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True))[0]
    tail = scored.prompt_top_logprobs[len(context_ids) - 1:]
    assert score == sum(scored.prompt_logprobs[len(context_ids) - 1:])
    assert is_greedy == all(top[0][0] == t for top, t in zip(tail, lm.tok_encode(" blue")))


def test_empty_context_conditions_on_bos(lm, tiny_checkpoint):
    [(score, _)] = lm.loglikelihood([request("loglikelihood", ("", "The sky"))])
    ids = [lm.prefix_token_id, *lm.tok_encode("The sky")]
    scored = LLM(tiny_checkpoint).generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True))[0]
    assert score == sum(scored.prompt_logprobs)


def test_rolling_loglikelihood_scores_every_token_once(lm, tiny_checkpoint):
    text = "Bright stars filled the sky above the quiet village."
    ids = lm.tok_encode(text)
    [total] = lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])
    scored = LLM(tiny_checkpoint).generate([[lm.prefix_token_id, *ids]],
                                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True))[0]
    assert total == sum(scored.prompt_logprobs)


def test_long_rolling_text_is_split_into_windows(tiny_checkpoint, tmp_path):
    short = DeepInferLM(model=str(tiny_checkpoint), batch_size=2, max_model_len=24, run_dir=tmp_path / "run")
    text = "Trains leave the station every twenty minutes during the morning rush, and the platform fills up fast."
    short.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])
    short.finalize()
    rows = read_run(tmp_path / "run").streams
    assert rows.height > 1 and rows["request_id"].to_list()[1] == "t/0/loglikelihood_rolling/0/w1"
    assert sum(rows["token_ids"].list.len()) == len(short.tok_encode(text))
    assert max(rows["prompt_token_ids"].list.len() + rows["token_ids"].list.len()) <= 23


def test_a_run_dir_is_locked_until_the_run_is_sealed(tiny_checkpoint, tmp_path):
    """A second writer of an lm-eval run folder is refused in one line, before its engine loads, and
    the first run stays intact; the folder is free again once the run is sealed."""
    run_dir = tmp_path / "run"
    busy = f"{run_dir}: another process is writing this folder; wait for it to end (or stop it)"
    first = DeepInferLM(model=str(tiny_checkpoint), batch_size=2, run_dir=run_dir)
    first.loglikelihood([request("loglikelihood", ("The cat", " sat"))])
    with pytest.raises(AuditError, match=f"^{re.escape(busy)}$"):
        DeepInferLM(model=str(tiny_checkpoint), batch_size=2, run_dir=run_dir)
    root = first.finalize()
    assert root["count"] == 1 and check_run(run_dir) == []
    with folder_lock(run_dir):  # released with the seal
        pass


def test_a_second_evaluation_of_a_folder_is_refused_and_touches_nothing(tmp_path):
    out = tmp_path / "out"
    (out / "runs" / "batch-1").mkdir(parents=True)
    (out / "runs" / "batch-1" / "manifest.json").write_text("{}")  # what the first evaluation has written
    with folder_lock(out):  # the first evaluation, still running
        code, stdout, err = run_cli("--tasks", "deepinfer_mc", "--out", str(out))
    assert (code, stdout, err) == (
        2, "", f"error: {out}: another process is writing this folder; wait for it to end (or stop it)\n")
    assert (out / "runs" / "batch-1" / "manifest.json").read_text() == "{}"


def test_generate_until_stops_before_the_stop_string(lm):
    free = lm.generate_until([request("generate_until", (CONTEXT, {"until": [], "max_gen_toks": 8}))])[0]
    stop = free[len(free) // 2]
    [text] = lm.generate_until([request("generate_until", (CONTEXT, {"until": [stop], "max_gen_toks": 8}), 1)])
    assert text == free[:free.index(stop)]


def test_unknown_generation_kwargs_are_named(lm):
    message = ("t/9/generate_until/0: unsupported generation kwargs beams (supported: do_sample, max_gen_toks, "
               "min_p, temperature, top_k, top_p, until)")
    with pytest.raises(EvalError, match=f"^{re.escape(message)}$"):
        lm.generate_until([request("generate_until", (CONTEXT, {"until": ["\n"], "beams": 2}), doc_id=9)])


def test_simple_evaluate_by_name_records_every_request(tiny_checkpoint, tmp_path):
    # lm-eval resolves "deepinfer" through its registry; a run folder receives one row per request
    results = lm_eval.simple_evaluate(
        model="deepinfer", model_args=f"model={tiny_checkpoint},batch_size=8,run_dir={tmp_path / 'run'}",
        tasks=["deepinfer_mc", "deepinfer_gen", "deepinfer_ppl"], task_manager=task_manager(), limit=2,
        bootstrap_iters=0)
    assert set(results["results"]) == {"deepinfer_mc", "deepinfer_gen", "deepinfer_ppl"}
    assert results["config"]["engine_batch_size"] == 8
    rows = {row["request_id"]: row for row in read_run(tmp_path / "run").streams.iter_rows(named=True)}
    assert len(rows) == 2 * 4 + 2 + 2  # 4 choices per question, one generation and one window per document
    choice = rows["deepinfer_mc/1/loglikelihood/3"]
    assert choice["finish_reason"] == FORCED and choice["prompt_token_ids"][0] == 0  # BOS
    assert json.loads(choice["params"])["request_type"] == "loglikelihood"
    assert json.loads(rows["deepinfer_gen/0/generate_until/0"]["params"])["stop"] == ["\n"]
    window = rows["deepinfer_ppl/0/loglikelihood_rolling/0/w0"]
    assert window["prompt_token_ids"] == [0] and window["finish_reason"] == FORCED
    assert check_run(tmp_path / "run") == []


# ------------------------------------------------------------------------------------ audit eval


def test_metrics_and_stream_hashes_identical_across_batch_sizes(certified):
    code, stdout, out = certified
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and "verdict: BITWISE_REPRODUCIBLE (batch_invariant, float32)" in stdout
    assert summary["verdict"] == "BITWISE_REPRODUCIBLE" and summary["format"] == "deepinfer-lm-eval/2"
    assert [run["name"] for run in summary["runs"]] == ["batch-1", "batch-8", "batch-64"]
    reference = summary["runs"][0]
    assert {run["logit_root"] for run in summary["runs"]} == {reference["logit_root"]}
    assert reference["count"] == LIMIT * 4 + LIMIT + LIMIT
    for comparison in summary["comparisons"]:
        assert comparison["streams"]["equal"] == reference["count"] and comparison["moved_requests"] == []
        assert comparison["metrics_identical"] and comparison["metric_differences"] == []
        assert comparison["verdict"] == "BITWISE_REPRODUCIBLE" and comparison["tokens_identical"]
        assert f"{comparison['name']} vs batch-1: BITWISE_REPRODUCIBLE, metrics identical; streams equal " in stdout
    metrics = reference["metrics"]
    assert {"acc,none", "acc_norm,none"} <= set(metrics["deepinfer_mc"])
    assert "exact_match,none" in metrics["deepinfer_gen"] and "word_perplexity,none" in metrics["deepinfer_ppl"]
    samples = json.loads((out / "lm_eval" / "batch-64.json").read_text())["samples"]
    assert len(samples["deepinfer_mc"]) == LIMIT
    for run in summary["runs"]:
        assert check_run(out / run["run"]) == []


def test_a_users_task_folder_next_to_the_shipped_tasks(tiny_checkpoint, tmp_path):
    """Also: eval takes every engine flag (generated from EngineConfig, as every command's are)."""
    tasks = ["pets_mc", "count_gen", "deepinfer_gen"]
    code, stdout, _ = run_cli("--include-path", str(USER_TASKS), "--tasks", ",".join(tasks), "--batch-sizes", "1,8",
                              "--limit", "2", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "out"),
                              "--max-num-batched-tokens", "24", "--no-prefix-caching")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert code == 0 and "verdict: BITWISE_REPRODUCIBLE (batch_invariant, float32)" in stdout
    assert summary["verdict"] == "BITWISE_REPRODUCIBLE" and set(summary["runs"][0]["metrics"]) == set(tasks)
    assert summary["runs"][0]["count"] == 2 * 3 + 2 + 2  # 3 choices per pet question, one generation per document
    manifest = read_run(tmp_path / "out" / "runs" / "batch-8").manifest
    assert (manifest["engine"]["max_num_batched_tokens"], manifest["engine"]["prefix_caching"]) == (24, False)
    assert (summary["engine"]["max_num_batched_tokens"], summary["engine"]["prefix_caching"]) == (24, False)
    assert manifest["suite"]["include_path"] == str(USER_TASKS.resolve())
    assert manifest["suite"]["content_hash"] == suite_hash(tasks, 2, USER_TASKS) != suite_hash(tasks, 2)


def test_fast_bf16_reports_whether_anything_moved(tiny_checkpoint, tmp_path):
    code, stdout, _ = run_cli("--tasks", "deepinfer_gen,deepinfer_mc", "--batch-sizes", "1,8", "--limit", "3",
                              "--numerics", "fast", "--dtype", "bf16", "--model", str(tiny_checkpoint),
                              "--out", str(tmp_path / "fast"))
    summary = json.loads((tmp_path / "fast" / "summary.json").read_text())
    [comparison] = summary["comparisons"]
    assert summary["engine"]["numerics"] == "fast" and summary["engine"]["dtype"] == "bf16"
    assert comparison["streams_identical"] == (comparison["moved_requests"] == [])
    assert summary["verdict"] == comparison["verdict"] in VERDICTS
    assert code == (0 if summary["verdict"] == "BITWISE_REPRODUCIBLE" else 1)
    assert f"verdict: {summary['verdict']} (fast, bf16)" in stdout


@pytest.mark.parametrize(
    "spec, message",
    [
        ("1,x", "--batch-sizes must be comma-separated positive integers, got '1,x'"),
        ("0,8", "--batch-sizes must be comma-separated positive integers, got '0,8'"),
        ("8", "--batch-sizes needs at least two sizes to compare, got '8'"),
        ("8,1,8", "--batch-sizes lists a size twice: '8,1,8'"),
    ],
)
def test_bad_batch_sizes(spec, message, tmp_path):
    with pytest.raises(EvalError, match=f"^{re.escape(message)}$"):
        parse_batch_sizes(spec)
    code, _, err = run_cli("--tasks", "deepinfer", "--batch-sizes", spec, "--out", str(tmp_path / "o"))
    assert code == 2 and err == f"error: {message}\n"


def test_unknown_task_and_used_output_folder(tiny_checkpoint, tmp_path):
    code, _, err = run_cli("--tasks", "deepinfer_mc,hellaswag", "--model", str(tiny_checkpoint),
                           "--out", str(tmp_path / "o"))
    assert code == 2
    assert err == ("error: unknown task 'hellaswag' (known: deepinfer, deepinfer_gen, deepinfer_mc, "
                   "deepinfer_ppl)\n")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    code, _, err = run_cli("--tasks", "deepinfer", "--out", str(tmp_path / "used"))
    assert code == 2 and err == f"error: {tmp_path / 'used'}: the output folder must be new or empty\n"


def test_unknown_task_names_the_users_tasks_too_and_a_missing_folder(tmp_path):
    code, _, err = run_cli("--include-path", str(USER_TASKS), "--tasks", "pets", "--out", str(tmp_path / "o"))
    assert code == 2
    assert err == ("error: unknown task 'pets' (known: count_gen, deepinfer, deepinfer_gen, deepinfer_mc, "
                   "deepinfer_ppl, my_tasks, pets_mc)\n")
    code, _, err = run_cli("--include-path", str(tmp_path / "nope"), "--tasks", "pets_mc", "--out", str(tmp_path / "o"))
    assert (code, err) == (2, f"error: include path {tmp_path / 'nope'}: no such folder\n")
    assert not (tmp_path / "o").exists()


def comparison(metrics: bool, statuses: dict) -> dict:
    """A comparison as `_compare` builds it, for a reference of 4 requests."""
    counts = {"equal": 0, "logprob_drift": 0, "diverged": 0, "missing": 0, "error": 0, **statuses}
    return {"metrics_identical": metrics, "streams_identical": counts["equal"] == 4,
            "tokens_identical": counts["equal"] + counts["logprob_drift"] == 4}


@pytest.mark.parametrize(("metrics", "statuses", "verdict"), [
    (True, {"equal": 4}, "BITWISE_REPRODUCIBLE"),
    (True, {"equal": 3, "logprob_drift": 1}, "TOKEN_REPRODUCIBLE"),  # certify's word for logprob-only drift
    (True, {"equal": 2, "logprob_drift": 1, "diverged": 1}, "METRICS_REPRODUCIBLE"),
    (True, {"equal": 3, "error": 1}, "METRICS_REPRODUCIBLE"),
    (False, {"equal": 4}, "DIVERGENT"),
    (False, {"diverged": 4}, "DIVERGENT"),
])
def test_eval_verdicts_are_certifys_words(metrics, statuses, verdict):
    from deepinfer.audit.certificate import NOTHING_SERVED
    from deepinfer.audit.certificate import VERDICTS as CERTIFY_VERDICTS
    from deepinfer.harness.evaluate import _comparison_verdict, _verdict

    assert _comparison_verdict(comparison(metrics, statuses)) == verdict
    # certify's grades of reproducibility (not its word for a certificate that served nothing)
    assert set(CERTIFY_VERDICTS) - {NOTHING_SERVED} < set(VERDICTS) and VERDICTS[-1] == "DIVERGENT"
    same = {"verdict": "BITWISE_REPRODUCIBLE"}
    assert _verdict([same, {"verdict": verdict}, same]) == verdict  # the worst comparison decides


@pytest.mark.parametrize(("flags", "message"), [
    (["--threads", "100000"], f"--threads must be between 1 and this machine's {os.cpu_count()} CPUs, got 100000"),
    (["--threads", "0"], f"--threads must be between 1 and this machine's {os.cpu_count()} CPUs, got 0"),
    (["--device", "tpu"], "unknown device 'tpu' (expected cpu, cuda or cuda:N)"),
])
def test_bad_engine_flags_write_nothing(tmp_path, flags, message):
    code, out, err = run_cli("--tasks", "deepinfer_mc", "--out", str(tmp_path / "o"), *flags)
    assert (code, out, err) == (2, "", f"error: {message}\n")
    assert not (tmp_path / "o").exists()


def test_out_naming_a_file(tmp_path):
    (tmp_path / "file").write_text("mine")
    code, out, err = run_cli("--tasks", "deepinfer_mc", "--out", str(tmp_path / "file"))
    assert (code, out, err) == (2, "", f"error: {tmp_path / 'file'}: exists and is not a folder\n")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_failed_start_leaves_out_reusable(tiny_checkpoint, tmp_path, monkeypatch):
    import deepinfer.harness.evaluate

    def broken_engine(**kwargs):
        (kwargs["run_dir"] / "parts").mkdir(parents=True)  # as if it failed after starting the run
        raise EvalError("the engine failed to start")

    argv = ["--tasks", "deepinfer_mc", "--batch-sizes", "1,2", "--limit", "1", "--model", str(tiny_checkpoint),
            "--threads", "1"]
    with monkeypatch.context() as patch:
        patch.setattr(deepinfer.harness.evaluate, "DeepInferLM", broken_engine)
        assert run_cli(*argv, "--out", str(tmp_path / "new")) == (2, "", "error: the engine failed to start\n")
        (tmp_path / "empty").mkdir()
        assert run_cli(*argv, "--out", str(tmp_path / "empty")) == (2, "", "error: the engine failed to start\n")
    assert not (tmp_path / "new").exists() and list((tmp_path / "empty").iterdir()) == []
    code, stdout, _ = run_cli(*argv, "--out", str(tmp_path / "empty"))  # the retry
    summary = json.loads((tmp_path / "empty" / "summary.json").read_text())
    assert code == 0 and summary["verdict"] == "BITWISE_REPRODUCIBLE" and summary["engine"]["threads"] == 1
