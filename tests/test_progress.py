"""Progress of long commands when stderr is piped (as under pytest's capture): status lines from
deepinfer.progress, for `checkpoint create` and `audit replay record|verify`."""

from __future__ import annotations

import argparse
import json

import pytest

import deepinfer.progress
from deepinfer.audit.errors import AuditError
from deepinfer import cli as engine_cli
from deepinfer.checkpoint import expected_tensors, preset_config
from deepinfer.progress import Progress
from deepinfer.harness.replay_cli import add_replay_commands


@pytest.fixture
def every_update(monkeypatch):
    """A status line at every update (they are 10 s apart otherwise)."""
    monkeypatch.setattr(deepinfer.progress, "STATUS_SECONDS", 0.0)


def test_piped_progress_prints_a_status_line_when_due_and_a_done_line(capsys, every_update) -> None:
    with Progress("job", 3, unit="things") as bar:
        bar.update(2)
        bar.update(1)
    assert capsys.readouterr().err == "job: 2/3 things\njob: 3/3 things\njob: 3/3 things (done)\n"


def test_piped_progress_is_silent_when_short_disabled_or_stopped(capsys, monkeypatch) -> None:
    with Progress("short", 2) as bar:  # done before its first status line is due
        bar.update(2)
    with Progress("off", 2, enabled=False) as bar:
        monkeypatch.setattr(deepinfer.progress, "STATUS_SECONDS", 0.0)
        bar.update(2)
    assert capsys.readouterr().err == ""
    with pytest.raises(KeyboardInterrupt), Progress("stopped", 2) as bar:
        bar.update(1)
        raise KeyboardInterrupt
    assert capsys.readouterr().err == "stopped: 1/2 requests\n"  # no `(done)` after an error


def test_checkpoint_create_reports_tensors_when_piped(capsys, every_update, tmp_path) -> None:
    total = len(expected_tensors(preset_config("tiny"), True))
    assert engine_cli.main(["checkpoint", "create", "--preset", "tiny", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"checkpoint tiny: 1/{total} tensors"
    assert err[-2:] == [f"checkpoint tiny: {total}/{total} tensors", f"checkpoint tiny: {total}/{total} tensors (done)"]
    assert len(err) == total + 1
    assert engine_cli.main(["checkpoint", "create", "--preset", "tiny", "--out", str(tmp_path / "b"),
                            "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def replay_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    def add_audit(commands: argparse._SubParsersAction) -> None:
        add_replay_commands(commands.add_parser("audit").add_subparsers(required=True))

    code = engine_cli.main(argv, more_commands=(add_audit,), user_errors=(AuditError,))
    return code, capsys.readouterr().err.splitlines()


def test_replay_record_and_verify_report_turns_and_episodes_when_piped(capsys, every_update, tiny_checkpoint,
                                                                        tmp_path) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 3}
    episodes = [{"id": name, "sampling": greedy, "messages": [
        {"role": "user", "content": f"{name}?"}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Quite."}]} for name in ("a", "b")]
    traces = tmp_path / "t.jsonl"
    traces.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    model = ["--model", str(tiny_checkpoint)]

    code, err = replay_cli(["audit", "replay", "record", "--traces", str(traces), "--out", str(tmp_path / "tf"),
                            *model], capsys)
    assert code == 0 and counts(err, "replay teacher-forced", "turns", 4)
    code, err = replay_cli(["audit", "replay", "verify", str(tmp_path / "tf")], capsys)
    assert code == 0 and counts(err, "replay teacher-forced", "turns", 4)

    code, err = replay_cli(["audit", "replay", "record", "--traces", str(traces), "--out", str(tmp_path / "fr"),
                            "--mode", "free-running", *model], capsys)
    assert code == 0 and counts(err, "replay free-running", "episodes", 2)
    code, err = replay_cli(["audit", "replay", "verify", str(tmp_path / "fr")], capsys)
    assert code == 0 and counts(err, "replay free-running", "episodes", 2)


def counts(lines: list[str], label: str, unit: str, total: int) -> bool:
    """Status lines `label: k/total unit` (one per engine step here), k never going down, then `(done)`."""
    assert lines[-1] == f"{label}: {total}/{total} {unit} (done)"
    done = []
    for line in lines[:-1]:
        head, _, tail = line.rpartition(f"/{total} {unit}")
        assert head.startswith(f"{label}: ") and tail == "", line
        done.append(int(head.removeprefix(f"{label}: ")))
    assert len(done) >= 2 and done == sorted(done) and done[0] < total  # shown while the engine worked
    return True
