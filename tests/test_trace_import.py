"""Traces in the shapes real clients write import into the canonical (Chat Completions shaped) form
without losing anything: real-shaped fixtures (tests/fixtures/traces) of a tau-bench-like customer
service agent, a ToolBench-like legacy function-calling episode (also as Responses items), a Claude
tool-use transcript and a Responses coding agent; one-line errors for what is truly unsupported; and
the exporter, whose lines in every format import back to the same messages."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM
from deepinfer.recipe.official import OfficialEncoder, RecipeError, v4_tokenizer_path
from deepinfer.harness.replay import ToolStub
from deepinfer.harness.trace_export import EXPORT_FORMATS, export_line
from deepinfer.harness.traces import Episode, TraceFormatError, load_traces, parse_trace_line, parse_trace_lines
from deepinfer.harness.transcript import arguments_object, canonical_arguments

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def episodes(name: str) -> dict[str, Episode]:
    loaded, errors = load_traces(FIXTURES / name)
    assert errors == []
    return {e.episode_id: e for e in loaded}


@functools.cache
def encoder() -> OfficialEncoder:
    return OfficialEncoder("v4", v4_tokenizer_path().read_text(encoding="utf-8"))


def prompt(episode: Episode, turn: int) -> str:
    """Turn `turn`'s prompt as DeepSeek-V4's official encoding renders the body its client sent."""
    return encoder().render(episode.conversation.before(turn), episode.conversation.recipe_format)


def whole(episode: Episode) -> str:
    """The conversation through its last turn, rendered."""
    return encoder().render(episode.conversation.through(episode.turns), episode.conversation.recipe_format)


def _strings(value, skip_types: bool):
    """Every string in a JSON value (with `skip_types`, not the values of `type` fields, which name
    the shape rather than hold content); JSON text is also searched inside."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not (skip_types and key == "type"):
                yield from _strings(item, skip_types)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item, skip_types)
    elif isinstance(value, str):
        yield value
        if not skip_types and value[:1] in "{[":
            try:
                yield from _strings(json.loads(value), skip_types)
            except ValueError:
                pass


def assert_nothing_lost(source: dict, episode: Episode) -> None:
    """Every string of 8 or more characters in the source line appears in the canonical episode (JSON
    object text as canonical JSON). Not the format's name, nor `previous_response_id`: that earlier
    conversation is the episode's beginning."""
    kept = "\x00".join(_strings(episode.to_json(), skip_types=False))
    content = {key: value for key, value in source.items() if key not in ("format", "previous_response_id")}
    lost = [s for s in _strings(content, skip_types=True)
            if len(s) >= 8 and s not in kept and canonical_arguments(s) not in kept]
    assert lost == [], episode.episode_id


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.jsonl")))
def test_fixtures_import_without_losing_anything(name) -> None:
    loaded = episodes(name)
    for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines():
        source = json.loads(line)
        episode = loaded[source["id"]]
        assert_nothing_lost(source, episode)
        canonical = parse_trace_line(json.dumps(episode.to_json()), "c.jsonl", 1)  # how a cassette stores it
        assert (canonical.messages, canonical.tools, canonical.tool_results) == (
            episode.messages, episode.tools, episode.tool_results)


# Chat Completions: a tau-bench-like customer service agent --------------------------------------------


def test_tau_airline_episode_renders_every_turn() -> None:
    e = episodes("tau_customer_service_chat.jsonl")["airline-cancel-insured"]
    assert e.turns == 5 and [len(m.get("tool_calls", [])) for m in e.messages if m["role"] == "assistant"] == [
        1, 2, 0, 1, 0]
    assert "# Airline Agent Policy" in prompt(e, 1) and "My user id is mei_tanaka_4821." in prompt(e, 1)
    third = prompt(e, 3)
    assert "Let me look up both of your reservations." in third
    assert '"reservation_id": "QX81TB", "origin": "BOS"' in third and '"reservation_id": "LMV2R9"' in third
    assert ('<｜DSML｜invoke name="cancel_reservation">\n<｜DSML｜parameter name="reservation_id" string="true">QX81TB'
            '</｜DSML｜parameter>\n<｜DSML｜parameter name="reason" string="true">change of plan</｜DSML｜parameter>\n') in prompt(e, 5)
    assert [(r.turn, r.name) for r in e.tool_results] == [(1, "get_user_details"), (2, "get_reservation_details"),
                                                          (2, "get_reservation_details"), (4, "cancel_reservation")]


