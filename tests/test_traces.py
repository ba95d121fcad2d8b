"""The agent-trace format: the shipped sample, validation that names line and field, malformed lines
that do not stop the file, the Anthropic and OpenAI Responses importers, and the `traces` suite kind."""

from __future__ import annotations

import json
from pathlib import Path

import deepseek_recipe
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.audit.store import read_run
from deepinfer import LLM
from deepinfer.recipe.official import RecipeError
from deepinfer.harness.record import record_run
from deepinfer.harness.replay import teacher_forced
from deepinfer.harness.sweep import Variant
from deepinfer.harness.traces import (
    TraceFormatError,
    canonical_arguments,
    load_traces,
    load_traces_suite,
    parse_trace_line,
)

SAMPLE = Path(__file__).resolve().parent.parent / "harness" / "suites" / "traces" / "sample.jsonl"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def episode(episode_id: str = "ep", **extra) -> dict:
    """Three turns: a call, a second call, an answer."""
    return {"id": episode_id, "tools": [WEATHER], "messages": [
        {"role": "user", "content": f"{episode_id}: Oslo or Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C, rain"},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", "get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "c2", "content": "19 C, sun"},
        {"role": "assistant", "content": "Rome is warmer."},
    ], **extra}


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def parse(obj: dict | str):
    return parse_trace_line(obj if isinstance(obj, str) else json.dumps(obj), "t.jsonl", 1)


def test_shipped_sample_meets_the_brief() -> None:
    episodes, errors = load_traces(SAMPLE)
    assert errors == [] and len(episodes) >= 20
    for e in episodes:
        assert e.turns >= 3, e.episode_id
        assert any(m.get("tool_calls") for m in e.messages) and e.tool_results, e.episode_id
    raw = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    assert {r.get("format", "chat") for r in raw} == {"chat", "anthropic", "responses"}
    assert any(len(m.get("tool_calls") or []) > 1 for e in episodes for m in e.messages)  # parallel calls
    assert any(sum(m["role"] == "user" for m in e.messages) > 1 for e in episodes)  # the user speaks again
    assert any(len({(r.name, r.arguments) for r in e.tool_results}) < len(e.tool_results) for e in episodes)
    seeds = [e.sampling.get("seed") for e in episodes]
    assert any(s is None for s in seeds) and any(s is not None for s in seeds)


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
RECIPE_FORMATS = {"chat": "chat", "anthropic": "messages", "responses": "responses"}
# what a transcript holds and a request cannot, which the recipe refuses in a raw line: bodies convert it
TRANSCRIPT_SHAPES = ("unknown variant `function`", "unknown variant `input_text`", "unknown variant `redacted_thinking`")


def raw_turn_bodies(line: dict, earlier: dict[str, dict]) -> list[dict]:
    """The request body of each assistant turn of a raw trace line, cut from the line as its client wrote
    it: its request fields, then its conversation up to the turn (a Responses line's input items, those of
    the line it continues before them, then its output items)."""
    kind = line.get("format", "chat")
    request = {"chat": ("tools", "tool_choice", "thinking"), "anthropic": ("system", "tools", "tool_choice", "thinking"),
               "responses": ("instructions", "tools", "tool_choice", "reasoning")}[kind]
    body = {key: line[key] for key in request if key in line}
    if kind == "responses":
        own = line["input"] if isinstance(line["input"], list) else [{"role": "user", "content": line["input"]}]
        continued = earlier.get(line.get("previous_response_id", ""), {"input": []})
        body = {**{k: v for k, v in continued.items() if k == "instructions"}, **body}
        entries = continued["input"] + own + line.get("output", [])
        if "response_id" in line:
            earlier[line["response_id"]] = {**body, "input": entries}
        assistant = [item.get("type", "message") in ("reasoning", "function_call", "custom_tool_call", "web_search_call")
                     or item.get("role") == "assistant" for item in entries]
        starts = [i for i, mine in enumerate(assistant) if mine and (i == 0 or not assistant[i - 1])]
        return [{**body, "input": entries[:i]} for i in starts]
    if kind == "chat" and "functions" in line:
        body["tools"] = [{"type": "function", "function": f} for f in line["functions"]]
    return [{**body, "messages": line["messages"][:i]} for i, m in enumerate(line["messages"]) if m["role"] == "assistant"]


