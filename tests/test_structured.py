"""Structured outputs: every output of the shipped battery is valid on a random-weight model (the
mask alone carries validity), greedy and sampled; a constraint that does not compile fails its request
at submission in one line while the rest of the suite runs; the matchers' probes leave them as they
were. Bitwise invariance with constrained and free rows mixed (batching, speculation) is the
invariance matrix's job: its standard request set is part structured (`tests/test_invariance.py`)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from deepinfer.audit.store import read_run
from deepinfer import LLM, SamplingParams
from deepinfer.harness.cli import main
from deepinfer.engine import structured
from deepinfer.engine.structured import StructuredCompiler, StructuredError, allowed_tokens, mask_words, step_masks
from deepinfer.errors import DeepInferError
from deepinfer.sampling_params import SamplingParamsError
from deepinfer.audit.structured_check import violation

BATTERY = [json.loads(line) for line in
           (Path(__file__).parent / "fixtures" / "structured" / "battery.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("preset:tiny", max_model_len=1024)  # the official tools block is ~600 tokens of the tiny BPE


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_battery_output_is_valid(llm, temperature):
    params = [SamplingParams(temperature=temperature, max_tokens=entry["max_tokens"], seed=i,
                             structured=entry["structured"]) for i, entry in enumerate(BATTERY)]
    outputs = llm.generate(["Answer in the requested format:"] * len(params), params)
    failures = {entry["id"]: (output.finish_reason, output.text, violation(entry["structured"], output.text))
                for entry, output in zip(BATTERY, outputs)
                if output.finish_reason != "stop" or violation(entry["structured"], output.text) is not None}
    assert not failures
    assert len({output.text for output in outputs}) > len(BATTERY) // 2  # the model, not the mask, picks


def nested(levels: int) -> dict:
    """A schema of `levels` objects, each the only property of the one around it (2 JSON levels each)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def test_the_schema_true_accepts_any_json_value_and_a_deep_one_compiles(llm):
    outputs = llm.generate(["Answer:"] * 2, [SamplingParams(max_tokens=40, structured={"json_schema": True}),
                                             SamplingParams(max_tokens=120, structured={"json_schema": nested(45)})])
    for output in outputs:
        if output.finish_reason == "stop":
            json.loads(output.text)
    assert outputs[0].finish_reason in ("stop", "length") and outputs[0].text


def test_a_regex_whose_dfa_explodes_compiles_lazily_within_the_limits(llm):
    """(a|b)*a(a|b){24} has 2^25 DFA states: outlines-core's build is stopped at its time or memory limit
    and llguidance's lazy lexer serves it; the output still matches."""
    started = time.monotonic()
    output = llm.generate(["Answer:"], [SamplingParams(max_tokens=40, structured={"regex": "(a|b)*a(a|b){24}"})])[0]
    assert time.monotonic() - started < structured.COMPILE_SECONDS + 5
    assert re.fullmatch("[ab]*", output.text) and (output.finish_reason == "length" or
                                                    re.fullmatch("(a|b)*a(a|b){24}", output.text))


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "[a-"}, "invalid regex: unclosed character class"),
    ({"json_schema": {"type": "foo"}}, "invalid JSON schema: Invalid type: foo"),
    ({"grammar": "start: foo", "syntax": "lark"}, 'invalid grammar: at 1(8): unknown name: "foo"'),
    ({"grammar": "root ::= foo", "syntax": "ebnf"}, "invalid EBNF grammar: "),
    ({"json_schema": False}, "invalid JSON schema: false accepts no value"),
    ({"regex": "[^\\x00-\\U0010FFFF]"}, "invalid regex: no output satisfies it"),  # an empty character class
    ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "invalid JSON schema: no output satisfies it"),
    ({"json_schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(70000)}}},
     "invalid JSON schema: schema too large"),
])
def test_a_constraint_that_does_not_compile_fails_at_submission_in_one_line(llm, constraint, message):
    with pytest.raises(StructuredError) as raised:
        llm.add_request("hi", SamplingParams(structured=constraint))
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    assert not llm.has_unfinished()