def test_retail_episode_keeps_developer_text_parts_cut_off_arguments_and_refusal() -> None:
    e = episodes("tau_customer_service_chat.jsonl")["retail-exchange-cut-off-arguments"]
    assert e.messages[0]["role"] == "developer" and e.messages[7]["content"] == ""  # a null tool output
    first = prompt(e, 1)  # the developer message is the system prompt; input_text parts are text parts
    assert first.startswith("<｜begin▁of▁sentence｜>Reasoning Effort:") and "\n\nYou are a retail support agent." in first
    assert first.endswith("size 44.\n\nEmail: jonas.weber@example.org<｜Assistant｜><think>")
    # arguments that are no JSON object go to the recipe as the client sent them, which writes them as one string
    assert ('<｜DSML｜invoke name="find_user_id_by_email">\n<｜DSML｜parameter name="arguments" string="true">'
            '</｜DSML｜parameter>') in prompt(e, 2)
    assert ('<｜DSML｜invoke name="get_order_details">\n<｜DSML｜parameter name="arguments" string="true">'
            '{"order_id": "#W58812</｜DSML｜parameter>') in prompt(e, 4)
    # the recipe renders no refusal: the last turn is its content alone
    assert "Thanks, order #W5881234 noted.<｜end▁of▁sentence｜>" in whole(e) and "I'm sorry" not in whole(e)
    stub = ToolStub(e.tool_results)  # a free-running model repeating the cut-off call gets the recorded answer
    assert stub.answer("get_order_details", '{"order_id": "#W58812') == ("", "")
    assert stub.answer("find_user_id_by_email", "") == ("Error: missing required argument 'email'", "")


# legacy function calling (ToolBench-like), and the same episode as Responses items ---------------------


def test_legacy_function_calls_become_tool_calls() -> None:
    e = episodes("toolbench_legacy_chat.jsonl")["toolbench-lisbon-hotel"]
    calls = [(i, m["content"], m["tool_calls"][0]["id"], m["tool_calls"][0]["function"]["name"])
             for i, m in enumerate(e.messages) if m["role"] == "assistant"]
    assert calls == [(2, "", "call_2", "search_hotels_for_staycompare"),
                     (4, None, "call_4", "hotel_reviews_for_staycompare"),
                     (6, "Casa do Rio is cheaper and well reviewed, I can give the answer now.", "call_6", "Finish")]
    results = [(m["tool_call_id"], m["name"]) for m in e.messages if m["role"] == "tool"]
    assert results == [("call_2", "search_hotels_for_staycompare"), ("call_4", "hotel_reviews_for_staycompare")]
    assert [t["function"]["name"] for t in e.tools] == ["search_hotels_for_staycompare",
                                                        "hotel_reviews_for_staycompare", "Finish"]
    assert [(r.name, r.arguments) for r in e.tool_results] == [
        ("search_hotels_for_staycompare", '{"checkin":"2024-09-12","checkout":"2024-09-15","city":"Lisbon"}'),
        ("hotel_reviews_for_staycompare", '{"hotel_id":"LIS-2291"}')]
    assert "'rating': 8.9" in prompt(e, 3)
    assert '<｜DSML｜parameter name="final_answer" string="true">Casa do Rio (LIS-2291)' in whole(e)


