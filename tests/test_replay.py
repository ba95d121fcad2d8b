"""Agent-trace replay: both modes over the shipped sample, record -> verify, edits reported at the right
episode and turn, the free-running tool stub (matched, unrecorded and used-up calls), the cost of
replaying without a prefix cache, and the `deepinfer audit replay` commands.

The tiny checkpoint's random weights never write a well-formed tool call, so the paths where the model
calls tools run on `ScriptedEngine`, which answers each prompt with a scripted turn."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer.audit.errors import AuditError
from deepinfer.errors import DeepInferError
from deepinfer import LLM, RequestOutput
from deepinfer import cli as engine_cli
from deepinfer.engine.core import EngineCore
from deepinfer.parallel import ParallelLayout
from deepinfer.recipe.dsml import MARKER, TAGS
from deepinfer.recipe.official import Protocol
from deepinfer.recipe.tokenizer import ASSISTANT, TextTokenizer
from deepinfer.harness.cassette import AlteredCassette, read_cassette, record_cassette, sealed_lines, verify_cassette
from deepinfer.harness.replay import EpisodeRun, ToolStub, TurnRun, free_running, prefill_cost, teacher_forced
from deepinfer.harness.replay_cli import add_replay_commands
from deepinfer.harness.sweep import Variant
from deepinfer.harness.traces import RecordedTurn, ToolResult, load_traces

SAMPLE = Path(__file__).resolve().parent.parent / "harness" / "suites" / "traces" / "sample.jsonl"
VARIANT = Variant.of("replay", max_model_len=2048, max_num_seqs=32)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
GREEDY = {"temperature": 0, "max_tokens": 3}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(tiny_checkpoint, VARIANT.engine)


def call(call_id: str, arguments: str, name: str = "get_weather") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def episode(episode_id: str, *, sampling: dict = GREEDY, follow_up: bool = False) -> dict:
    """Oslo, then Rome, then an answer (and, with `follow_up`, a second question and answer)."""
    messages = [
        {"role": "user", "content": f"[{episode_id}] Oslo or Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C, rain"},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "c2", "content": "19 C, sun"},
        {"role": "assistant", "content": "Rome is warmer."},
    ]
    if follow_up:
        messages += [{"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Also Rome."}]
    return {"id": episode_id, "messages": messages, "tools": [WEATHER], "sampling": sampling}


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def edit_cassette(path: Path, edits: dict, *, reseal: bool = True) -> None:
    """Apply `edits[episode id](line)` to the cassette lines in place, resealed (an edit made on
    purpose, to see how verify compares it) unless `reseal` is False (tampering)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for text in lines[1:]:
        line = json.loads(text)
        edits.get(line["id"], lambda _: None)(line)
        out.append(json.dumps(line, ensure_ascii=False))
    out = sealed_lines(json.loads(lines[0]), out) if reseal else [lines[0], *out]
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def by_id(report) -> dict:
    return {r.episode_id: r for r in report.results}


# the shipped sample -------------------------------------------------------------------------------


def test_shipped_sample_replays_in_both_modes_and_verifies(llm, tmp_path) -> None:
    reports, cassettes = {}, {}
    for mode in ("teacher-forced", "free-running"):
        cassettes[mode] = tmp_path / f"{mode}.jsonl"
        reports[mode] = record_cassette(llm, SAMPLE, cassettes[mode], mode=mode, variant=VARIANT)
    episodes = load_traces(SAMPLE)[0]
    teacher, free = reports["teacher-forced"], reports["free-running"]
    assert [r.episode_id for r in teacher.results] == [e.episode_id for e in episodes]
    # random weights never regenerate the human-written turns; free-running ends after the model's answers
    assert {r.status for r in teacher.results} == {"diverged"} and {r.status for r in free.results} == {"completed"}
    recorded = {mode: {e.episode_id: e for e in read_cassette(path).episodes} for mode, path in cassettes.items()}
    for e in episodes:
        assert len(recorded["teacher-forced"][e.episode_id].recording.turns) == e.turns >= 3
        # both modes start from the same opening with the same params: turn 1 is the same stream
        first = [recorded[mode][e.episode_id].recording.turns[0] for mode in cassettes]
        assert first[0] == first[1]
    # teacher-forced prompts all extend each other: without a prefix cache most prefill is repeated
    assert teacher.prefill.prompt_tokens > 3 * teacher.prefill.unique_tokens

    verified = verify_cassette(llm, read_cassette(cassettes["free-running"]))
    assert {r.status for r in verified.results} == {"identical"} and len(verified.results) == len(episodes)
    # teacher-forced verification of a few episodes keeps the test short: the cassette cut after line 4, resealed
    lines = cassettes["teacher-forced"].read_text(encoding="utf-8").splitlines()
    write_lines(tmp_path / "head.jsonl", sealed_lines(json.loads(lines[0]), lines[1:4]))
    verified = verify_cassette(llm, read_cassette(tmp_path / "head.jsonl"))
    assert [r.describe() for r in verified.results] == [
        f"{e.episode_id}: identical ({e.turns} turn(s) reproduced bit for bit)" for e in episodes[:3]
    ]


