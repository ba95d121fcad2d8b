"""Tests for `deepinfer generate`: JSON-lines results that match the Python API, prompts files
mixing text, token-id and chat requests, and one-line errors (exit code 2) that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cli import EXIT_USER_ERROR, main
from deepinfer.recipe.official import OfficialEncoder

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def api(tiny_checkpoint) -> LLM:
    return LLM(tiny_checkpoint)


def run(capsys, *argv: str) -> tuple[int, list[dict], str]:
    """Exit code, the JSON lines printed on stdout, and stderr."""
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, [json.loads(line) for line in captured.out.splitlines()], captured.err


def write_lines(path: Path, *lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def assert_user_error(capsys, argv: list[str], message: str) -> None:
    assert "\n" not in message
    code, out, err = run(capsys, *argv)
    assert code == EXIT_USER_ERROR
    assert out == []
    assert err == f"error: {message}\n"


def test_one_prompt_prints_one_json_line(capsys, tiny_checkpoint, api):
    code, out, err = run(capsys, "--model", str(tiny_checkpoint), "--prompt", "hello", "--max-tokens", "5")
    assert code == 0 and err == ""
    [row] = out
    [want] = api.generate(["hello"], SamplingParams(temperature=0, max_tokens=5))
    assert len(row["token_ids"]) == 5 and row["finish_reason"] == "length"
    assert row["index"] == 0
    assert row["token_ids"] == want.token_ids
    assert row["text"] == want.text
    assert row["prompt_tokens"] == len(want.prompt_token_ids)
    assert row["seed"] == want.seed
    assert row["logprobs"] == pytest.approx(want.logprobs, abs=1e-6)
    assert "top_logprobs" not in row and "message" not in row


def test_prompts_file_mixes_text_token_ids_and_chat_in_input_order(capsys, tiny_checkpoint, tmp_path, api):
    path = write_lines(
        tmp_path / "requests.jsonl",
        {"prompt": "hello", "sampling": {"ignore_eos": True}},
        "",
        {"prompt_token_ids": [0, 5, 6], "sampling": {"max_tokens": 2, "ignore_eos": True}},
        {"messages": CHAT},
        {"prompt": "the fox", "sampling": {"temperature": 0.8, "seed": 3, "top_k": 50, "ignore_eos": True}},
    )
    code, out, err = run(capsys, "--model", str(tiny_checkpoint), "--prompts-file", path, "--max-tokens", "4",
                         "--logprobs", "2")
    assert code == 0 and err == ""
    assert [row["index"] for row in out] == [0, 1, 2, 3]
    official = OfficialEncoder("v4", api.tokenizer.text).encode({"messages": CHAT}, "chat")  # thinking on, as the API
    prompts = ["hello", [0, 5, 6], official, "the fox"]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=4, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, top_k=50, max_tokens=4, ignore_eos=True, logprobs=2)]
    want = api.generate(prompts, params)
    assert [row["token_ids"] for row in out] == [w.token_ids for w in want]
    assert [row["prompt_tokens"] for row in out] == [len(w.prompt_token_ids) for w in want]
    assert [len(row["token_ids"]) for row in out][:2] == [4, 2]
    assert out[3]["seed"] == 3
    assert all(len(row["top_logprobs"]) == len(row["token_ids"]) for row in out)
    assert all(len(top) == 2 for row in out for top in row["top_logprobs"])
    assert [("message" in row) for row in out] == [False, False, True, False]
    message = out[2]["message"]  # parsed by the recipe: thinking on, so the 4 tokens are reasoning
    assert message["role"] == "assistant" and message["content"] == ""
    assert message["reasoning_content"] == out[2]["text"].lstrip("\n").removesuffix("\ufffd")


def test_out_file_gets_the_lines(capsys, tiny_checkpoint, tmp_path):
    path = write_lines(tmp_path / "requests.jsonl", {"prompt": "hello"}, {"prompt_token_ids": [0, 7]})
    out_file = tmp_path / "results.jsonl"
    code, out, err = run(capsys, "--model", str(tiny_checkpoint), "--prompts-file", path, "--max-tokens", "3",
                         "--out", str(out_file))
    assert code == 0 and out == [] and err == ""
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1]
    assert all(1 <= len(row["token_ids"]) <= 3 for row in rows)


def test_default_model_is_the_embedded_v41_checkpoint(capsys, v41_checkpoint):
    """The default is v41-tiny, seed 0, in the release's formats: what the v41_checkpoint fixture holds."""
    args = ("--prompt", "hello", "--max-tokens", "3")
    code, default, err = run(capsys, *args)
    assert code == 0 and err == ""
    _, explicit, _ = run(capsys, "--model", str(v41_checkpoint), *args)
    assert default[0]["token_ids"] == explicit[0]["token_ids"]


