"""Client request bodies answered through DeepSeek's protocol (`LLM.respond`, `recipe.official.Protocol`):
converted and encoded by deepseek-recipe, sampled with the settings they carry, constrained to the DSML
tool calls their tool choice forces (`recipe.dsml`), and parsed back by the recipe's StreamProcessor
into Chat Completions, Messages and Responses objects, on a V4 and a V4.1 preset."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.audit.structured_check import violation
from deepinfer.recipe.dsml import TAGS, ToolCallConstraintError, calls_constraint
from deepinfer.recipe.official import OfficialEncoder, Protocol, RecipeError

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
NOTES = {"type": "object", "additionalProperties": False, "required": ["query"],
         "properties": {"query": {"type": "string", "maxLength": 16}, "limit": {"enum": [1, 5, 10]}}}
SCHEMAS = {"get_weather": WEATHER, "search_notes": NOTES}
CHAT_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
              for name, schema in SCHEMAS.items()]
ASK = "What is the weather in Porto for the next three days?"


def forced_bodies(seed: int) -> dict[str, dict]:
    """One body per format whose tool choice forces a call (with thinking off, which forcing needs)."""
    return {
        "chat": {"model": "deepseek-chat", "messages": [{"role": "user", "content": ASK}], "tools": CHAT_TOOLS,
                 "tool_choice": "required", "thinking": {"type": "disabled"}, "temperature": 1.0, "seed": seed,
                 "max_tokens": 300},
        "messages": {"model": "claude-sonnet", "max_tokens": 300, "messages": [{"role": "user", "content": ASK}],
                     "tools": [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()],
                     "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"}},
        "responses": {"model": "gpt-agent", "input": ASK, "max_output_tokens": 300, "tool_choice": "required",
                      "reasoning": {"effort": "none"}, "seed": seed,
                      "tools": [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]},
    }


def tool_calls(response: dict, format: str) -> list[tuple[str, dict]]:
    """(name, arguments) of every tool call in a response object, as a client reads them."""
    if format == "chat":
        message = response["choices"][0]["message"]
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    if format == "messages":
        return [(block["name"], block["input"]) for block in response["content"] if block["type"] == "tool_use"]
    return [(item["name"], json.loads(item["arguments"])) for item in response["output"] if item["type"] == "function_call"]


@pytest.fixture(scope="module", params=["tiny", "v41-tiny"])
def llm(request) -> LLM:
    return LLM(f"preset:{request.param}", max_model_len=1024)  # the official tools block is ~600 tiny-BPE tokens


@pytest.mark.parametrize("format", ["chat", "messages", "responses"])
def test_forced_tool_calls_come_back_as_valid_calls_in_the_clients_shape(llm, format):
    responses = llm.respond([forced_bodies(seed)[format] for seed in range(3)], format)
    for response in responses:
        calls = tool_calls(response, format)
        assert calls, response
        for name, arguments in calls:
            assert name in (("get_weather",) if format == "messages" else SCHEMAS)
            assert violation({"json_schema": SCHEMAS[name]}, json.dumps(arguments)) is None
    finish = {"chat": ("choices", 0, "finish_reason", "tool_calls"), "messages": ("stop_reason", "tool_use"),
              "responses": ("status", "completed")}[format]
    *path, value = finish
    for response in responses:
        for key in path:
            response = response[key]
        assert response == value


def test_a_response_is_a_function_of_its_generation(llm):
    """Tool-call ids, random in the recipe, derive from the response id and the call's place."""
    protocol = llm.host.protocol()
    request = protocol.request(forced_bodies(5)["chat"], "chat")
    params = SamplingParams(**request.carried, structured=protocol.constraint(request))
    [output] = llm.generate([request.prompt_ids], params)
    first, second = (protocol.respond(request, "chatcmpl-7", output.token_ids, output.finish_reason) for _ in range(2))
    assert first.pop("created") <= second.pop("created") and first == second
    ids = [call["id"] for call in first["choices"][0]["message"]["tool_calls"]]
    assert all(re.fullmatch(r"call_\d\d_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)


def test_sampling_settings_come_from_the_body_and_the_engine_defaults_fill_the_rest(llm):
    protocol = llm.host.protocol()
    body = {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}, "temperature": 0.5,
            "top_p": 0.9, "seed": 11, "logprobs": True, "top_logprobs": 2, "max_tokens": 6}
    request = protocol.request(body, "chat")
    top_p = {"v4": pytest.approx(0.9), "v41": 1.0}[llm.host.family.encoding]  # the recipe's final top_p for V4.1-Flash
    assert request.carried == {"temperature": 0.5, "top_p": top_p, "seed": 11, "logprobs": 2, "max_tokens": 6}
    [response] = llm.respond([body], "chat")
    assert response["usage"]["completion_tokens"] == 6
    content = response["choices"][0]["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == 2 for entry in content)
    bare = protocol.request({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}, "chat")
    assert bare.carried == {}
    assert bare.max_tokens(1024) == 1024 - len(bare.prompt_ids)  # DeepSeek's 8192, lowered to the context left
    with pytest.raises(RecipeError) as caught:
        protocol.request({**body, "max_tokens": 5000}, "chat").max_tokens(1024)
    assert caught.value.kind == "prompt_too_long" and "\n" not in str(caught.value)
    with pytest.raises(RecipeError, match=r"^request 1: [^\n]+$") as caught:
        llm.respond([body, {**body, "max_tokens": 5000}], "chat")
    assert caught.value.kind == "prompt_too_long" and not llm.has_unfinished()
    lacking = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["x"]}}}]
    with pytest.raises(RecipeError, match=r"^request 0: tool 'f': required parameter 'x' has no property schema$"):
        llm.respond([{**body, "tools": lacking, "tool_choice": "required"}], "chat")