@pytest.mark.parametrize("constraint, message", [
    ("[0-9]+", "structured must be an object or 'tool_call', got str"),
    ({}, "structured needs exactly one of regex, json_schema, choice, grammar, got none"),
    ({"regex": "a", "choice": ["a"]}, "structured needs exactly one of regex, json_schema, choice, grammar, "
                                      "got ['choice', 'regex']"),
    ({"grammar": "start: \"a\""}, "structured grammar needs syntax lark or ebnf, got None"),
    ({"regex": "a", "syntax": "lark"}, "structured has unknown keys ['syntax'] for a regex constraint"),
    ({"choice": []}, "structured choice must be a non-empty list of non-empty strings"),
    ({"json_schema": "{oops"}, "structured json_schema is not valid JSON: Expecting property name enclosed in "
                               "double quotes: line 1 column 2 (char 1)"),
    ({"json_schema": nested(60)}, "structured json_schema nested more than 100 levels deep"),
    ({"json_schema": '{"properties": {"x": ' * 5000 + "{}" + "}}" * 5000},  # past Python's own JSON parser
     "structured json_schema nested more than 100 levels deep"),
])
def test_a_malformed_constraint_is_refused_by_the_params(constraint, message):
    with pytest.raises(SamplingParamsError, match=f"^{re.escape('invalid sampling params: ' + message)}$"):
        SamplingParams(structured=constraint)


def test_a_suite_with_a_bad_constraint_runs_the_others_and_counts_it(tiny_checkpoint, tmp_path, capsys):
    suite = tmp_path / "suite.jsonl"
    rows = [("date", {"regex": "[0-9]{4}-[0-9]{2}"}), ("broken", {"regex": "(unclosed"}),
            ("answer", {"choice": ["yes", "no"]})]
    suite.write_text("".join(json.dumps({"id": name, "prompt": "Reply:", "sampling": {"max_tokens": 12,
                                                                                        "structured": constraint}}) + "\n"
                             for name, constraint in rows))
    out = tmp_path / "run"
    assert main(["audit", "run", "--model", str(tiny_checkpoint), "--suite", f"native:{suite}", "--out", str(out),
                 "--no-progress"]) == 0
    assert "3 requests, 1 errored (1 invalid request)" in capsys.readouterr().out
    got = {row["request_id"]: row for row in read_run(out).streams.to_dicts()}
    assert (got["broken"]["error_kind"], got["broken"]["error"]) == ("invalid_request", "invalid regex: unclosed group")
    assert violation(rows[0][1], got["date"]["text"]) is None and got["answer"]["text"] in ("yes", "no")


def test_a_constraint_compiles_once_per_tokenizer(llm, monkeypatch):
    calls = []
    compile_uncached = structured._compile_uncached
    monkeypatch.setattr(structured, "_compile_uncached", lambda *args: calls.append(1) or compile_uncached(*args))
    constraint = {"json_schema": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}}
    as_text = {"json_schema": json.dumps(constraint["json_schema"])}
    other = llm.with_engine(llm.engine_config)
    for engine, given in ((llm, constraint), (other, as_text), (llm, constraint)):
        engine.check_params(SamplingParams(structured=given))
    assert len(calls) == 1


def test_probing_a_row_mask_leaves_the_matcher_where_it_was(llm):
    """A step's masks take each matcher past its pending token and drafts and back: the next mask,
    and which tokens it allows, are as before."""
    compiler = StructuredCompiler(llm.tokenizer)
    for constraint in ({"regex": "[a-c]{2}[0-9]{1,2}"}, {"grammar": 'start: "ab" NUM\nNUM: /[0-9]{1,2}/', "syntax": "lark"}):
        matcher = compiler.matcher(constraint)
        tokens = llm.tokenize("ab1")
        before = step_masks([(matcher, [], [])], llm.config.vocab_size)
        masks = step_masks([(matcher, tokens[:1], tokens[1:]), (None, [], [5])], llm.config.vocab_size)
        assert torch.equal(step_masks([(matcher, [], [])], llm.config.vocab_size), before)
        allowed = allowed_tokens(masks, llm.config.vocab_size)
        assert allowed.shape == (len(tokens) + 2, llm.config.vocab_size) and allowed[-2:].all()
        for row, token in enumerate(tokens[1:]):
            assert allowed[row, token]
        assert allowed[len(tokens) - 1, llm.tokenizer.eos_id]  # "ab1" may end here (or take a digit)
        assert not allowed[0, llm.tokenizer.eos_id]
        assert matcher.allows(tokens + [llm.tokenizer.eos_id, tokens[0]]) == len(tokens) + 1
        assert masks.shape[1] == mask_words(llm.config.vocab_size)