def test_an_openai_sdk_dump_with_null_fields_reads_as_the_fields_absent() -> None:
    """`ChatCompletionMessage.model_dump()` writes every field, unset ones as null."""
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    dumped = {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
              "tool_calls": [call], "annotations": None}
    line = {"id": "sdk", "messages": [{"role": "user", "content": "Oslo?", "name": None}, dumped,
                                      {"role": "tool", "tool_call_id": "call_9", "content": "4 C"},
                                      {"role": "assistant", "content": "4 C in Oslo.", "refusal": None,
                                       "function_call": None, "tool_calls": None}]}
    plain = {"id": "sdk", "messages": [{"role": "user", "content": "Oslo?"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "call_9", "content": "4 C"},
                                       {"role": "assistant", "content": "4 C in Oslo."}]}
    assert parse_trace_line(json.dumps(line), "t.jsonl", 1).messages == parse_trace_line(json.dumps(plain), "t.jsonl", 1).messages


def test_the_legacy_episode_as_responses_items_renders_the_same_prompts() -> None:
    legacy = episodes("toolbench_legacy_chat.jsonl")["toolbench-lisbon-hotel"]
    responses = episodes("toolbench_legacy_responses.jsonl")["toolbench-lisbon-hotel-responses"]
    assert responses.turns == legacy.turns == 3 and responses.tools == legacy.tools
    assert [prompt(responses, k) for k in (1, 2, 3)] == [prompt(legacy, k) for k in (1, 2, 3)]
    assert whole(responses) == whole(legacy) and responses.tool_results == legacy.tool_results


# Anthropic: a Claude tool-use transcript ------------------------------------------------------------


def test_claude_transcript_maps_blocks_and_keeps_opaque_data_unrendered() -> None:
    e = episodes("claude_tool_use_anthropic.jsonl")["claude-refund-with-search"]
    roles = [m["role"] for m in e.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "tool", "assistant", "tool", "user",
                     "assistant", "user", "assistant"]
    first, search, result, answer = e.messages[2], e.messages[5], e.messages[6], e.messages[7]
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["get_order", "get_shipment"]  # parallel
    assert first["unrendered"][0]["signature"].startswith("EqQB")
    assert e.messages[4]["is_error"] is True and "is_error" not in e.messages[3]
    assert search["tool_calls"][0]["server"] is True and search["content"] is None
    assert [u["type"] for u in search["unrendered"]] == ["redacted_thinking", "thinking"]
    assert result["unrendered"][0]["type"] == "web_search_tool_result"
    assert result["content"] == ("Warning strikes slow parcel deliveries across Germany\n"
                                 "https://logistics-news.example.com/dhl-strike-march\n\n"
                                 "DHL service status\nhttps://carrier-status.example.org/dhl")
    assert answer["content"].startswith("The carrier is affected by warning strikes, so parcels in Germany are "
                                        "running late. Your tent was delivered 3 days ago, and orders can")
    assert [u["citations"][0]["type"] for u in answer["unrendered"]] == ["web_search_result_location", "char_location"]
    assert e.messages[0]["unrendered"][0]["cache_control"] == {"type": "ephemeral"}
    assert e.tools[1]["cache_control"] == {"type": "ephemeral"} and e.tools[3]["type"] == "web_search_20250305"


def test_claude_transcript_with_server_tools_is_refused_as_deepseek_refuses_it(tiny_checkpoint) -> None:
    """DeepSeek's API runs no provider's server tools (web search): every turn of a transcript that offers one
    is refused with the recipe's reason, the trace's path kept apart."""
    e = episodes("claude_tool_use_anthropic.jsonl")["claude-refund-with-search"]
    llm = LLM(tiny_checkpoint, max_model_len=4096)
    for turn in range(1, e.turns + 1):
        with pytest.raises(RecipeError) as info:
            e.request(turn).prompt_ids(llm)
        assert info.value.where == e.where
        assert info.value.detail == "not a messages request the recipe accepts: tools[3]: server tools are not supported"