def test_a_json_schema_response_format_is_enforced(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Pick n."}], "thinking": {"type": "disabled"}, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}}
    for response in llm.respond([{**body, "seed": seed, "temperature": 1.0} for seed in range(3)], "chat"):
        assert violation({"json_schema": schema}, response["choices"][0]["message"]["content"]) is None


def test_a_body_the_recipe_refuses_is_one_line_naming_the_request(llm):
    good = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RecipeError, match=r"^request 1: not a messages request the recipe accepts: [^\n]+$"):
        llm.respond([good | {"max_tokens": 4}, {"messages": "hi"}], "messages")
    with pytest.raises(RecipeError, match=r"^request 0: no request format 'completions' \(one of chat, messages, responses\)$"):
        llm.respond([good], "completions")
    assert not llm.has_unfinished()


PROPERTY_SCHEMAS = {  # a property's schema, a value it allows and one it forbids
    "plain-string": ({"type": "string"}, st.text(max_size=12), None),
    "bounded-string": ({"type": "string", "maxLength": 5}, st.text(max_size=5), "abcdefgh"),
    "integer": ({"type": "integer", "minimum": 1, "maximum": 7}, st.integers(1, 7), 8),
    "enum": ({"enum": ["fog", "a.b|c", 3]}, st.sampled_from(["fog", "a.b|c", 3]), "sun"),
    "nullable-string": ({"type": ["string", "null"]}, st.one_of(st.none(), st.text(max_size=8)), 5),
    "object": ({"type": "object", "properties": {"x": {"type": "array", "items": {"type": "integer"}}}},
               st.fixed_dictionaries({"x": st.lists(st.integers(-9, 99), max_size=3)}), {"x": ["a"]}),
}


@st.composite
def tool_and_call(draw):
    """A tool of 1-4 properties of the kinds above, some required, and a call of it whose arguments hold
    every required property and some optional ones, each with a value its schema allows."""
    kinds = draw(st.lists(st.sampled_from(sorted(PROPERTY_SCHEMAS)), min_size=1, max_size=4))
    names = [f"p{i}_{kind.replace('-', '_')}" for i, kind in enumerate(kinds)]
    required = [n for n in names if draw(st.booleans())]
    arguments = {n: draw(PROPERTY_SCHEMAS[k][1]) for n, k in zip(names, kinds) if n in required or draw(st.booleans())}
    schema = {"type": "object", "required": required,
              "properties": {n: PROPERTY_SCHEMAS[k][0] for n, k in zip(names, kinds)}}
    return schema, dict(zip(names, kinds)), arguments


@pytest.fixture(scope="module")
def dsml_setups(v4_text, v41_file):
    import llguidance

    from deepinfer.engine.structured import _guidance_tokenizer
    from deepinfer.recipe.tokenizer import TextTokenizer

    setups = {}
    for encoding, text in (("v4", v4_text), ("v41", v41_file.read_text(encoding="utf-8"))):
        tokenizer = TextTokenizer(text, "test")
        setups[encoding] = (OfficialEncoder(encoding, text), tokenizer,
                            _guidance_tokenizer(text, tokenizer.vocab_size, tokenizer.eos_id), llguidance)
    return setups


def _accepts(setup, encoding: str, schema: dict, arguments: dict) -> bool:
    """Whether the DSML constraint made for a tool of `schema` accepts the call the official encoding
    writes for `arguments` (its tokens as the tokenizer gives them, then the end token)."""
    encoder, tokenizer, guidance, llguidance = setup
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    grammar = calls_constraint(json.dumps(tools), encoding, tokenizer.special_id("｜DSML｜"))["grammar"]
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": json.dumps(arguments)}}
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "a", "content": "ok"}], "thinking": {"type": "disabled"}}
    prompt = encoder.render(body, "chat")
    opening = f"<｜DSML｜{TAGS[encoding][0]}>\n"
    written = prompt[prompt.index(opening) + len(opening):prompt.index("<｜end▁of▁sentence｜>")]
    matcher = llguidance.LLMatcher(guidance, llguidance.LLMatcher.grammar_from_lark(grammar))
    ids = encoder.tokenizer.encode(written) + [tokenizer.eos_id]
    return all(matcher.consume_token(token) for token in ids) and matcher.is_stopped() and not matcher.get_error()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tool_and_call(), encoding=st.sampled_from(["v4", "v41"]), data=st.data())
