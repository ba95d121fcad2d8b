"""Request bodies as the official `openai` and `anthropic` SDKs build and send them (their own request
code, captured at the HTTP transport: no network), through `deepinfer recipe encode`, equal to
deepseek-recipe's own encoding of the same bodies."""

from __future__ import annotations

import json

import anthropic
import httpx2
import openai
import pytest

from deepinfer.recipe.official import v4_tokenizer_path
from test_recipe_official import _direct, _run

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
CHAT_HISTORY = [
    {"role": "system", "content": "You are a travel agent."},
    {"role": "user", "content": "Weather in Rome and Milan?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Milan"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 17}'},
]


def _captured(send) -> dict:
    """The JSON body `send(http_client)` posts, answered with an error so the SDK sends nothing else."""
    bodies = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        bodies.append(json.loads(request.content))
        return httpx2.Response(400, json={"error": {"type": "invalid_request_error", "message": "captured"}})

    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)):
        send(httpx2.Client(transport=httpx2.MockTransport(answer)))
    assert len(bodies) == 1
    return bodies[0]


def _openai(http: httpx2.Client) -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-test", base_url="http://capture.invalid/v1", http_client=http, max_retries=0)


def _anthropic(http: httpx2.Client) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="sk-test", base_url="http://capture.invalid", http_client=http, max_retries=0)


CLIENTS = {
    "chat-tools": ("chat", lambda http: _openai(http).chat.completions.create(
        model="gpt-4o", messages=CHAT_HISTORY, temperature=0.3, max_tokens=256,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                 "parameters": WEATHER, "strict": True}}])),
    "chat-stream": ("chat", lambda http: _openai(http).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "developer", "content": "Answer in French."},
                                       {"role": "user", "content": "What is the capital of Peru?"}],
        stream=True, stream_options={"include_usage": True}, seed=11, logprobs=True, top_logprobs=2)),
    "responses-tools": ("responses", lambda http: _openai(http).responses.create(
        model="gpt-5", instructions="You are a travel agent.", max_output_tokens=200,
        tools=[{"type": "function", "name": "get_weather", "description": "Weather of a city.",
                "parameters": WEATHER, "strict": True}],
        input=[{"role": "user", "content": "Weather in Rome?"},
               {"type": "function_call", "call_id": "fc_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
               {"type": "function_call_output", "call_id": "fc_1", "output": '{"temp": 21}'}])),
    "responses-stream": ("responses", lambda http: _openai(http).responses.create(
        model="o4-mini", input="Name three rivers of Spain.", stream=True)),
    "messages-tools": ("messages", lambda http: _anthropic(http).messages.create(
        model="claude-sonnet-4-5", max_tokens=512, system="You are a travel agent.",
        tools=[{"name": "get_weather", "description": "Weather of a city.", "input_schema": WEATHER}],
        messages=[{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Rome"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                "content": "service down", "is_error": True}]}])),
    "messages-stream": ("messages", lambda http: _anthropic(http).messages.create(
        model="claude-opus-4-1", max_tokens=128, stream=True,
        messages=[{"role": "user", "content": "Is 221 prime?"}])),
}


@pytest.fixture(scope="module")
def sdk_bodies() -> dict[str, dict]:
    return {name: _captured(send) for name, (_, send) in CLIENTS.items()}


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_sdk_request_bodies_encode_as_the_recipe_encodes_them(capsys, tmp_path, v41_file, sdk_bodies, family):
    tokenizer = v4_tokenizer_path() if family == "v4" else v41_file
    for format in ("chat", "messages", "responses"):
        bodies = [sdk_bodies[name] for name, (kind, _) in CLIENTS.items() if kind == format]
        file = tmp_path / f"{format}.jsonl"
        file.write_text("".join(json.dumps(body) + "\n" for body in bodies))
        code, out, err = _run(capsys, "--tokenizer", str(v4_tokenizer_path()), "--family", family, "--format", format,
                              str(file))
        assert (code, err) == (0, ""), format
        assert [json.loads(line) for line in out.splitlines()] == [_direct(body, format, family, tokenizer)[0]
                                                                   for body in bodies], format


def test_the_sdks_sent_what_the_cases_say(sdk_bodies):
    bodies = sdk_bodies
    assert bodies["chat-stream"]["stream"] is True and bodies["responses-stream"]["stream"] is True
    assert [m["role"] for m in bodies["chat-tools"]["messages"]].count("tool") == 2
    assert bodies["messages-tools"]["messages"][2]["content"][0]["is_error"] is True


CAP = {"chat": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"}


@pytest.mark.parametrize("preset", ["tiny", "v41-tiny"])
def test_sdk_request_bodies_are_served_and_answered_in_their_clients_shape(tmp_path, sdk_bodies, preset):
    """The whole path, `LLM.respond`: each SDK body is served with deepseek-recipe's own prompt ids for it
    (under the preset's tokenizer) and answered with its API's response object."""
    from deepinfer import LLM

    llm = LLM(f"preset:{preset}", max_model_len=1024)
    family = llm.host.family.encoding
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text(llm.tokenizer.text, encoding="utf-8")
    for name, (format, _) in CLIENTS.items():
        body = {**sdk_bodies[name], CAP[format]: 4}  # short answers: the bodies ask for up to 512 tokens
        served = llm.host.protocol().request(body, format).prompt_ids
        assert served == _direct(body, format, family, tokenizer_file)[0], name
        [response] = llm.respond([body], format)
        usage = response["usage"]
        assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(served), name
        assert response["model"] == body["model"]
        assert {"chat": "chat.completion", "messages": "message", "responses": "response"}[format] == \
            response.get("object", response.get("type")), name