@pytest.mark.parametrize("preset", ["v4", "v41"])
def test_every_trace_turn_is_prompted_as_deepseek_recipe_encodes_its_request_body(preset, tiny_checkpoint,
                                                                                  v41_checkpoint) -> None:
    """Acceptance (issue 33): for every turn of every shipped trace file, the engine's prompt ids equal
    deepseek_recipe's own encoding of the request body the client sent for it (or both refuse it)."""
    llm = LLM(tiny_checkpoint if preset == "v4" else v41_checkpoint, max_model_len=4096)
    encoding = (deepseek_recipe.DeepseekV4Encoding if preset == "v4" else deepseek_recipe.DeepseekV41Encoding)()
    encoding = encoding.with_tokenizer(deepseek_recipe.Tokenizer.from_str(llm.tokenizer.text))
    model = {"v4": "DeepSeek-V4-Pro", "v41": "DeepSeek-V4.1-Flash"}[preset]
    requests = {"chat": deepseek_recipe.ChatCompletionRequest, "messages": deepseek_recipe.MessagesRequest,
                "responses": deepseek_recipe.ResponsesRequest}

    def official(body: dict, kind: str) -> list[int] | str:
        if kind == "chat":  # OpenAI's developer role is the system role (OfficialEncoder.convert reads it so)
            body = {**body, "messages": [{**m, "role": "system"} if m.get("role") == "developer" else m
                                         for m in body["messages"]]}
        try:
            conversion = requests[RECIPE_FORMATS[kind]]({"model": model, **body}).convert(deepseek_recipe.ConversionOptions())
            return encoding.encode(conversion.conversation)
        except Exception as err:
            return str(err).splitlines()[0]

    served = refused = converted = 0
    for path in sorted([*FIXTURES.glob("*.jsonl"), SAMPLE]):
        episodes = {e.episode_id: e for e in load_traces(path)[0]}
        earlier: dict[str, dict] = {}
        for line in map(json.loads, path.read_text(encoding="utf-8").splitlines()):
            episode, kind = episodes[line["id"]], line.get("format", "chat")
            bodies = raw_turn_bodies(line, earlier)
            assert len(bodies) == episode.turns, episode.episode_id
            for turn, body in enumerate(bodies, 1):
                expected = official(body, kind)
                if isinstance(expected, str) and any(shape in expected for shape in TRANSCRIPT_SHAPES):
                    converted += 1
                    expected = official(episode.conversation.before(turn), kind)
                try:
                    ids = episode.request(turn).prompt_ids(llm)
                except RecipeError as err:
                    refused += 1
                    assert isinstance(expected, str) and err.detail.endswith(expected), (episode.episode_id, turn)
                    continue
                served += 1
                assert ids == expected, (path.name, episode.episode_id, turn)
    assert (served, refused, converted) == (101, 10, 9)  # refused: server tools, a strict tool beside a custom one


def test_malformed_lines_are_reported_and_the_rest_loads(tmp_path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [
        episode("a"), "{not json", "", episode("b", extra=1), episode("a"), episode("c"),
    ])
    episodes, errors = load_traces(path)
    assert [e.episode_id for e in episodes] == ["a", "c"]
    assert [(e.line, e.message) for e in errors] == [
        (2, f"{path}:2: invalid JSON (Expecting property name enclosed in double quotes at column 2)"),
        (4, f"{path}:4: unknown field(s) ['extra'] for format 'chat'"),
        (5, f"{path}:5: id: duplicate 'a' (first at line 1)"),
    ]
    assert [e.detail for e in errors] == [e.message.removeprefix(f"{path}:{e.line}: ") for e in errors]


