"""Tests for the `lm-eval:TASKS` suite kind: `deepinfer audit certify --suite lm-eval:...` serves every request
lm-eval would send, certifies it bitwise reproducible across batch sizes, and stores the same rows (ids,
tokens, logprobs, hashes) as `DeepInferLM` does for the same tasks; a user's task folder
(`?include_path=DIR`) joins the shipped tasks and its files are part of the content hash; errors are one line.

Everything runs offline on the tiny checkpoint with two documents per task."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from deepinfer.audit.store import check_run, read_run  # noqa: E402
from deepinfer.errors import DeepInferError  # noqa: E402
from deepinfer.harness.cli import main  # noqa: E402
from deepinfer.harness.evaluate import task_manager  # noqa: E402
from deepinfer.harness.lm_eval_model import FORCED, DeepInferLM  # noqa: E402
from deepinfer.harness.suite_registry import load_suite  # noqa: E402

SPEC = "lm-eval:deepinfer?limit=2"
SWEEP = {"reference": {"name": "ref", "max_num_seqs": 8}, "variants": [{"name": "batch-1", "max_num_seqs": 1}]}
TIMING = ("arrival_s", "first_token_s", "finish_s")
USER_TASKS = Path(__file__).parent / "fixtures" / "lm_eval_tasks"
MALFORMED = "expected ?include_path=DIR&limit=N (each at most once, N a positive integer) after the tasks, got"


def audit(capsys, *argv) -> tuple[int, str, str]:
    code = main(["audit", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def certified(tmp_path_factory, tiny_checkpoint):
    base = tmp_path_factory.mktemp("lm-eval-suite")
    (base / "sweep.json").write_text(json.dumps(SWEEP))
    code = main(["audit", "certify", "--model", str(tiny_checkpoint), "--suite", SPEC, "--sweep",
                 str(base / "sweep.json"), "--out", str(base / "out"), "--no-progress"])
    return code, base / "out"


def test_certify_an_lm_eval_suite_bitwise_reproducible(certified):
    code, out = certified
    cert = json.loads((out / "certificate.json").read_text())
    assert code == 0 and cert["verdict"] == "BITWISE_REPRODUCIBLE"
    assert cert["suite"]["kind"] == "lm-eval" and cert["suite"]["target"] == "deepinfer?limit=2"
    assert cert["suite"]["count"] == 2 * 4 + 2 + 2  # 4 choices per question, one generation and one window per text
    assert cert["rerun"]["suite"] == SPEC
    assert "12 requests form 3 tasks" in (out / "report.md").read_text() and (out / "report.html").exists()
    for name in ("ref", "batch-1"):
        assert check_run(out / "runs" / name) == []
    rows = {row["request_id"]: row for row in read_run(out / "runs" / "ref").streams.iter_rows(named=True)}
    choice = rows["deepinfer_mc/1/loglikelihood/3"]
    assert choice["finish_reason"] == FORCED and choice["prompt_token_ids"][0] == 0 and choice["token_ids"]
    assert len(choice["logprobs"]) == len(choice["token_ids"]) == len(choice["top_token_ids"])
    assert json.loads(choice["params"])["request_type"] == "loglikelihood"
    assert rows["deepinfer_ppl/0/loglikelihood_rolling/0/w0"]["prompt_token_ids"] == [0]
    assert json.loads(rows["deepinfer_gen/0/generate_until/0"]["params"])["stop"] == ["\n"]


def test_rows_equal_those_deepinferlm_writes(certified, tiny_checkpoint, tmp_path):
    _, out = certified
    lm = DeepInferLM(model=str(tiny_checkpoint), batch_size=8, max_model_len=1024, run_dir=tmp_path / "run")
    lm_eval.simple_evaluate(model=lm, tasks=["deepinfer"], task_manager=task_manager(), limit=2, bootstrap_iters=0)
    lm.finalize()
    suite_rows = read_run(out / "runs" / "ref").streams.drop(*TIMING)
    adapter_rows = read_run(tmp_path / "run").streams.drop(*TIMING)
    assert suite_rows.height == 12 and suite_rows.equals(adapter_rows)  # ids, order, tokens, logprob bits, hashes


def test_verify_rerun_reloads_the_suite_from_its_spec(capsys, certified):
    _, out = certified
    code, stdout, _ = audit(capsys, "verify", out / "certificate.json", "--rerun", "--no-progress")
    assert code == 0 and "reproduces bit for bit" in stdout


def test_a_text_longer_than_one_window_is_an_error_row(capsys, tiny_checkpoint, tmp_path):
    code, _, _ = audit(capsys, "run", "--model", tiny_checkpoint, "--suite", "lm-eval:deepinfer_ppl?limit=1",
                       "--max-model-len", "8", "--out", tmp_path / "run", "--no-progress")
    [row] = read_run(tmp_path / "run").streams.iter_rows(named=True)
    assert code == 0 and row["finish_reason"] == "error" and row["error_kind"] == "prompt_too_long"
    assert row["request_id"] == "deepinfer_ppl/0/loglikelihood_rolling/0/w0"
    assert row["error"].startswith("deepinfer_ppl/0/loglikelihood_rolling/0: the text needs ")
    assert row["error"].endswith(" rolling windows at max_model_len 8; an lm-eval suite scores one window per text: "
                                 "raise max_model_len")


def test_content_hash_covers_the_task_list_and_limit():
    one, same, more = (load_suite(f"lm-eval:{t}") for t in ("deepinfer_mc?limit=1", "deepinfer_mc?limit=1",
                                                              "deepinfer_mc?limit=2"))
    assert one.content_hash == same.content_hash != more.content_hash
    assert load_suite("lm-eval:deepinfer_gen?limit=1").content_hash != one.content_hash
    assert [r.request_id for r in one.requests] == [f"deepinfer_mc/0/loglikelihood/{i}" for i in range(4)]


def test_a_users_task_folder_joins_the_suite_and_its_hash(tmp_path, monkeypatch):
    tasks = shutil.copytree(USER_TASKS, tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)
    suite = load_suite("lm-eval:pets_mc,deepinfer_gen?include_path=tasks&limit=2")
    assert suite.target == f"pets_mc,deepinfer_gen?include_path={tasks}&limit=2"  # absolute, for reruns
    ids = [r.request_id for r in suite.requests]
    assert len(ids) == 2 * 3 + 2 and {"pets_mc/1/loglikelihood/2", "deepinfer_gen/1/generate_until/0"} <= set(ids)
    assert load_suite(f"lm-eval:{suite.target}").content_hash == suite.content_hash
    moved = shutil.copytree(tasks, tmp_path / "moved")
    assert load_suite(f"lm-eval:pets_mc,deepinfer_gen?limit=2&include_path={moved}").content_hash == suite.content_hash
    data = moved / "data" / "pets.jsonl"
    data.write_text(data.read_text().replace("meow", "purr"))
    assert load_suite(f"lm-eval:pets_mc,deepinfer_gen?include_path={moved}&limit=2").content_hash != suite.content_hash


@pytest.mark.parametrize(("spec", "message"), [
    ("lm-eval:deepinfer_mc,hellaswag",
     "unknown task 'hellaswag' (known: deepinfer, deepinfer_gen, deepinfer_mc, deepinfer_ppl)"),
    (f"lm-eval:pets_mc,hellaswag?include_path={USER_TASKS}",
     "unknown task 'hellaswag' (known: count_gen, deepinfer, deepinfer_gen, deepinfer_mc, deepinfer_ppl, my_tasks, "
     "pets_mc)"),
    ("lm-eval:pets_mc?include_path=/no/such/tasks", "include path /no/such/tasks: no such folder"),
    ("lm-eval:", "suite 'lm-eval:' names no task (e.g. lm-eval:deepinfer)"),
    ("lm-eval:deepinfer?limit=0",
     "suite 'lm-eval:deepinfer?limit=0': expected ?limit=N with N a positive integer after the tasks"),
    ("lm-eval:deepinfer?limit=1&limit=2", f"suite 'lm-eval:deepinfer?limit=1&limit=2': {MALFORMED} 'limit=2'"),
    ("lm-eval:deepinfer?include_path=", f"suite 'lm-eval:deepinfer?include_path=': {MALFORMED} 'include_path='"),
    ("lm-eval:deepinfer?limit=1&", f"suite 'lm-eval:deepinfer?limit=1&': {MALFORMED} ''"),
    ("lm-eval:deepinfer?size=3", f"suite 'lm-eval:deepinfer?size=3': {MALFORMED} 'size=3'"),
])
def test_bad_lm_eval_suite_specs(capsys, tiny_checkpoint, tmp_path, spec, message):
    code, out, err = audit(capsys, "run", "--model", tiny_checkpoint, "--suite", spec, "--out", tmp_path / "run")
    assert (code, out, err) == (2, "", f"error: {message}\n")
    assert not (tmp_path / "run").exists()


BROKEN_YAML = "task: my_broken\ndataset_path: json\noutput_type: [generate_until\n"
YAML_PROBLEM = "my_broken.yaml:4: not valid YAML (expected ',' or ']', but got '<stream end>')"


def test_a_task_whose_yaml_does_not_parse_is_named_with_the_yaml_error(capsys, tiny_checkpoint, tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(USER_TASKS, tasks)
    (tasks / "my_broken.yaml").write_text(BROKEN_YAML)
    code, out, err = audit(capsys, "run", "--model", tiny_checkpoint, "--suite", f"lm-eval:my_broken?include_path={tasks}",
                           "--out", tmp_path / "run")
    assert (code, out) == (2, "")
    assert err == ("error: unknown task 'my_broken' (known: count_gen, deepinfer, deepinfer_gen, deepinfer_mc, "
                   f"deepinfer_ppl, my_tasks, pets_mc); lm-eval skipped {tasks / YAML_PROBLEM}\n")
    code = main(["lm-eval", "--model", "deepinfer", "--tasks", "my_broken", "--include_path", str(tasks)])
    err = capsys.readouterr().err
    assert (code, err.splitlines()[-1]) == (2, f"error: lm-eval: Tasks not found: my_broken; lm-eval skipped "
                                               f"{tasks / YAML_PROBLEM}")


def test_missing_lm_eval_is_a_one_line_error(monkeypatch):
    prefixes = ("lm_eval.", "deepinfer.harness.lm_eval", "deepinfer.harness.eval")
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith(prefixes)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails as if it were not installed
    with pytest.raises(DeepInferError) as raised:
        load_suite("lm-eval:deepinfer")
    assert str(raised.value) == ("an lm-eval suite needs lm-eval: pip install -e '.[eval]' in this project's checkout "
                                 "(or pip install 'lm-eval>=0.4.13')")