def test_images_are_rendered_as_the_recipe_marks_them() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    e = parse({"format": "anthropic", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "See"}, image]}, {"role": "assistant", "content": "A cat."}]})
    assert prompt(e, 2).endswith("<｜User｜>See\n\n[Unsupported Image]<｜Assistant｜><think>")


# OpenAI Responses: custom tools, web search, refusal, previous_response_id --------------------------


def test_responses_transcript_continues_across_lines() -> None:
    loaded = episodes("responses_custom_tools.jsonl")
    one, two, three = (loaded[f"responses-fix-date-parsing-{k}"] for k in (1, 2, 3))
    assert (one.turns, two.turns, three.turns) == (1, 2, 3)
    assert two.messages[: len(one.messages)] == one.messages and three.messages[: len(two.messages)] == two.messages
    search, run = one.messages[2]["tool_calls"]
    assert search["server"] is True and json.loads(search["function"]["arguments"])["query"].startswith("pytest 8.3")
    assert [u["type"] for u in one.messages[2]["unrendered"]] == ["reasoning", "web_search_call", "function_call"]
    assert two.messages[3]["content"] == ("FAILED tests/test_dates.py::test_parse_day_with_padding - ValueError: "
                                          "unconverted data remains:  \n1 failed, 11 passed in 0.42s")
    assert two.messages[4]["tool_calls"][0]["custom"]["input"].startswith("*** Begin Patch")
    assert (three.messages[-1]["content"], three.messages[-1]["refusal"][:26]) == (None, "I can't remove the signed-")
    assert three.conversation.before(3)["input"][: len(two.conversation.entries)] == two.conversation.entries
    assert [(r.name, r.arguments[:15]) for r in three.tool_results] == [
        ("run_tests", '{"path":"tests/'), ("apply_patch", "*** Begin Patch")]
    with pytest.raises(RecipeError) as info:  # a strict function tool beside a custom one, as DeepSeek refuses it
        prompt(one, 1)
    assert str(info.value) == ("not a responses request the recipe accepts: Cannot use strict tool with non-strict "
                               "tool in the same request")


def test_server_tool_results_render_as_text_and_stay_whole_in_unrendered() -> None:
    failed = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
              "content": {"type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"}}
    ran = {"type": "code_execution_tool_result", "tool_use_id": "srvtoolu_2",
           "content": {"type": "code_execution_result", "stdout": "42\n", "stderr": "", "return_code": 0}}
    mcp = {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_3", "is_error": True,
           "content": [{"type": "text", "text": "repository not found"}]}
    e = parse({"format": "anthropic", "messages": [USER, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "rome trains"}},
        failed,
        {"type": "server_tool_use", "id": "srvtoolu_2", "name": "code_execution", "input": {"code": "print(6*7)"}},
        ran,
        {"type": "mcp_tool_use", "id": "mcptoolu_3", "name": "get_issue", "server_name": "tracker",
         "input": {"repo": "rail"}},
        mcp,
        {"type": "text", "text": "Booked."}]}]})
    tools = [m for m in e.messages if m["role"] == "tool"]
    assert [(m["content"], m["unrendered"], m.get("is_error")) for m in tools] == [
        ("error: max_uses_exceeded", [failed], None),
        ('{"return_code": 0, "stderr": "", "stdout": "42\\n", "type": "code_execution_result"}', [ran], None),
        ("repository not found", [mcp], True)]
    calls = [m for m in e.messages if m["role"] == "assistant"]
    assert [m["tool_calls"][0]["server"] for m in calls[:3]] == [True, True, True]
    assert calls[2]["unrendered"][0]["server_name"] == "tracker" and calls[3]["content"] == "Booked."


