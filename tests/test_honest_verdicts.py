"""Verdicts never hide errored requests, and errors compare by kind and detail, never by file path.

A trace suite where some lines are malformed and some episodes are too long for the engine is
certified end to end; the same suite read from another folder must reach the same roots, and a
cassette of it must verify from another folder.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest

from deepinfer.audit.store import read_run
from deepinfer.harness.cli import main

TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "Find an order by id",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
SAMPLING = {"temperature": 0, "max_tokens": 4}


def order_episode(episode_id: str, complaint: str) -> dict:
    return {"id": episode_id, "tools": TOOLS, "sampling": SAMPLING, "messages": [
        {"role": "system", "content": "You are the support agent of an online shop. Be brief."},
        {"role": "user", "content": complaint},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "lookup_order", "arguments": "{\"order_id\": \"W-1042\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"status\": \"shipped\", \"eta\": \"Friday\"}"},
        {"role": "assistant", "content": "Your order W-1042 has shipped and should arrive on Friday."},
    ]}


def trace_lines() -> list[str]:
    """4 servable episodes (2 turns each), 2 malformed lines, 1 episode whose prompts are too long."""
    long_complaint = "My parcel never arrived and I have been waiting for weeks. " * 200
    episodes = [order_episode(f"order-{i}", f"Where is my order W-1042? It is the {i}th time I ask.")
                for i in range(4)]
    lines = [json.dumps(e) for e in episodes[:2]]
    lines.append('{"id": "broken-json", "messages": [')
    lines.append(json.dumps({"id": "bad-role", "messages": [{"role": "robot", "content": "beep"},
                                                          {"role": "assistant", "content": "hi"}]}))
    lines.append(json.dumps(order_episode("too-long", long_complaint)))
    lines += [json.dumps(e) for e in episodes[2:]]
    return lines


SWEEP = {"reference": {"name": "ref", "max_num_seqs": 8, "max_model_len": 2048},
         "variants": [{"name": "batch-1", "max_num_seqs": 1}]}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("suite-a")
    path = folder / "episodes.jsonl"
    path.write_text("\n".join(trace_lines()) + "\n", encoding="utf-8")
    (folder / "sweep.json").write_text(json.dumps(SWEEP))
    return path


@pytest.fixture(scope="module")
def certified(traces, tiny_checkpoint, tmp_path_factory):
    """The certification, run here so that every test using it finds it made, whichever runs first:
    (argv, out folder, exit code, stdout, stderr)."""
    out = tmp_path_factory.mktemp("cert") / "out"
    argv = ["audit", "certify", "--model", str(tiny_checkpoint), "--suite", f"traces:{traces}",
            "--sweep", str(traces.parent / "sweep.json"), "--out", str(out), "--no-progress"]
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(argv)
    return argv, out, code, printed.getvalue(), errors.getvalue()


def test_certify_counts_errored_requests_in_the_verdict_and_fails_by_default(certified, capsys):
    argv, out, code, printed, errors = certified
    captured = SimpleNamespace(out=printed, err=errors)
    assert code == 1
    verdict = captured.out.splitlines()[0]
    # 4 episodes x 2 turns served; the too-long episode's 2 turns and 2 malformed lines errored
    assert verdict == ("verdict: BITWISE_REPRODUCIBLE over 8 of 12 requests; 4 errored identically in every variant "
                       "(2 malformed, 2 prompt too long); 1 variant vs reference ref: 0 request divergences, "
                       "0 logprob-only drifts")
    assert captured.err.startswith("FAIL: requests errored (4 of 12 in the reference, 0 differently in a variant)")
    cert = json.loads((out / "certificate.json").read_text())
    counts = cert["verdict_counts"]
    assert (counts["requests"], counts["served"], counts["errored"]) == (12, 8, 4)
    assert counts["errored_by_kind"] == {"malformed": 2, "prompt_too_long": 2}
    for configuration in cert["configurations"]:
        assert configuration["errors"] == {"malformed": 2, "prompt_too_long": 2}
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "over 8 of 12 requests" in report
    errored_section = report[report.index("## Errored requests"):]
    for request in ("line-3", "line-4", "too-long/turn-1", "too-long/turn-2"):
        assert f"| {request} " in errored_section, request

    assert main([*argv, "--resume", "--allow-errors"]) == 0  # the same runs, errors accepted
    assert capsys.readouterr().out.splitlines()[0] == verdict


def test_a_certification_that_served_nothing_says_so_and_fails_even_with_errors_allowed(traces, tiny_checkpoint,
                                                                                      tmp_path, capsys):
    suite = tmp_path / "all-bad.jsonl"
    suite.write_text("\n".join(trace_lines()[2:5]) + "\n", encoding="utf-8")  # 2 malformed lines, 1 too long
    out = tmp_path / "out"
    code = main(["audit", "certify", "--model", str(tiny_checkpoint), "--suite", f"traces:{suite}", "--sweep",
                 str(traces.parent / "sweep.json"), "--out", str(out), "--no-progress", "--allow-errors"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.splitlines()[0] == (
        "verdict: NO_REQUESTS_SERVED over 0 of 4 requests; 4 errored identically in every variant (2 malformed, "
        "2 prompt too long); 1 variant vs reference ref: 0 request divergences, 0 logprob-only drifts")
    cert = json.loads((out / "certificate.json").read_text())
    assert (cert["verdict"], cert["verdict_counts"]["served"]) == ("NO_REQUESTS_SERVED", 0)
    assert main(["audit", "verify", str(out / "certificate.json")]) == 0  # the certificate itself is intact
    assert "NO_REQUESTS_SERVED" in (out / "report.md").read_text(encoding="utf-8")


def test_error_rows_keep_kind_and_path_free_detail(certified, traces):
    out = certified[1]
    streams = read_run(out / "runs" / "ref").streams.filter(pl.col("finish_reason") == "error")
    rows = {r["request_id"]: (r["error_kind"], r["error"]) for r in streams.iter_rows(named=True)}
    assert set(rows) == {"line-3", "line-4", "too-long/turn-1", "too-long/turn-2"}
    assert rows["line-3"][0] == rows["line-4"][0] == "malformed"
    assert rows["too-long/turn-1"][0] == "prompt_too_long"
    assert rows["too-long/turn-1"][1].startswith("prompt has ") and "max_model_len is 2048" in rows["too-long/turn-1"][1]
    for _, detail in rows.values():
        assert str(traces.parent) not in detail and "episodes.jsonl" not in detail


def test_the_same_suite_from_another_folder_has_the_same_roots(certified, traces, tiny_checkpoint, tmp_path, capsys):
    out = certified[1]
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(traces, moved)
    code = main(["audit", "run", "--model", str(tiny_checkpoint), "--suite", f"traces:{moved}", "--out",
                 str(tmp_path / "run"), "--name", "ref", "--max-num-seqs", "8", "--max-model-len", "2048",
                 "--no-progress"])
    assert code == 0
    assert capsys.readouterr().out.startswith(
        f"run {tmp_path / 'run'}: 12 requests, 4 errored (2 malformed, 2 prompt too long), logit root ")
    assert read_run(tmp_path / "run").root == read_run(out / "runs" / "ref").root


def test_replay_verify_of_a_moved_cassette_exits_zero(traces, tiny_checkpoint, tmp_path, capsys):
    tape = tmp_path / "tape.jsonl"
    code = main(["audit", "replay", "record", "--traces", str(traces), "--out", str(tape), "--model",
                 str(tiny_checkpoint), "--max-model-len", "2048"])
    assert code == 1  # malformed lines are reported (and recorded); everything else replays
    recorded = capsys.readouterr().out
    assert "too-long: error at turn 1: prompt_too_long: prompt has " in recorded
    moved = tmp_path / "other" / "copy.jsonl"
    moved.parent.mkdir()
    shutil.copy(tape, moved)
    tape.unlink()
    assert main(["audit", "replay", "verify", str(moved)]) == 0
    verified = capsys.readouterr().out
    assert ("too-long: identical (0 turn(s) reproduced bit for bit, then refused again at turn 1: prompt_too_long: "
            in verified)
    assert "order-3: identical" in verified


def test_a_refused_later_turn_is_part_of_the_outcome_and_verifies_from_anywhere(tiny_checkpoint, tmp_path, capsys):
    """An episode whose tool returns a huge result: turn 1 replays, turn 2's prompt is too long."""
    episode = order_episode("huge-result", "Where is my order W-1042?")
    episode["messages"][3]["content"] = json.dumps({"status": "shipped", "events": ["scanned at hub"] * 400})
    traces, tape = tmp_path / "episodes.jsonl", tmp_path / "tape.jsonl"
    traces.write_text(json.dumps(episode) + "\n", encoding="utf-8")
    assert main(["audit", "replay", "record", "--traces", str(traces), "--out", str(tape), "--model",
                 str(tiny_checkpoint), "--max-model-len", "2048"]) == 0
    refusal = "turn 2 refused: prompt_too_long: prompt has "
    recorded = capsys.readouterr().out
    assert refusal in recorded
    assert "1 entries (teacher-forced): 1 diverged; 1 of them ended where the engine refused a turn's prompt" \
        in recorded
    moved = tmp_path / "elsewhere.jsonl"
    tape.rename(moved)
    assert main(["audit", "replay", "verify", str(moved)]) == 0
    verified = capsys.readouterr().out
    assert "identical (1 turn(s) reproduced bit for bit, then refused again at turn 2: prompt_too_long: " in verified
    assert "1 entries (teacher-forced): 1 identical; 1 of them ended where the engine refused a turn's prompt" \
        in verified


