"""Tests for `deepinfer lm-eval` (harness/lm_eval_cli.py): lm-eval's own command line, with the model
"deepinfer" registered, on a user's own task folder (tests/fixtures/lm_eval_tasks: one multiple-choice
and one generate_until task), run from an unrelated working directory. The metrics are identical at
batch sizes 1 and 8; lm-eval's batch_size/device settings and model_args are reconciled, and what
cannot be served is one `error:` line with exit 2.

Each CLI run spends 5-10 s indexing lm-eval's ~15k default tasks (its CLI always does, in one thread), so
only four runs go through it, all at once in the module's `runs` fixture; the other error cases call the
constructor lm-eval calls, with the settings its CLI passes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from deepinfer.harness.cli import main  # noqa: E402
from deepinfer.harness.lm_eval_model import DeepInferLM, EvalError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "fixtures" / "lm_eval_tasks"
AUTO = ("batch_size 'auto' is not supported: the engine batches requests itself; give a number "
        "(it is the engine's max_num_seqs)")
CLI_DEFAULTS = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}  # what lm-eval's CLI passes unasked


def lm_eval_cli(cwd: Path, *argv: str) -> tuple[int, str, str]:
    """`deepinfer lm-eval ARGV` in `cwd`, offline (one thread: the tiny model gains nothing from more):
    exit code, stdout, stderr."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "deepinfer.harness.cli", "lm-eval", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


def results(out: Path) -> dict:
    [path] = out.glob("*/results_*.json")
    return json.loads(path.read_text())