def test_responses_images_nested_tools_and_tool_output_parts() -> None:
    image = {"type": "input_image", "image_url": "https://example.com/screenshot.png", "detail": "auto"}
    nested = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Open settings."}]},
             {"type": "function_call", "call_id": "c1", "name": "click", "arguments": '{"x": 10, "y": 20'},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "clicked"}, image]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Settings are open."}]}]
    e = parse({"format": "responses", "tools": [nested], "input": items})
    assert e.tools == [nested] and e.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 10, "y": 20'
    assert e.messages[2]["content"] == [{"type": "input_text", "text": "clicked"}, image]
    assert e.tool_results == ()  # the stub could not feed a screenshot to a text-only model
    with pytest.raises(RecipeError) as info:  # the Responses API's function tools are flat: the recipe says so
        prompt(e, 1)
    assert str(info.value) == "not a responses request the recipe accepts: invalid request body: missing field `name`"
    flat = parse({"format": "responses", "tools": [{"type": "function", **nested["function"]}], "input": items})
    assert prompt(flat, 1).endswith("<｜User｜>Open settings.<｜Assistant｜><think>")
    assert "clicked\n\n[Unsupported Image]</tool_result>" in prompt(flat, 2)


# one-line errors for what is truly unsupported ------------------------------------------------------


def parse(obj: dict):
    return parse_trace_line(json.dumps(obj), "t.jsonl", 1)


USER = {"role": "user", "content": "Book the 9:40 to Rome."}


@pytest.mark.parametrize(("obj", "detail"), [
    ({"messages": [USER, {"role": "assistant", "content": "", "function_call": {"name": "book", "arguments": "{}"},
                          "tool_calls": []}]},
     "message 1: has both function_call and tool_calls (use one)"),
    ({"messages": [USER, {"role": "assistant", "content": "ok"}], "functions": [{"name": "book"}], "tools": []},
     "functions: given together with tools (use one)"),
    ({"messages": [USER, {"role": "assistant", "content": None, "function_call": {"name": "book", "arguments": "{}"}},
                   {"role": "function", "name": "cancel", "content": "done"}, {"role": "assistant", "content": "ok"}]},
     "message 2: function message 'cancel' answers no unanswered call of that name in the assistant message before it"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video_url"}]},
                   {"role": "assistant", "content": "ok"}]},
     "message 0: content[1].type: unknown content part type 'video_url'"),
    ({"format": "anthropic", "messages": [USER, {"role": "assistant", "content": "Which day?"},
                                          {"role": "user", "content": [{"type": "text", "text": "Friday"},
                                                                       {"type": "container_upload", "file_id": "f"}]},
                                          {"role": "assistant", "content": "ok"}]},
     "messages[2].content[1].type: unsupported block type 'container_upload' (expected text, image, document, "
     "tool_result)"),
    ({"format": "anthropic", "messages": [USER, {"role": "assistant", "content": [
        {"type": "text", "text": "Booking."}, {"type": "fresh_thought", "text": "?"}]}]},
     "messages[1].content[1].type: unsupported block type 'fresh_thought' (expected text, thinking, redacted_thinking, "
     "tool_use, server_tool_use, mcp_tool_use or a server tool result '*_tool_result')"),
    ({"format": "responses", "input": [USER, {"type": "computer_call", "call_id": "c", "action": {}}]},
     "input[1].type: unsupported item type 'computer_call'"),
    ({"format": "responses", "input": [USER], "output": [{"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "ok"}, {"type": "output_audio", "data": "x"}]}]},
     "output[0].content[1].type: unsupported block type 'output_audio' (expected text, input_text, output_text, "
     "refusal)"),
    ({"format": "responses", "previous_response_id": "resp_missing", "input": [USER],
      "output": [{"role": "assistant", "content": "ok"}]},
     "previous_response_id: 'resp_missing' is not the response_id of an earlier valid line in this file"),
    ({"format": "responses", "response_id": 7, "input": [USER], "output": [{"role": "assistant", "content": "ok"}]},
     "response_id: must be a non-empty string"),
])
def test_unsupported_shapes_fail_with_one_line_naming_the_field(obj, detail) -> None:
    with pytest.raises(TraceFormatError) as info:
        parse(obj)
    assert (info.value.detail, info.value.where, info.value.kind) == (detail, "t.jsonl:1", "malformed")
    assert str(info.value) == f"t.jsonl:1: {detail}" and "\n" not in str(info.value)


def test_previous_response_id_resolves_only_earlier_lines_of_the_file() -> None:
    def line(**fields) -> str:
        return json.dumps({"format": "responses", "input": [USER], "output": [{"role": "assistant", "content": "ok"}],
                           **fields})

    rows = [line(id="b", previous_response_id="resp_a"), line(id="a", response_id="resp_a"),
            line(id="c", response_id="resp_a"), line(id="d", previous_response_id="resp_a", instructions="new")]
    loaded, errors = parse_trace_lines("t.jsonl", list(enumerate(rows, start=1)))
    assert [e.episode_id for e in loaded] == ["a"]
    assert [(e.line, e.detail) for e in errors] == [
        (1, "previous_response_id: 'resp_a' is not the response_id of an earlier valid line in this file"),
        (3, "response_id: duplicate 'resp_a' (first at line 2)"),
        (4, "instructions: differ from those of the conversation previous_response_id continues (a system message "
            "cannot change mid-conversation)"),
    ]


# the exporter: canonical messages -> each format -> the same messages ------------------------------

_TEXT = st.text(alphabet="abcxyz ÄéΩ語,.!?{}[]\"'\n0123", max_size=10)
_OBJECT_ARGUMENTS = st.dictionaries(st.text(alphabet="abcdef", min_size=1, max_size=4),
                                    st.one_of(st.integers(-99, 99), _TEXT, st.booleans(), st.none()),
                                    max_size=3).map(canonical_arguments)
_VERBATIM_ARGUMENTS = st.one_of(st.sampled_from(["", "{", '{"city": "Os', "null", "[1, 2]", '{"a": NaN}']),
                                _TEXT.filter(lambda text: arguments_object(text) is None))
_RARELY = st.sampled_from([False, False, False, True])  # so most conversations fit every format
_CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "search_flights"]),
                            st.one_of(_OBJECT_ARGUMENTS, _OBJECT_ARGUMENTS, _VERBATIM_ARGUMENTS), _TEXT, _RARELY),
                  min_size=1, max_size=3)