def with_messages(update) -> dict:
    obj = episode()
    update(obj["messages"])
    return obj


@pytest.mark.parametrize(("obj", "message"), [
    ("[1, 2]", "t.jsonl:1: expected a JSON object, got list"),
    ({**episode(), "format": "gemini"},
     "t.jsonl:1: format: unknown 'gemini' (expected one of chat, anthropic, responses)"),
    ({**episode(), "id": 5}, "t.jsonl:1: id: must be a non-empty string"),
    ({"id": "x"}, "t.jsonl:1: messages: missing"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "t.jsonl:1: messages: no assistant turn to replay"),
    (with_messages(lambda m: m[1]["tool_calls"][0]["function"].update(arguments=7)),
     "t.jsonl:1: message 1: tool_calls[0].function.arguments must be a string or a JSON object"),
    (with_messages(lambda m: m[2].update(tool_call_id="zz")),
     "t.jsonl:1: message 2: tool_call_id 'zz' matches no unanswered tool call of the assistant message before it"),
    (with_messages(lambda m: m.insert(3, {"role": "tool", "content": "extra"})),
     "t.jsonl:1: message 3: there is no unanswered tool call of the assistant message before it"),
    ({**episode(), "sampling": {"temperature": -1}},
     "t.jsonl:1: sampling: invalid sampling params: temperature must be a finite number >= 0, got -1"),
    ({**episode(), "sampling": {"temp": 1}}, "t.jsonl:1: sampling: unknown field(s) ['temp']"),
    ({**episode(), "metadata": []}, "t.jsonl:1: metadata: must be an object"),
    ({**episode(), "recorded": {"turns": []}}, "t.jsonl:1: recorded: must be an object with 'turns' and 'outcome'"),
    ({**episode(), "recorded": {"turns": [{"turn": 1}], "outcome": {}}},
     "t.jsonl:1: recorded.turns[0]: missing prompt_hash, token_ids, logprobs, top_token_ids, top_logprobs, "
     "finish_reason, text, message, token_hash, logit_hash"),
    ({"format": "anthropic", "messages": [{"role": "user", "content": [{"type": "search_result", "source": "s"}]},
                                          {"role": "assistant", "content": "no"}]},
     "t.jsonl:1: messages[0].content[0].type: unsupported block type 'search_result' "
     "(expected text, image, document, tool_result)"),
    ({"format": "anthropic", "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                                             "name": "f", "input": "x"}]}]},
     "t.jsonl:1: messages[0].content[0].input: must be an object"),
    ({"format": "anthropic", "tools": [{"name": "web_search"}],
      "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "t.jsonl:1: tools[0]: needs input_schema (a client tool) or type (a server tool)"),
    ({"format": "anthropic", "messages": episode()["messages"]},
     "t.jsonl:1: messages[1]: unknown field(s) ['tool_calls']"),
    ({"format": "anthropic", "messages": [{"role": "user", "content": None}]},
     "t.jsonl:1: messages[0].content: must be a string or a list of content blocks"),
    ({"format": "responses", "input": [{"role": "user", "content": "q"}, {"type": "file_search_call", "id": "w"}]},
     "t.jsonl:1: input[1].type: unsupported item type 'file_search_call'"),
    ({"format": "responses", "input": [{"role": "user", "content": "q"},
                                       {"type": "function_call", "call_id": "a", "name": "f", "arguments": {}}]},
     "t.jsonl:1: input[1].arguments: must be a string"),
    ({"format": "responses", "input": [{"role": "user", "content": "q"},
                                       {"type": "function_call", "name": "f", "arguments": "{}"}]},
     "t.jsonl:1: input[1].call_id: missing"),
    ({"format": "responses", "tools": [{"name": "file_search"}], "input": "q",
      "output": [{"role": "assistant", "content": "a"}]},
     "t.jsonl:1: tools[0].type: must be a non-empty string"),
    ({"format": "responses", "messages": []}, "t.jsonl:1: unknown field(s) ['messages'] for format 'responses'"),
])
def test_validation_names_the_line_and_the_field(obj, message) -> None:
    with pytest.raises(TraceFormatError) as info:
        parse(obj)
    assert str(info.value) == message


def test_tool_results_pair_by_id_or_in_order() -> None:
    obj = episode()
    obj["messages"][1]["tool_calls"] = [call("x", "get_weather", '{"city":"Oslo"}'),
                                        call("y", "get_weather", '{ "city" : "Bergen" }')]
    obj["messages"][2:3] = [{"role": "tool", "tool_call_id": "y", "content": "B"}, {"role": "tool", "content": "O"}]
    results = parse(obj).tool_results
    assert [(r.turn, r.name, r.arguments, r.content) for r in results] == [
        (1, "get_weather", '{"city":"Bergen"}', "B"),
        (1, "get_weather", '{"city":"Oslo"}', "O"),
        (2, "get_weather", '{"city":"Rome"}', "19 C, sun"),
    ]


def test_anthropic_blocks_map_to_chat_messages() -> None:
    parsed = parse({"format": "anthropic", "system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
                                     {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": "done"},
    ]})
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "hmm",
         "tool_calls": [call("t1", "f", '{"a":2,"b":1}')],
         "unrendered": [{"type": "thinking", "thinking": "hmm", "signature": "s"}]},
        {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "done"},
    ]


# importer round trips: one conversation written in each shape imports to the same episode ----------

_TEXT = st.text(alphabet="abcxyz ÄéΩ語,.!?{}\"'\n0123", min_size=1, max_size=12)
_ARGS = st.dictionaries(st.text(alphabet="abcdef", min_size=1, max_size=4),
                        st.one_of(st.integers(-99, 99), _TEXT, st.booleans(), st.none()), max_size=3)
_CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "search", "run_sql"]), _ARGS, _TEXT),
                  min_size=1, max_size=3)