def test_an_id_past_the_tokenizer_is_refused_and_the_matcher_stays_usable(llm):
    """A model's vocabulary may be larger than its tokenizer's (the flash presets' is): a drafter can
    propose an id that spells nothing. Every constraint refuses it, and llguidance is not left stopped
    in error by it (which would end the row's output early when speculating, and not without)."""
    compiler = StructuredCompiler(llm.tokenizer)
    for constraint in ({"regex": "[a-c]{2}[0-9]{1,2}"}, {"grammar": 'start: "ab" NUM\nNUM: /[0-9]{1,2}/', "syntax": "lark"}):
        matcher = compiler.matcher(constraint)
        tokens = llm.tokenize("ab1")
        before = step_masks([(matcher, [], [])], llm.config.vocab_size)
        for outside in (llm.tokenizer.vocab_size, llm.tokenizer.vocab_size + 100, -1):
            assert matcher.allows([outside]) == 0 and not matcher.advance(outside)
            assert matcher.allows(tokens[:1] + [outside]) == 1
        assert torch.equal(step_masks([(matcher, [], [])], llm.config.vocab_size), before)
        assert matcher.allows(tokens + [llm.tokenizer.eos_id]) == len(tokens) + 1

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "search_notes", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["query"],
        "properties": {"query": {"type": "string", "maxLength": 20}, "limit": {"enum": [1, 5, 10]}}}}},
]
ASK = [{"role": "system", "content": "You are a harbour assistant."},
       {"role": "user", "content": "What is the weather in Porto for the next three days?"}]


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "search_notes"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ({"type": "function", "function": {"name": "search_notes"}}, {"search_notes"}),
])
def test_a_tool_call_turn_calls_allowed_tools_with_valid_arguments(llm, tool_choice, names):
    params = [SamplingParams(temperature=t, seed=s, max_tokens=400, structured="tool_call")
              for t, s in ((0.0, 0), (0.8, 1), (1.0, 2), (1.0, 3))]
    outputs = llm.chat([ASK] * len(params), params, tools=TOOLS, tool_choice=tool_choice)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for output in outputs:
        calls = output.message["tool_calls"]
        assert output.finish_reason == "stop" and calls and not output.message["content"]
        for call in calls:
            assert call["function"]["name"] in names
            arguments = json.loads(call["function"]["arguments"])
            assert violation({"json_schema": schemas[call["function"]["name"]]}, json.dumps(arguments)) is None


FORCING = "structured='tool_call' needs tools and a tool_choice that forces a call ('required' or a named function)"


@pytest.mark.parametrize("tool_choice, tools, message", [
    ("auto", TOOLS, FORCING),
    (None, TOOLS, FORCING),
    ({"type": "function", "function": {"name": "launch"}}, TOOLS,
     "conversation 0: not a chat request the recipe accepts: Invalid value for 'tool_call': no function named "
     "'launch' was specified in the 'tools' parameter."),
    ("required", None, FORCING),
])
def test_a_tool_call_constraint_needs_tools_and_a_choice_that_forces_a_call(llm, tool_choice, tools, message):
    with pytest.raises(DeepInferError, match=f"^{re.escape(message)}$"):
        llm.chat([ASK], SamplingParams(structured="tool_call"), tools=tools, tool_choice=tool_choice)
    with pytest.raises(DeepInferError, match=re.escape("structured='tool_call' is made from a conversation's tools")):
        llm.generate(["hi"], SamplingParams(structured="tool_call"))