def test_a_cassette_of_an_earlier_format_is_refused_in_one_line(llm, tmp_path) -> None:
    cassette = tmp_path / "c.jsonl"
    record_cassette(llm, write_lines(tmp_path / "t.jsonl", [episode("one")]), cassette, mode="free-running",
                    variant=VARIANT)
    lines = cassette.read_text(encoding="utf-8").splitlines()
    write_lines(cassette, [lines[0].replace('"deepinfer-cassette/3"', '"deepinfer-cassette/2"', 1), *lines[1:]])
    with pytest.raises(DeepInferError) as err:
        read_cassette(cassette)
    assert str(err.value) == (f"{cassette}:1: a deepinfer-cassette/2 cassette was prompted with the V3-era chat "
                              "template, not DeepSeek's official encoding: record it again with `deepinfer audit "
                              "replay record`")


def test_verify_refuses_a_cassette_recorded_with_another_tokenizer(llm, tmp_path) -> None:
    cassette = tmp_path / "c.jsonl"
    record_cassette(llm, write_lines(tmp_path / "t.jsonl", [episode("one")]), cassette, mode="free-running",
                    variant=VARIANT)
    lines = cassette.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    assert header["manifest"]["checkpoint"]["tokenizer"]["content_hash"] == llm.tokenizer.content_hash
    header["manifest"]["checkpoint"]["tokenizer"]["content_hash"] = "0" * 64
    write_lines(cassette, sealed_lines(header, lines[1:]))
    with pytest.raises(DeepInferError) as err:
        verify_cassette(llm, read_cassette(cassette))
    assert str(err.value) == (f"{cassette}: recorded with tokenizer {'0' * 64}, "
                              f"but the engine has {llm.tokenizer.content_hash}")


# record -> verify with edits ----------------------------------------------------------------------


def test_edits_are_reported_at_the_right_episode_and_turn(llm, tmp_path) -> None:
    traces = write_lines(tmp_path / "t.jsonl", [
        episode("untouched"), episode("tool-edit"), "{broken", episode("token-edit"), episode("text-edit"),
        episode("history-edit", sampling={"temperature": 0.9, "seed": 5, "max_tokens": 3}),
    ])
    cassette = tmp_path / "c.jsonl"
    recorded = record_cassette(llm, traces, cassette, mode="teacher-forced", variant=VARIANT)
    malformed = f"{traces}:3: invalid JSON (Expecting property name enclosed in double quotes at column 2)"
    assert [(r.episode_id, r.status) for r in recorded.results] == [
        ("untouched", "diverged"), ("tool-edit", "diverged"), ("line-3", "malformed"), ("token-edit", "diverged"),
        ("text-edit", "diverged"), ("history-edit", "diverged")]
    assert recorded.results[2].describe() == f"line-3: malformed: {malformed}"
    assert read_cassette(cassette).header["errors"] == [{"line": 3, "message": malformed}]
    assert {r.status for r in verify_cassette(llm, read_cassette(cassette)).results} == {"identical", "malformed"}

    token_turn = read_cassette(cassette).episodes[2].recording.turns[1]

    def change_token(line: dict) -> None:
        turn = line["recorded"]["turns"][1]
        turn["token_ids"][1] = (turn["token_ids"][1] + 1) % llm.config.vocab_size

    edit_cassette(cassette, {
        "tool-edit": lambda line: line["messages"][4].update(content="25 C, sun"),
        "token-edit": change_token,
        "text-edit": lambda line: line["recorded"]["turns"][0].update(text="edited"),
        "history-edit": lambda line: line["messages"][1]["tool_calls"][0]["function"].update(
            arguments='{"city": "Bergen"}'),
    })
    results = by_id(verify_cassette(llm, read_cassette(cassette)))
    prompt_differs = "its prompt (history, tool results, tools or sampling) differs from the recording"
    assert results["untouched"].describe() == "untouched: identical (3 turn(s) reproduced bit for bit)"
    assert results["tool-edit"].describe() == f"tool-edit: diverged at turn 3: {prompt_differs}"
    assert results["history-edit"].describe() == f"history-edit: diverged at turn 2: {prompt_differs}"
    assert results["text-edit"].describe() == \
        "text-edit: diverged at turn 1: the recorded text does not match the replay"
    assert results["line-3"].describe() == f"line-3: malformed: {malformed}"
    token = results["token-edit"]
    assert (token.status, token.turn, token.token) == ("diverged", 2, 1)
    top = token_turn.top_logprobs[1]
    assert token.margin == token.recorded_margin == top[0] - top[1]
    assert token.describe().startswith("token-edit: diverged at turn 2 token 1 (margin ")