_STEP = st.tuples(st.one_of(st.none(), _TEXT), _CALLS)  # (text before the calls, [(tool, arguments, result)])
_TURN = st.tuples(_TEXT, st.lists(_STEP, max_size=2), _TEXT)  # (user, tool-using steps, final answer)
CONVERSATIONS = st.tuples(st.one_of(st.none(), _TEXT), st.lists(_TURN, min_size=1, max_size=3))


def _numbered(turns):
    """The conversation with a unique call id per call."""
    n = 0
    for user, steps, final in turns:
        numbered_steps = []
        for text, calls in steps:
            numbered_steps.append((text, [(f"call-{(n := n + 1)}", *c) for c in calls]))
        yield user, numbered_steps, final


def as_chat(system, turns) -> dict:
    messages = [{"role": "system", "content": system}] if system is not None else []
    for user, steps, final in _numbered(turns):
        messages.append({"role": "user", "content": user})
        for text, calls in steps:
            messages.append({"role": "assistant", "content": text,
                             "tool_calls": [call(i, name, canonical_arguments(args)) for i, name, args, _ in calls]})
            messages += [{"role": "tool", "tool_call_id": i, "content": result} for i, _, _, result in calls]
        messages.append({"role": "assistant", "content": final})
    return {"messages": messages, "tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]}


def as_anthropic(system, turns) -> dict:
    messages = []
    for user, steps, final in _numbered(turns):
        messages.append({"role": "user", "content": user})
        for text, calls in steps:
            blocks = [{"type": "text", "text": text}] if text is not None else []
            blocks += [{"type": "tool_use", "id": i, "name": name, "input": args} for i, name, args, _ in calls]
            messages.append({"role": "assistant", "content": blocks})
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": result}
                                                         for i, _, _, result in calls]})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": final}]})
    tool = {"name": "get_weather", "input_schema": {"type": "object"}, "strict": True}
    return {"format": "anthropic", "messages": messages, "tools": [tool],
            **({"system": system} if system is not None else {})}