def test_nan_weights_become_counted_error_rows_while_the_other_requests_finish(capsys, tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "nan-weights"
    shutil.copytree(tiny_checkpoint, poisoned)
    tensors = load_file(poisoned / "model.safetensors")
    tensors["model.embed_tokens.weight"][45] = float("nan")  # only the request whose prompt holds token 45
    save_file(tensors, poisoned / "model.safetensors")
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"id": name, "prompt_token_ids": ids, "sampling": {"max_tokens": 4}}) + "\n"
                             for name, ids in (("clean", list(range(100, 110))), ("poisoned", list(range(40, 57))))))
    out = tmp_path / "run"
    assert main(["audit", "run", "--model", str(poisoned), "--suite", f"native:{suite}", "--out", str(out),
                 "--no-progress"]) == 0
    assert "2 requests, 1 errored (1 non finite logits)" in capsys.readouterr().out
    rows = {row["request_id"]: row for row in read_run(out).streams.to_dicts()}
    assert rows["clean"]["finish_reason"] == "length" and len(rows["clean"]["token_ids"]) == 4
    assert (rows["poisoned"]["finish_reason"], rows["poisoned"]["error_kind"], rows["poisoned"]["error"]) == (
        "error", "non_finite_logits", "non-finite logits at position 16")

    # generate writes every line, names the errored request on stderr and exits 1
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": ids, "sampling": {"max_tokens": 4}}) + "\n"
                               for ids in (list(range(100, 110)), list(range(40, 57)))))
    results = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(poisoned), "--prompts-file", str(prompts), "--out", str(results)]) == 1
    assert capsys.readouterr().err == f"error: {prompts}:2: non-finite logits at position 16\n"
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["finish_reason"] for line in lines] == ["length", "error"]