def test_a_damaged_cassette_line_is_an_error_and_the_rest_verifies(llm, tmp_path) -> None:
    traces = write_lines(tmp_path / "t.jsonl", [episode("a"), episode("b")])
    cassette = tmp_path / "c.jsonl"
    record_cassette(llm, traces, cassette, mode="free-running", variant=VARIANT)
    lines = cassette.read_text(encoding="utf-8").splitlines()
    header, entries = json.loads(lines[0]), lines[1:]
    entries[0] = entries[0].replace('"turn": 1', '"turn": 2')
    write_lines(cassette, sealed_lines(header, entries))  # resealed: the line is checked as a recording
    results = verify_cassette(llm, read_cassette(cassette)).results
    assert [r.describe() for r in results] == [
        f"line-2: error: {cassette}:2: recorded.turns[0].turn: expected 1, got 2",
        "b: identical (1 turn(s) reproduced bit for bit)",
    ]


@pytest.fixture(scope="module")
def sealed(llm, tmp_path_factory) -> tuple[Path, list[str]]:
    """A free-running cassette of episodes a and b, and its lines."""
    folder = tmp_path_factory.mktemp("sealed")
    cassette = folder / "c.jsonl"
    record_cassette(llm, write_lines(folder / "t.jsonl", [episode("a"), episode("b")]), cassette,
                    mode="free-running", variant=VARIANT)
    return cassette, cassette.read_text(encoding="utf-8").splitlines()


def tampered(sealed, tmp_path: Path, lines: list[str], ending: str = "\n") -> Path:
    path = tmp_path / "tampered.jsonl"
    path.write_text("\n".join(lines) + ending, encoding="utf-8")
    return path


def test_a_byte_changed_in_a_recorded_message_is_reported_and_the_rest_verifies(llm, sealed, tmp_path) -> None:
    cassette, lines = sealed
    assert "Rome is warmer." in lines[1]
    path = tampered(sealed, tmp_path, [lines[0], lines[1].replace("Rome is warmer.", "Rome is warmes."), lines[2]])
    report = verify_cassette(llm, read_cassette(path))
    assert [r.describe() for r in report.results] == [
        f"line-2: altered: {path}:2: changed after recording (the seal does not match)",
        "b: identical (1 turn(s) reproduced bit for bit)",
    ]
    assert report.summary().splitlines()[0] == "2 entries (free-running): 1 identical, 1 altered"


@pytest.mark.parametrize("field, old, new", [("manifest", '"engine_version": "', '"engine_version": "9'),
                                             ("run_seed", '"run_seed": 0', '"run_seed": 1'),
                                             ("seal", '"algorithm": "sha256"', '"algorithm": "md5"')])