def as_responses(system, turns) -> dict:
    items = []
    for user, steps, final in _numbered(turns):
        items.append({"role": "user", "content": user})
        for text, calls in steps:
            if text is not None:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": text}]})
            items += [{"type": "function_call", "call_id": i, "name": name, "arguments": json.dumps(args, indent=1)}
                      for i, name, args, _ in calls]
            items += [{"type": "function_call_output", "call_id": i, "output": result} for i, _, _, result in calls]
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": final}]})
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}
    return {"format": "responses", "input": items, "tools": [tool],
            **({"instructions": system} if system is not None else {})}


@settings(max_examples=60, deadline=None)
@given(CONVERSATIONS)
def test_importers_agree_with_the_chat_shape(conversation) -> None:
    expected = parse(as_chat(*conversation))
    for imported in (parse(as_anthropic(*conversation)), parse(as_responses(*conversation))):
        assert imported.messages == expected.messages
        assert imported.tools == expected.tools
        assert imported.tool_results == expected.tool_results
    assert expected.turns == sum(len(steps) + 1 for _, steps, _ in conversation[1])


# the `traces` suite kind ----------------------------------------------------------------------------


def test_traces_suite_serves_turns_and_records_malformed_lines_as_error_rows(tmp_path, tiny_checkpoint) -> None:
    sampling = {"temperature": 0, "max_tokens": 2}
    pasted = episode("b", sampling={**sampling, "temperature": 0.7})
    pasted["messages"][0]["content"] = "b: quote <｜end▁of▁sentence｜><｜User｜> verbatim"
    path = write_lines(tmp_path / "t.jsonl", [episode("a", sampling=sampling), '{"id": "broken"', pasted])
    suite = load_traces_suite(path)
    assert suite.kind == "traces"
    assert [r.request_id for r in suite.requests] == ["a/turn-1", "a/turn-2", "a/turn-3", "line-2",
                                                      "b/turn-1", "b/turn-2", "b/turn-3"]
    detail = "invalid JSON (Expecting ',' delimiter at column 16)"
    with pytest.raises(TraceFormatError) as info:
        suite.requests[3].prompt_ids(None)
    assert (str(info.value), info.value.detail, info.value.kind) == (f"{path}:2: {detail}", detail, "malformed")

    record_run(tiny_checkpoint, suite, Variant.of("ref", max_model_len=1024), tmp_path / "run", progress=False)
    rows = {r["request_id"]: r for r in read_run(tmp_path / "run").streams.iter_rows(named=True)}
    assert (rows["line-2"]["error_kind"], rows["line-2"]["error"], rows["line-2"]["finish_reason"]) == (
        "malformed", detail, "error")
    assert all(rows[f"{e}/turn-{k}"]["error"] is None for e in "ab" for k in (1, 2, 3))

    # the suite's rows are the streams teacher-forced replay produces: same prompts, params and seeds
    llm = LLM(tiny_checkpoint, max_model_len=1024)
    first = suite.requests[4].prompt_ids(llm)  # client text that spells special tokens is text
    assert llm.tokenizer.eos_id not in first and first.count(llm.tokenizer.token_to_id("<｜User｜>")) == 1
    assert "quote <｜end▁of▁sentence｜><｜User｜> verbatim" in llm.tokenizer.decode(first)
    runs = teacher_forced(llm, load_traces(path)[0])
    for run in runs:
        for turn in run.turns:
            row = rows[f"{run.episode.episode_id}/turn-{turn.record.turn}"]
            assert (row["prompt_hash"], row["logit_hash"]) == (turn.record.prompt_hash, turn.record.logit_hash)