def test_the_constraint_accepts_what_the_encoding_writes_and_only_what_the_schema_allows(dsml_setups, case, encoding,
                                                                                        data):
    """A call the official encoding writes for valid arguments (text values with '<' and '</' included) is a
    sentence of the constraint made for its tool; with a required property left out, or one value its
    schema forbids, it is not."""
    schema, kinds, arguments = case
    setup = dsml_setups[encoding]
    assert _accepts(setup, encoding, schema, arguments)
    assert _accepts(setup, encoding, schema, {**arguments, **{n: "P<a></b> x" for n, k in kinds.items()
                                                               if k == "plain-string" and n in arguments}})
    if schema["required"]:
        dropped = data.draw(st.sampled_from(schema["required"]))
        assert not _accepts(setup, encoding, schema, {k: v for k, v in arguments.items() if k != dropped})
    forbidding = [n for n, k in kinds.items() if PROPERTY_SCHEMAS[k][2] is not None]
    if forbidding:
        name = data.draw(st.sampled_from(forbidding))
        assert not _accepts(setup, encoding, schema, {**arguments, name: PROPERTY_SCHEMAS[kinds[name]][2]})


@pytest.mark.parametrize("encoding", ["v4", "v41"])
def test_a_string_the_constraint_cannot_check_as_text_is_written_as_json(dsml_setups, encoding):
    """A pattern is no regex the constraint writes text with, so such a string goes as JSON (string="false"),
    which the recipe's parser reads back as the same string; the encoding's own text form is refused."""
    encoder, tokenizer, guidance, llguidance = dsml_setups[encoding]
    schema = {"type": "object", "required": ["code"], "properties": {"code": {"type": "string", "pattern": "^[a-z]+$"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    grammar = calls_constraint(json.dumps(tools), encoding, tokenizer.special_id("｜DSML｜"))["grammar"]
    _, invoke, parameter = TAGS[encoding]

    def written(value: str, as_string: str) -> str:
        return (f'<｜DSML｜{invoke} name="f">\n<｜DSML｜{parameter} name="code" string="{as_string}">{value}'
                f'</｜DSML｜{parameter}>\n</｜DSML｜{invoke}>\n</｜DSML｜{TAGS[encoding][0]}>')

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(guidance, llguidance.LLMatcher.grammar_from_lark(grammar))
        ids = encoder.tokenizer.encode(text) + [tokenizer.eos_id]
        return all(matcher.consume_token(t) for t in ids) and matcher.is_stopped()

    assert accepted(written('"abc"', "false")) and not accepted(written('"ab1"', "false"))
    assert not accepted(written("abc", "true"))
    protocol = Protocol(encoding, tokenizer.text)
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required",
            "thinking": {"type": "disabled"}}
    ids = encoder.tokenizer.encode(written('"abc"', "false")) + [tokenizer.eos_id]
    [call] = protocol.message(protocol.request(body, "chat"), "chatcmpl-1", ids, "stop")["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"code": "abc"}


def test_tools_the_constraint_cannot_write_are_refused_in_one_line():
    bad = [({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["x"]}}},
            "tool 'f': required parameter 'x' has no property schema"),
           ({"type": "function", "function": {"name": "f", "parameters": {"properties": {'a"b': {}}}}},
            "tool 'f': parameter name 'a\"b' cannot be written in DSML"),
           ({"type": "custom", "custom": {"name": "g"}}, "a tool-call constraint needs a function tool")]
    for tool, message in bad:
        with pytest.raises(ToolCallConstraintError, match=f"^{re.escape(message)}$"):
            calls_constraint(json.dumps([tool]), "v41", 7)


def test_in_thinking_mode_a_json_schema_applies_after_the_reasoning(dsml_setups, v4_text):
    """Thinking on (DeepSeek's default), the answer's schema constrains what follows `</think>`: the
    reasoning before it is free text."""
    _, tokenizer, guidance, llguidance = dsml_setups["v4"]
    protocol = Protocol("v4", v4_text)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
    body = {"messages": [{"role": "user", "content": "Pick n."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}}
    request = protocol.request(body, "chat")
    assert request.thinking
    grammar = protocol.constraint(request)["grammar"]

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(guidance, llguidance.LLMatcher.grammar_from_lark(grammar))
        ids = protocol.encoder.tokenizer.encode(text) + [tokenizer.eos_id]
        return all(matcher.consume_token(t) for t in ids) and matcher.is_stopped()

    assert accepted('I pick {"n": 12}, no: three.</think>{"n":3}')
    assert not accepted('Three.</think>{"n":12}') and not accepted('{"n":3}')
    [message] = [protocol.message(request, "chatcmpl-1", protocol.encoder.tokenizer.encode('Three.</think>{"n":3}'),
                                  "stop")]
    assert message["reasoning_content"] == "Three." and json.loads(message["content"]) == {"n": 3}