def test_a_changed_header_refuses_the_cassette(sealed, tmp_path, field, old, new) -> None:
    _, lines = sealed
    assert old in lines[0]
    path = tampered(sealed, tmp_path, [lines[0].replace(old, new, 1), *lines[1:]])  # the header's own field first
    expected = (f"{path}:1: seal: missing or malformed (the cassette cannot be checked for changes)" if field == "seal"
                else f"{path}:1: header {field} changed after recording (the seal does not match)")
    with pytest.raises(AlteredCassette) as caught:
        read_cassette(path)
    assert str(caught.value) == expected


def test_a_cut_off_or_extended_cassette_names_the_lines(llm, sealed, tmp_path) -> None:
    _, lines = sealed
    path = tampered(sealed, tmp_path, [lines[0], lines[1], lines[2][: len(lines[2]) // 2]], ending="")
    results = verify_cassette(llm, read_cassette(path)).results
    assert [r.describe() for r in results] == [
        "a: identical (1 turn(s) reproduced bit for bit)",
        f"line-3: altered: {path}:3: changed after recording (the seal does not match)",
    ]
    path = tampered(sealed, tmp_path, lines[:2])
    assert [r.describe() for r in verify_cassette(llm, read_cassette(path)).results] == [
        "a: identical (1 turn(s) reproduced bit for bit)",
        f"missing: altered: {path}: 1 of the 2 recorded episode line(s) missing after line 2 (cut off or removed)",
    ]
    path = tampered(sealed, tmp_path, [*lines, lines[1]])
    assert [r.describe() for r in verify_cassette(llm, read_cassette(path)).results] == [
        "a: identical (1 turn(s) reproduced bit for bit)",
        "b: identical (1 turn(s) reproduced bit for bit)",
        f"line-4: altered: {path}:4: added after recording (the seal has 2 episode lines)",
    ]


# free-running tool calls, on a scripted engine --------------------------------------------------


def tool_call(arguments: dict, name: str = "get_weather") -> str:
    """A thinking turn with no reasoning that calls `name`, in V4's DSML markup (string parameters)."""
    calls, invoke, parameter = TAGS["v4"]
    params = "".join(f'<{MARKER}{parameter} name="{key}" string="true">{value}</{MARKER}{parameter}>\n'
                     for key, value in arguments.items())
    return (f"</think>\n\n<{MARKER}{calls}>\n<{MARKER}{invoke} name=\"{name}\">\n{params}</{MARKER}{invoke}>\n"
            f"</{MARKER}{calls}>")


def answer(text: str) -> str:
    """A thinking turn with no reasoning that answers `text`."""
    return f"</think>{text}"


def called(turn: TurnRun) -> dict | None:
    """The function of the first tool call the recipe parsed from a recorded Chat Completions turn."""
    (message,) = turn.record.message["entries"]
    return message["tool_calls"][0]["function"] if message.get("tool_calls") else None


class ScriptedEngine:
    """Stands in for LLM: answers each prompt with the scripted turn of the episode whose key the prompt
    contains, picked by how many assistant turns the prompt holds; every token has logprob -0.5."""

    model_id = "scripted"
    config = SimpleNamespace(model_type="scripted")  # the model family a manifest records
    stored_formats: dict[str, str] = {}
    engine_config = VARIANT.engine  # what a cassette's header records of the engine
    max_model_len = VARIANT.engine.max_model_len
    max_num_batched_tokens = VARIANT.engine.max_num_batched_tokens
    cache = SimpleNamespace(num_blocks={})
    scheduler = SimpleNamespace(prefix=None, num_prefix_hit_tokens=0)  # no prefix cache to report on
    layout = ParallelLayout()  # one process
    expert_placements: list = []

    def __init__(self, tokenizer: TextTokenizer, script: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        protocol = Protocol("v4", tokenizer.text)
        # what EngineCore.tokenize reads, and the family's encoding a manifest's protocol records
        self.host = SimpleNamespace(tokenizer=tokenizer, family=SimpleNamespace(encoding="v4"),
                                    protocol=lambda: protocol)
        self.core = self  # LLM.submit queues through the engine core: this object plays both parts
        self.script = script
        self._queued: list[tuple[int, list[int], object]] = []
        self.next_id = 0

    tokenize = EngineCore.tokenize  # uses only the tokenizer and max_model_len

    def encode(self, ids: list[int]) -> list[int]:
        return list(ids)

    def check_params(self, params):
        return params

    def enqueue(self, prompt: list[int], params, request_id: int) -> int:
        self._queued.append((request_id, list(prompt), params))
        return request_id

    submit = LLM.submit  # checks and queues through encode, check_params and core.enqueue
    stream = LLM.stream  # the engine's own loop over step()

    def has_unfinished(self) -> bool:
        return bool(self._queued)

    def step(self) -> list[RequestOutput]:
        """Every queued request finishes in one step."""
        outputs = []
        for request_id, prompt, p in self._queued:
            text = self.tokenizer.decode(prompt)
            reply = self.script[next(k for k in self.script if k in text)][text.count(ASSISTANT) - 1]
            ids = [*self.tokenizer.encode(reply), self.tokenizer.eos_id]
            outputs.append(RequestOutput(request_id, prompt, ids, reply, "stop", p.seed, "batch_invariant",
                                         [-0.5] * len(ids), [[(t, -0.5), (t + 1, -1.5)] for t in ids]))
        self._queued = []
        return outputs


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> TextTokenizer:
    return TextTokenizer.from_folder(tiny_checkpoint)


def test_free_running_answers_recorded_calls_and_feeds_its_own_tokens_forward(tokenizer, tmp_path) -> None:
    traces = write_lines(tmp_path / "t.jsonl", [episode("w", follow_up=True)])
    engine = ScriptedEngine(tokenizer, {"[w]": [tool_call({"city": "Oslo"}), tool_call({"city": "Rome"}),
                                                answer("Rome."), answer("Rome again.")]})
    (run,) = free_running(engine, load_traces(traces)[0])
    assert run.ending.describe() == "w: completed (4 turn(s) and 2 tool call(s) answered; the trace has 4 turn(s))"
    assert [called(t) for t in run.turns] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                                              {"name": "get_weather", "arguments": '{"city": "Rome"}'}, None, None]
    protocol = engine.host.protocol()
    first = protocol.respond(protocol.request({"messages": episode("w")["messages"][:1], "tools": [WEATHER]}, "chat"),
                             "w/turn-1", run.turns[0].record.token_ids, "stop")["choices"][0]["message"]
    history = [episode("w")["messages"][0], {k: v for k, v in first.items()},
               {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "4 C, rain"}]
    for call in history[1]["tool_calls"]:
        call.pop("index")
    # the next prompt is the recipe's encoding of the conversation with the model's parsed turn and the answer
    assert run.turns[1].prompt_ids == protocol.request({"messages": history, "tools": [WEATHER]}, "chat").prompt_ids
    assert tokenizer.decode(run.turns[1].prompt_ids).endswith("<tool_result>4 C, rain</tool_result><｜Assistant｜><think>")
    assert tokenizer.decode(run.turns[3].prompt_ids).endswith("<｜User｜>And tomorrow?<｜Assistant｜><think>")


@pytest.mark.parametrize(("second_turn", "expected"), [
    (tool_call({"city": "Paris"}), 'w: diverged at turn 2 (unrecorded call get_weather {"city":"Paris"})'),
    (tool_call({"city": "Oslo"}),
     'w: diverged at turn 2 (unrecorded call get_weather {"city":"Oslo"}: its 1 recorded answer(s) were already used)'),
    (tool_call({}, name="get_time"), "w: diverged at turn 2 (unrecorded call get_time {})"),
])
def test_an_unrecorded_call_ends_the_episode(tokenizer, tmp_path, second_turn, expected) -> None:
    traces = write_lines(tmp_path / "t.jsonl", [episode("w")])
    engine = ScriptedEngine(tokenizer, {"[w]": [tool_call({"city": "Oslo"}), second_turn, answer("never reached")]})
    (run,) = free_running(engine, load_traces(traces)[0])
    assert run.ending.describe() == expected and len(run.turns) == 2


def test_tool_stub_matches_name_and_canonical_arguments_once_each_in_order() -> None:
    stub = ToolStub([ToolResult(1, "status", '{"id":1}', "pending"), ToolResult(2, "status", '{"id":1}', "done"),
                     ToolResult(2, "other", '{"id":1}', "x")])
    assert stub.answer("status", '{ "id": 1 }') == ("pending", "")
    assert stub.answer("status", {"id": 1}) == ("done", "")
    assert stub.answer("status", '{"id": 1}') == (
        None, 'unrecorded call status {"id":1}: its 2 recorded answer(s) were already used')
    assert stub.answer("status", '{"id": 2}') == (None, 'unrecorded call status {"id":2}')
    assert stub.answer("other", '{"id":1}') == ("x", "")


def test_scripted_record_verify_and_edits_in_free_running_mode(tokenizer, tmp_path) -> None:
    traces = write_lines(tmp_path / "t.jsonl", [episode("a"), episode("b"), episode("c")])
    script = [tool_call({"city": "Oslo"}), tool_call({"city": "Rome"}), answer("Rome is warmer.")]
    engine = ScriptedEngine(tokenizer, {f"[{k}]": script for k in "abc"})
    cassette = tmp_path / "c.jsonl"
    report = record_cassette(engine, traces, cassette, mode="free-running", variant=VARIANT)
    assert {r.status for r in report.results} == {"completed"}
    assert {r.status for r in verify_cassette(engine, read_cassette(cassette)).results} == {"identical"}

    edit_cassette(cassette, {
        "b": lambda line: line["messages"][2].update(content="5 C, rain"),  # the answer to turn 1's call
        "c": lambda line: line["messages"][3]["tool_calls"][0]["function"].update(arguments='{"city": "Roma"}'),
    })
    assert [r.describe() for r in verify_cassette(engine, read_cassette(cassette)).results] == [
        "a: identical (3 turn(s) reproduced bit for bit)",
        "b: diverged at turn 2: its prompt (history, tool results, tools or sampling) differs from the recording",
        'c: diverged at turn 2 (unrecorded call get_weather {"city":"Rome"})',
    ]


def test_teacher_forced_turns_that_match_the_trace_are_identical(tokenizer, tmp_path) -> None:
    traces = write_lines(tmp_path / "t.jsonl", [episode("same"), episode("other")])
    engine = ScriptedEngine(tokenizer, {
        "[same]": [tool_call({"city": "Oslo"}), tool_call({"city": "Rome"}), answer("Rome is warmer.")],
        "[other]": [tool_call({"city": "Oslo"}), tool_call({"city": "Rome"}), answer("Rome is cooler.")],
    })
    runs = teacher_forced(engine, load_traces(traces)[0])
    report = record_cassette(engine, traces, tmp_path / "c.jsonl", mode="teacher-forced", variant=VARIANT)
    assert [len(r.turns) for r in runs] == [3, 3]
    cooler, warmer = tokenizer.encode(" cooler")[0], tokenizer.encode(" warmer")[0]
    position = len(tokenizer.encode(answer("Rome is")))
    assert [r.describe() for r in report.results] == [
        "same: identical (3 turn(s) regenerated exactly as traced)",
        f"other: diverged at turn 3 token {position} (margin 1): generated token {cooler} "
        f"{tokenizer.decode([cooler])!r} where the trace has token {warmer} {tokenizer.decode([warmer])!r}",
    ]


# what replaying without a prefix cache costs -----------------------------------------------------


def test_prefill_cost_counts_distinct_prefixes_across_turns_and_episodes() -> None:
    def run(*prompts: list[int]) -> EpisodeRun:
        record = RecordedTurn(1, "0" * 64, [], [], [], [], "stop", "", {}, "0" * 64, "0" * 64)
        return EpisodeRun(None, "teacher-forced", [TurnRun(list(p), record) for p in prompts])

    cost = prefill_cost([run([0, 1, 2], [0, 1, 2, 3, 4]), run([0, 1, 5], [0, 1, 2])])
    assert (cost.prompt_tokens, cost.unique_tokens) == (14, 6)  # 0 1 2 3 4 and the branch 5
    assert cost.ratio == 14 / 6


# the command line ------------------------------------------------------------------------------


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`deepinfer audit replay ...` wired the way harness/cli.py wires the audit commands."""
    def add_audit(commands: argparse._SubParsersAction) -> None:
        audit = commands.add_parser("audit")
        add_replay_commands(audit.add_subparsers(required=True))

    code = engine_cli.main(argv, more_commands=(add_audit,), user_errors=(AuditError,))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_replay_commands_record_and_verify(tiny_checkpoint, tmp_path, capsys) -> None:
    traces = write_lines(tmp_path / "t.jsonl", [episode("a"), '{"id": 3}', episode("b")])
    cassette = tmp_path / "c.jsonl"
    code, out, err = run_cli(["audit", "replay", "record", "--traces", str(traces), "--out", str(cassette),
                              "--mode", "free-running", "--model", str(tiny_checkpoint), "--max-model-len", "1024"],
                             capsys)
    assert code == 1 and err == f"error: {traces}:2: id: must be a non-empty string\n"
    assert out.splitlines()[:2] == ["a: completed (1 turn(s) and 0 tool call(s) answered; the trace has 3 turn(s))",
                                    "b: completed (1 turn(s) and 0 tool call(s) answered; the trace has 3 turn(s))"]
    assert out.splitlines()[-1] == f"cassette: {cassette}"
    code, out, _ = run_cli(["audit", "replay", "record", "--traces", str(traces), "--out", str(tmp_path / "tf.jsonl"),
                            "--model", str(tiny_checkpoint), "--max-model-len", "1024"], capsys)
    assert code == 1 and out.splitlines()[-2] == (  # random weights never write the trace's turns
        "note: record compares the model's turns with the trace's own, which only the model that wrote the trace "
        "reproduces (a random-weight checkpoint never does); replay verify checks the cassette itself")

    code, out, err = run_cli(["audit", "replay", "verify", str(cassette)], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines()[:3] == [f"line-2: malformed: {traces}:2: id: must be a non-empty string",
                                    "a: identical (1 turn(s) reproduced bit for bit)",
                                    "b: identical (1 turn(s) reproduced bit for bit)"]
    assert out.splitlines()[3] == "3 entries (free-running): 2 identical, 1 malformed"

    def change_first_token(line: dict) -> None:
        ids = line["recorded"]["turns"][0]["token_ids"]
        ids[0] = (ids[0] + 1) % 1024

    edit_cassette(cassette, {"b": change_first_token})
    code, out, _ = run_cli(["audit", "replay", "verify", str(cassette)], capsys)
    assert code == 1 and out.splitlines()[2].startswith("b: diverged at turn 1 token 0 (margin ")

    edit_cassette(cassette, {"b": change_first_token}, reseal=False)  # tampering: the seal no longer matches
    code, out, _ = run_cli(["audit", "replay", "verify", str(cassette)], capsys)
    assert code == 1 and out.splitlines()[2] == f"line-3: altered: {cassette}:3: changed after recording (the seal does not match)"
    lines = cassette.read_text(encoding="utf-8").splitlines()
    cassette.write_text("\n".join([lines[0].replace('"mode": "free-running"', '"mode": "teacher-forced"', 1), *lines[1:]]) + "\n",
                        encoding="utf-8")
    code, out, err = run_cli(["audit", "replay", "verify", str(cassette)], capsys)
    assert (code, out, err) == (1, "", f"error: {cassette}:1: header mode changed after recording (the seal does not match)\n")

    code, _, err = run_cli(["audit", "replay", "record", "--traces", str(traces), "--out", str(cassette),
                            "--model", str(tiny_checkpoint)], capsys)
    assert (code, err) == (2, f"error: {cassette}: exists (a cassette is never overwritten)\n")
    code, _, err = run_cli(["audit", "replay", "verify", str(traces)], capsys)
    assert (code, err) == (2, f"error: {traces}:1: not a cassette (the first line must be a deepinfer-cassette/3 "
                              "header)\n")


def test_a_cassette_recorded_on_a_preset_verifies_from_another_folder(tmp_path, capsys, monkeypatch) -> None:
    """The cassette names a preset as `preset:NAME`, not as a path under the folder it was recorded in."""
    traces = write_lines(tmp_path / "t.jsonl", [episode("a")])
    cassette = tmp_path / "c.jsonl"
    code, out, _ = run_cli(["audit", "replay", "record", "--traces", str(traces), "--out", str(cassette),
                            "--mode", "free-running", "--model", "preset:tiny", "--max-model-len", "1024"], capsys)
    assert code == 0 and read_cassette(cassette).header["manifest"]["checkpoint"]["path"] == "preset:tiny"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run_cli(["audit", "replay", "verify", str(cassette)], capsys)
    assert (code, err) == (0, "") and out.splitlines()[0] == "a: identical (1 turn(s) reproduced bit for bit)"