_STEP = st.tuples(st.none() | _TEXT, st.none() | _TEXT, _CALLS)  # content, reasoning, [(name, args, result, error)]
_REFUSAL = _RARELY.flatmap(lambda refuses: _TEXT if refuses else st.none())
_FINAL = st.tuples(st.none() | _TEXT, _REFUSAL, st.none() | _TEXT).filter(
    lambda f: f[0] is not None or f[1] is not None)  # content, refusal (which may stand alone), reasoning
CONVERSATIONS = st.tuples(st.sampled_from([None, "system", "system", "developer"]), _TEXT,
                          st.lists(st.tuples(_TEXT, st.lists(_STEP, max_size=2), _FINAL), min_size=1, max_size=3))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object"}, "strict": True}},
         {"type": "function", "function": {"name": "search_flights", "parameters": {"type": "object"}}},
         {"type": "web_search_preview"}]


def canonical_messages(lead: str | None, system: str, turns) -> list[dict]:
    messages = [{"role": lead, "content": system}] if lead else []
    n = 0
    for user, steps, (content, refusal, reasoning) in turns:
        messages.append({"role": "user", "content": user})
        for step_content, step_reasoning, calls in steps:
            ids = [f"call-{(n := n + 1)}" for _ in calls]
            messages.append({"role": "assistant", "content": step_content,
                             "tool_calls": [{"id": i, "type": "function", "function": {"name": name, "arguments": a}}
                                            for i, (name, a, _, _) in zip(ids, calls)],
                             **({"reasoning_content": step_reasoning} if step_reasoning is not None else {})})
            messages += [{"role": "tool", "tool_call_id": i, "content": result, **({"is_error": True} if error else {})}
                         for i, (_, _, result, error) in zip(ids, calls)]
        final = {"role": "assistant", "content": content}
        final.update({k: v for k, v in (("refusal", refusal), ("reasoning_content", reasoning)) if v is not None})
        messages.append(final)
    return messages