def responses(out: Path, task: str) -> list:
    [path] = out.glob(f"*/samples_{task}_*.jsonl")
    return [json.loads(line)["resps"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """The user's tasks at --batch_size 1, at 8 (also given in model_args), and at auto; and "shipped":
    the shipped tasks (no --include_path) with an unknown one. The four runs go at once (each spends most
    of its time indexing lm-eval's tasks in one thread)."""
    base = tmp_path_factory.mktemp("lm-eval-cli")
    tasks = shutil.copytree(TASKS, base / "my tasks")
    (base / "elsewhere").mkdir()
    common = ["--model", "deepinfer", "--tasks", "my_tasks", "--include_path", str(tasks), "--device", "cpu"]
    argv = {
        1: [*common, "--model_args", f"model={tiny_checkpoint}", "--batch_size", "1",
            "--output_path", str(base / "out1"), "--log_samples"],
        8: [*common, "--model_args", f"model={tiny_checkpoint},batch_size=8", "--batch_size", "8",
            "--output_path", str(base / "out8"), "--log_samples"],
        "auto": [*common, "--model_args", f"model={tiny_checkpoint}", "--batch_size", "auto"],
        "shipped": ["--model", "deepinfer", "--model_args", f"model={tiny_checkpoint}", "--tasks",
                    "deepinfer_mc,nosuch", "--limit", "2", "--device", "cpu"],
    }
    with ThreadPoolExecutor(len(argv)) as pool:
        done = pool.map(lambda args: lm_eval_cli(base / "elsewhere", *args), argv.values())
        return base, dict(zip(argv, done))


def test_user_tasks_have_identical_metrics_at_batch_sizes_1_and_8(runs):
    base, done = runs
    for size in (1, 8):
        code, stdout, stderr = done[size]
        assert code == 0, stderr[-2000:]
        assert "pets_mc" in stdout and "count_gen" in stdout  # lm-eval's results table
    one, eight = results(base / "out1"), results(base / "out8")
    assert set(one["results"]) == {"pets_mc", "count_gen"}
    assert {"acc,none", "exact_match,none"} <= set(one["results"]["pets_mc"]) | set(one["results"]["count_gen"])
    assert one["results"] == eight["results"]
    assert (one["config"]["engine_batch_size"], eight["config"]["engine_batch_size"]) == (1, 8)
    for task in ("pets_mc", "count_gen"):
        assert responses(base / "out1", task) == responses(base / "out8", task)


def test_batch_size_auto_is_one_error_line(runs):
    _, done = runs
    code, stdout, stderr = done["auto"]
    assert code == 2 and stdout == ""
    assert stderr.endswith(f"\nerror: {AUTO}\n") and "Traceback" not in stderr


@pytest.mark.parametrize(("model_args", "settings", "message"), [
    ({"batch_size": 8}, {}, "batch_size given twice: 8 in model_args, 1 from lm-eval (--batch_size, default 1); "
                            "give it once"),
    ({}, {"batch_size": "auto:4"}, AUTO.replace("'auto'", "'auto:4'")),
    ({}, {"batch_size": "eight"}, "batch_size must be a positive integer, got 'eight'"),
    ({}, {"max_batch_size": 64}, "max_batch_size only applies to batch_size auto, which deepinfer does not use: "
                                 "give batch_size N (the engine's max_num_seqs)"),
    ({"device": "cpu"}, {"device": "cuda:0"}, "device given twice: 'cpu' in model_args, 'cuda:0' from lm-eval "
                                              "(--device, default cuda:0); give it once"),
    ({"pretrained": "gpt2"}, {}, "unknown model_args pretrained (known: async_scheduling, batch_size, block_size, cache_qdq, "
                                 "context_parallel, cuda_graphs, data_parallel, device, draft_confidence, draft_tokens, "
                                 "dtype, enable_chunked_prefill, engram_tables, expert_capacity, expert_parallel, "
                                 "max_model_len, "
                                 "max_num_batched_tokens, model, num_cache_blocks, numerics, prefix_caching, run_dir, "
                                 "run_seed, speculation, suite, unseeded_seeds, verify_policy, weight_storage)"),
])
def test_settings_that_cannot_be_served(model_args, settings, message):
    with pytest.raises(EvalError, match=f"^{re.escape(message)}$"):
        DeepInferLM.create_from_arg_obj(model_args, {**CLI_DEFAULTS, "device": "cpu", **settings})


def test_lm_eval_settings_reach_the_engine(tiny_checkpoint):
    lm = DeepInferLM.create_from_arg_string(f"model={tiny_checkpoint},batch_size=4", {"batch_size": "4",
                                                                                       "device": "cpu"})
    assert lm.batch_size == 4 and lm.llm.device.type == "cpu"


def test_cuda_without_cuda_says_pass_device_cpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    message = ("device 'cuda:0' from lm-eval, but CUDA is not available here (lm-eval's CLI passes cuda:0 unless "
               "given --device): pass --device cpu")
    with pytest.raises(EvalError, match=f"^{re.escape(message)}$"):
        DeepInferLM.create_from_arg_obj({}, CLI_DEFAULTS)


def test_help_is_lm_evals_and_argv_is_restored(monkeypatch, capsys):
    monkeypatch.setattr("lm_eval.__main__.setup_logging", lambda: None)  # keep the session's logging as it is
    argv = list(sys.argv)
    with pytest.raises(SystemExit) as stop:
        main(["lm-eval", "--help"])
    assert stop.value.code == 0 and sys.argv == argv
    assert capsys.readouterr().out.startswith("usage: lm-eval ")


def test_missing_lm_eval_is_a_one_line_error(monkeypatch, capsys):
    prefixes = ("lm_eval.", "deepinfer.harness.lm_eval", "deepinfer.harness.eval")
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith(prefixes)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails as if it were not installed
    assert main(["lm-eval", "--model", "deepinfer", "--tasks", "my_tasks"]) == 2
    assert capsys.readouterr().err == ("error: deepinfer lm-eval needs lm-eval: pip install -e '.[eval]' in this project's "
                                         "checkout (or pip install 'lm-eval>=0.4.13')\n")


def test_the_shipped_tasks_are_found_and_an_unknown_task_is_one_line(runs):
    """Without an --include_path of the user's, `deepinfer lm-eval` includes the shipped offline tasks."""
    _, done = runs
    code, out, err = done["shipped"]
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == "error: lm-eval: Tasks not found: nosuch"