def test_a_replayed_anthropic_trace_with_a_forced_tool_calls_it_every_turn(tiny_checkpoint, tmp_path, capsys):
    """An agent trace as Anthropic's client writes it, with a `tool_choice` that names a tool, thinking off
    and `"structured": "tool_call"`: replay constrains every turn to DSML calls of that tool, and the
    recipe parses each into a `tool_use` block whose input is valid under its schema."""
    line = {
        "id": "harbour-agent", "format": "anthropic", "system": "You are a harbour assistant.",
        "tools": [{"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]} for tool in TOOLS],
        "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"},
        "sampling": {"temperature": 0.7, "max_tokens": 512, "structured": "tool_call"},  # up to 8 DSML invokes
        "messages": [
            {"role": "user", "content": "Weather in Porto for three days, then in Faro."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Porto", "days": 3}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Fog, 14 C."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                                               "input": {"city": "Faro"}}]},
        ],
    }
    traces, cassette = tmp_path / "agent.jsonl", tmp_path / "agent.cassette.jsonl"
    traces.write_text(json.dumps(line) + "\n")
    assert main(["audit", "replay", "record", "--traces", str(traces), "--out", str(cassette),
                 "--model", str(tiny_checkpoint)]) == 0
    episode = json.loads(cassette.read_text().splitlines()[1])
    assert episode["tool_choice"] == line["tool_choice"] and episode["sampling"]["structured"] == "tool_call"
    schema = TOOLS[0]["function"]["parameters"]
    turns = episode["recorded"]["turns"]
    assert len(turns) == 2
    for turn in turns:
        (message,) = turn["message"]["entries"]
        calls = [block for block in message["content"] if block["type"] == "tool_use"]
        assert turn["finish_reason"] == "stop" and calls
        for call in calls:
            assert call["name"] == "get_weather" and violation({"json_schema": schema}, json.dumps(call["input"])) is None
    assert main(["audit", "replay", "verify", str(cassette)]) == 0
    capsys.readouterr()


def test_a_request_file_line_constrains_its_turn_with_its_tool_choice(llm, tmp_path):
    from deepinfer.prompts_file import read_prompts_file

    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [
        {"id": "forced", "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
         "thinking": {"type": "disabled"},  # DeepSeek's API forces no call in thinking mode
         "sampling": {"structured": "tool_call", "max_tokens": 400}},
        {"id": "plain", "prompt": "hi", "sampling": {"structured": "tool_call"}},
    ]) + "\n")
    forced, plain = read_prompts_file(str(path))
    assert forced.params().structured == "tool_call"  # made once the engine's encoding and tokenizer are known
    grammar = forced.params(llm=llm).structured["grammar"]
    assert 'invoke name=\\"get_weather\\"' in grammar and "search_notes" not in grammar
    [output] = llm.generate([forced.prompt_ids(llm)], [forced.params(llm=llm)])
    message = forced.message(llm, output)
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"] * len(message["tool_calls"])
    with pytest.raises(DeepInferError, match=re.escape(f"{path}:2: structured='tool_call' needs a 'messages' request "
                                                       "with tools")):
        plain.params()


@pytest.mark.parametrize("mode", ["teacher-forced", "free-running"])
def test_a_trace_with_a_bad_constraint_is_a_counted_error_and_the_others_replay(tiny_checkpoint, tmp_path, capsys, mode):
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    traces, cassette = tmp_path / "t.jsonl", tmp_path / "c.jsonl"
    traces.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "plain", "messages": turn, "sampling": {"max_tokens": 4}},
        {"id": "broken", "messages": turn, "sampling": {"max_tokens": 4, "structured": {"regex": "(("}}}]))
    main(["audit", "replay", "record", "--mode", mode, "--traces", str(traces), "--out", str(cassette),
          "--model", str(tiny_checkpoint)])
    out = capsys.readouterr().out
    assert "broken: error at turn 1: invalid_request: invalid regex: unclosed group" in out
    assert f"2 entries ({mode}): 1 " in out and ", 1 error" in out
    assert {json.loads(line)["id"] for line in cassette.read_text().splitlines()[1:]} == {"plain", "broken"}