def _outside(messages: list[dict], fmt: str) -> str | None:
    """The field a format has no place for, if the conversation uses it."""
    for i, m in enumerate(messages):
        if fmt == "anthropic" and m["role"] == "developer":
            return f"messages[{i}].role"
        if fmt == "anthropic" and "refusal" in m:
            return f"messages[{i}].refusal"
        if fmt == "responses" and "is_error" in m:
            return f"messages[{i}].is_error"
    return None


@settings(max_examples=80, deadline=None)
@given(CONVERSATIONS)
def test_exported_lines_import_back_to_the_same_messages(conversation) -> None:
    messages = canonical_messages(*conversation)
    for fmt in EXPORT_FORMATS:
        outside = _outside(messages, fmt)
        if outside is not None:
            with pytest.raises(TraceFormatError) as info:
                export_line(messages, TOOLS, fmt)
            assert str(info.value) == f"{outside}: no place for it in the {fmt} format"
            continue
        episode = parse(export_line(messages, TOOLS, fmt))
        assert (episode.messages, episode.tools) == (messages, TOOLS), fmt


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_exports_in_each_formats_spelling_and_imports_back(tool_choice) -> None:
    messages = [{"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": "Sunny."}]
    spelled = {}
    for fmt in EXPORT_FORMATS:
        line = export_line(messages, TOOLS, fmt, tool_choice)
        spelled[fmt] = line["tool_choice"]
        assert parse(line).tool_choice == tool_choice, fmt
    if tool_choice == "required":
        assert spelled == {"chat": "required", "anthropic": {"type": "any"}, "responses": "required"}
    if isinstance(tool_choice, dict):
        assert spelled["anthropic"] == {"type": "tool", "name": "get_weather"}
        assert spelled["responses"] == {"type": "function", "name": "get_weather"}


def test_a_malformed_tool_choice_is_one_line_naming_the_field() -> None:
    line = {**export_line([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], TOOLS, "chat"),
            "tool_choice": {"type": "function"}}
    with pytest.raises(TraceFormatError) as info:
        parse(line)
    assert (info.value.detail, info.value.where) == (
        "tool_choice: expected auto, none, required or a named function, got {'type': 'function'}", "t.jsonl:1")


def test_custom_tool_calls_export_to_responses() -> None:
    patch = "*** Begin Patch\n*** Add File: notes.txt\n+Rome, 9:40\n*** End Patch"
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_p1", "type": "custom", "custom": {"name": "apply_patch", "input": patch}}]},
        {"role": "tool", "tool_call_id": "call_p1", "content": "Done!"}, {"role": "assistant", "content": "Noted."}]
    tools = [{"type": "custom", "name": "apply_patch", "description": "Edit files with a patch."}]
    line = export_line(messages, tools, "responses")
    assert [item.get("type") for item in line["input"]] == [None, "custom_tool_call", "custom_tool_call_output",
                                                             "message"]
    assert (parse(line).messages, parse(line).tools) == (messages, tools)


@pytest.mark.parametrize(("message", "fmt", "error"), [
    ({"role": "assistant", "content": "a", "unrendered": [{"type": "redacted_thinking", "data": "x"}]}, "anthropic",
     "messages[1].unrendered: no place for it in the anthropic format"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "s", "type": "function", "function": {"name": "web_search", "arguments": "{}"}, "server": True}]},
     "responses", "messages[1].tool_calls[0].server: no place for it in the responses format"),
    ({"role": "assistant", "content": [{"type": "output_text", "text": "a"}]}, "responses",
     "messages[1].content: only text content is exported"),
])
def test_what_a_format_cannot_hold_is_refused_not_dropped(message, fmt, error) -> None:
    with pytest.raises(TraceFormatError) as info:
        export_line([USER, message], None, fmt)
    assert str(info.value) == error