def test_help_mentions_prompts_file(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    assert "--prompts-file" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"prompt": "a"}, '{"prompt": '], "{path}:2: invalid JSON (Expecting value at column 12)"),
        (["[1, 2]"], "{path}:1: expected a JSON object, got list"),
        ([{"sampling": {"max_tokens": 3}}], "{path}:1: needs exactly one of 'prompt', 'prompt_token_ids', 'messages'"),
        ([{"prompt": "a"}, {"prompt": "a", "prompt_token_ids": [1]}],
         "{path}:2: needs exactly one of 'prompt', 'prompt_token_ids', 'messages'"),
        ([{"prompt": 5}], "{path}:1: 'prompt' must be a string (use 'prompt_token_ids' for token ids)"),
        ([{"prompt_token_ids": "hi"}], "{path}:1: 'prompt_token_ids' must be a list of token ids"),
        ([{"prompt": "a", "sampling": 3}], "{path}:1: 'sampling' must be an object"),
        # line numbers count blank lines: this is the second request but the third line
        ([{"prompt": "a"}, "", {"prompt": "b", "sampling": {"temprature": 0.5}}],
         "{path}:3: unknown sampling field(s) ['temprature']"),
        ([{"prompt": "a"}, {"prompt": "b", "sampling": {"top_p": 0}}],
         "{path}:2: invalid sampling params: top_p must be in (0, 1], got 0"),
        (["", "  "], "{path}: no requests"),
    ],
    ids=["bad-json", "not-object", "no-source", "two-sources", "prompt-type", "ids-type", "sampling-type",
         "unknown-field", "bad-value", "empty"],
)
def test_bad_prompts_file_lines(capsys, tmp_path, tiny_checkpoint, lines, message):
    path = write_lines(tmp_path / "requests.jsonl", *lines)
    assert_user_error(capsys, ["--model", str(tiny_checkpoint), "--prompts-file", path],
                      message.format(path=path))


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"prompt": "a"}, {"messages": [{"role": "bot", "content": "hi"}]}],
         "{path}:2: not a chat request the recipe accepts: invalid request body: unknown variant `bot`, expected one "
         "of `system`, `user`, `assistant`, `tool`, `latest_reminder`"),
        ([{"prompt_token_ids": [0, 5000]}], "{path}:1: prompt token 5000 is not an id in [0, 1024)"),
        ([{"prompt": "a"}, {"prompt_token_ids": []}], "{path}:2: prompt is empty"),
        ([{"prompt": "a"}, {"prompt": "b", "sampling": {"structured": {"regex": "(("}}}],
         "{path}:2: invalid regex: unclosed group"),
        ([{"prompt": "a", "sampling": {"structured": "tool_call"}}],
         "{path}:1: structured='tool_call' needs a 'messages' request with tools"),
        ([{"prompt": "a"}, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
                            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                            "sampling": {"structured": "tool_call"}}],
         "{path}:2: structured='tool_call' needs tools and a tool_choice that forces a call ('required' or a named "
         "function)"),
        ([{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
           "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
           "sampling": {"structured": "tool_call"}}],
         "{path}:1: not a chat request the recipe accepts: Thinking mode does not support this tool_choice (thinking "
         'is on unless the request says "thinking": {{"type": "disabled"}})'),
    ],
    ids=["bad-role", "bad-token", "empty-ids", "bad-constraint", "tool-call-without-tools", "tool-call-unforced",
         "tool-call-while-thinking"],
)
def test_bad_requests_are_named_by_line(capsys, tmp_path, tiny_checkpoint, lines, message):
    path = write_lines(tmp_path / "requests.jsonl", *lines)
    assert_user_error(capsys, ["--model", str(tiny_checkpoint), "--prompts-file", path],
                      message.format(path=path))


def test_unreadable_prompts_files(capsys, tmp_path, tiny_checkpoint):
    missing = tmp_path / "missing.jsonl"
    assert_user_error(capsys, ["--model", str(tiny_checkpoint), "--prompts-file", str(missing)],
                      f"{missing}: cannot read (No such file or directory)")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    assert_user_error(capsys, ["--model", str(tiny_checkpoint), "--prompts-file", str(latin1)],
                      f"{latin1}:1: not UTF-8 text")


def test_bad_flags_and_outputs(capsys, tmp_path, tiny_checkpoint):
    model = ["--model", str(tiny_checkpoint)]
    # a bad flag is reported as such, not against a request
    assert_user_error(capsys, [*model, "--prompt", "hi", "--temperature", "-1"],
                      "invalid sampling params: temperature must be a finite number >= 0, got -1.0")
    assert_user_error(capsys, [*model, "--prompt", "hi", "--max-tokens", "0"],
                      "invalid sampling params: max_tokens must be an integer >= 1, got 0")
    assert_user_error(capsys, [*model, "--prompt", "hi", "--dtype", "float8"],
                      "unknown dtype 'float8' (expected one of float32, fp32, bfloat16, bf16, float16, fp16)")
    missing_model = tmp_path / "no-model"
    assert_user_error(capsys, ["--model", str(missing_model), "--prompt", "hi"],
                      f"{missing_model}: checkpoint folder not found")
    out_file = tmp_path / "no-dir" / "out.jsonl"
    assert_user_error(capsys, [*model, "--prompt", "hi", "--max-tokens", "1", "--out", str(out_file)],
                      f"{out_file}: its folder {out_file.parent} does not exist")
    existing = tmp_path / "results.jsonl"
    existing.write_text("earlier results\n")
    assert_user_error(capsys, ["--model", str(missing_model), "--prompt", "hi", "--out", str(existing)],
                      f"{existing}: exists (results are never overwritten; choose a new file)")  # before any work
    assert existing.read_text() == "earlier results\n"
    assert_user_error(capsys, [*model, "--prompt", "hi", "--temperature", "inf"],
                      "invalid sampling params: temperature must be a finite number >= 0, got inf")
    assert_user_error(capsys, [*model, "--prompt", "hi", "--device", "tpu"],
                      "unknown device 'tpu' (expected cpu, cuda or cuda:N)")
    too_long = write_lines(tmp_path / "long.jsonl", {"prompt_token_ids": list(range(2, 40))})
    assert_user_error(capsys, [*model, "--prompts-file", too_long, "--max-model-len", "32"],
                      f"{too_long}:1: prompt has 38 tokens but max_model_len is 32 (room is needed to generate)")


def test_usage_errors_are_one_line(capsys):
    from deepinfer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--max-num-seqs", "abc"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: deepinfer generate: argument --max-num-seqs: invalid int value: 'abc'\n"
