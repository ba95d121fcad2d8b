"""Tests for the engine: `LLM` input validation, generation behaviour, seeded sampling that does not
depend on batch composition, the sampler's pieces, and the scheduler's preemption and block accounting.

Everything runs on the tiny checkpoint (fp32, CPU) with short prompts and few tokens.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import shutil
import time

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import CheckpointError
from deepinfer.engine.core import PromptTooLongError, RequestError
from deepinfer.engine.sampler import uniform_noise
from deepinfer.kernels.sampling import first_argmax
from deepinfer.errors import DeepInferError
from deepinfer.model import NULL_BLOCK
from deepinfer.recipe.official import OfficialEncoder, RecipeError
from deepinfer.recipe.tokenizer import TextTokenizer
from deepinfer.sampling_params import MAX_JSON_NESTING, SUITE_SEEDS, SamplingParamsError, derive_seed, json_nesting
from sampling import filter_one, sample_one, sample_positions

VOCAB = 1024  # the tiny preset's vocabulary
EOS_ID = 1


def raises(error: type[Exception], message: str):
    """`pytest.raises` for exactly `message` (the whole text, which must be one line)."""
    assert "\n" not in message
    return pytest.raises(error, match=f"^{re.escape(message)}$")


def random_prompts(n: int, lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [lengths] * n if isinstance(lengths, int) else lengths
    return [torch.randint(2, VOCAB, (length,), generator=gen).tolist() for length in lengths]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    """A default engine shared by the module; every test leaves it with no queued request."""
    engine = LLM(tiny_checkpoint)
    yield engine
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def no_tokenizer(tiny_checkpoint, tmp_path_factory) -> LLM:
    folder = tmp_path_factory.mktemp("no-tokenizer") / "tiny"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "tokenizer.json").unlink()
    return LLM(folder)


# ------------------------------------------------------------------------------------ bad engine


def test_missing_checkpoint_folder_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with raises(CheckpointError, f"{missing}: checkpoint folder not found"):
        LLM(missing)


def test_bad_engine_arguments(tiny_checkpoint):
    with raises(DeepInferError, "unknown dtype 'float8' (expected one of float32, fp32, bfloat16, bf16, float16, fp16)"):
        LLM(tiny_checkpoint, dtype="float8")
    with raises(DeepInferError, "max_num_seqs must be a positive integer, got 0"):
        LLM(tiny_checkpoint, max_num_seqs=0)
    with raises(DeepInferError, "max_num_batched_tokens must be a positive integer, got -1"):
        LLM(tiny_checkpoint, max_num_batched_tokens=-1)
    # 0 used to fall back silently to the default length
    with raises(DeepInferError, "max_model_len must be a positive integer, got 0"):
        LLM(tiny_checkpoint, max_model_len=0)
    with raises(DeepInferError, "max_model_len=5000 exceeds the model's max_position_embeddings=4096"):
        LLM(tiny_checkpoint, max_model_len=5000)
    with raises(DeepInferError, "cuda_graphs must be true or false, got 'yes'"):
        LLM(tiny_checkpoint, cuda_graphs="yes")
    assert LLM(tiny_checkpoint, max_num_seqs=2).runner.graphs is None  # CPU steps run eagerly


def test_an_engine_over_a_loaded_model_serves_like_a_fresh_one(tiny_checkpoint):
    """`LLM.with_engine` shares the weights and changes only how they are served; settings that decide
    how the model was built are refused in one line."""
    loaded = LLM(tiny_checkpoint, max_num_seqs=4)
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logprobs=1)
    prompts = [list(range(2, 30)), list(range(40, 47))]
    config = dataclasses.replace(loaded.engine_config, max_num_seqs=1, max_num_batched_tokens=8, seed=3,
                                 max_model_len=None, dtype="fp32")  # resolved settings and aliases are the same
    shared = loaded.with_engine(config)
    assert shared.model is loaded.model and shared.engine_config.max_num_seqs == 1
    fresh = LLM(tiny_checkpoint, config=config)
    assert [(o.token_ids, o.logprobs) for o in shared.generate(prompts, params)] == \
        [(o.token_ids, o.logprobs) for o in fresh.generate(prompts, params)]
    with raises(DeepInferError, "with_engine: dtype decides how the model was built ('float32'); "
                                "load the model again to change it"):
        loaded.with_engine(dataclasses.replace(config, dtype="bfloat16"))


def test_num_cache_blocks_is_raised_to_one_sequence_in_each_pool(tiny_checkpoint):
    # one sequence of max_model_len=4096 needs, per pool: window ceil((32 - 1 + 512 step tokens) / 16) + 1
    # = 35, CSA state ceil((2 * 4 + 512) / 16) + 1 = 34, HCA state ceil((16 + 512) / 16) + 1 = 34,
    # CSA entries 4096 / 4 / 16 + 1 = 65, HCA entries 4096 / 16 / 16 + 1 = 17
    one_seq = {"window": 35, "csa_state": 34, "hca_state": 34, "csa_entries": 65, "hca_entries": 17}
    tight = LLM(tiny_checkpoint, num_cache_blocks=1)
    assert tight.max_model_len == 4096 and tight.cache.num_blocks == one_seq
    [out] = tight.generate([list(range(2, 40))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8
    roomier = LLM(tiny_checkpoint, num_cache_blocks=40)
    assert roomier.cache.num_blocks == {name: max(40, n) for name, n in one_seq.items()}


# ------------------------------------------------------------------------------------ bad prompts


def test_prompt_must_leave_room_to_generate(tiny_checkpoint):
    short = LLM(tiny_checkpoint, max_model_len=64)
    with raises(RequestError, "prompt has 64 tokens but max_model_len is 64 (room is needed to generate)"):
        short.generate([list(range(2, 66))])
    assert not short.has_unfinished()
    # 63 tokens fit, and generation stops at max_model_len whatever max_tokens says
    [out] = short.generate([list(range(2, 65))], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        ([5, VOCAB], f"prompt token {VOCAB} is not an id in [0, {VOCAB})"),
        ([5, -1], f"prompt token -1 is not an id in [0, {VOCAB})"),
        ([5, 2.0], f"prompt token 2.0 is not an id in [0, {VOCAB})"),
        ([True, 5], f"prompt token True is not an id in [0, {VOCAB})"),
        ([5, "6"], f"prompt token '6' is not an id in [0, {VOCAB})"),
        (3.5, "a prompt must be a string or a list of token ids, got float"),
        (None, "a prompt must be a string or a list of token ids, got NoneType"),
        ({"prompt": "hi"}, "a prompt must be a string or a list of token ids, got dict"),
    ],
)
def test_bad_prompt(llm, prompt, message):
    with raises(RequestError, message):
        llm.generate([prompt])
    with raises(RequestError, message):
        llm.add_request(prompt)
    assert not llm.has_unfinished()


def test_prompts_must_be_a_list(llm):
    with raises(RequestError, "prompts must be a list (of strings or of token-id lists)"):
        llm.generate("hello")
    with raises(RequestError, "got 1 SamplingParams for 2 prompts"):
        llm.generate([[5], [6]], [SamplingParams()])
    with raises(RequestError, "params must be SamplingParams, got dict"):
        llm.generate([[5]], {"max_tokens": 3})
    assert not llm.has_unfinished()


def test_bad_prompt_in_a_batch_queues_nothing(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with raises(RequestError, f"prompt token 5000 is not an id in [0, {VOCAB})"):
        llm.generate([[5, 6], [7, 5000], [8]], params)
    assert not llm.has_unfinished()
    bad = SamplingParams(max_tokens=3)
    bad.top_k = -1  # changed after construction: caught when the batch is checked, before queueing
    with raises(SamplingParamsError, "invalid sampling params: top_k must be an integer >= 0 (0 disables it), got -1"):
        llm.generate([[5, 6], [8]], [params, bad])
    assert not llm.has_unfinished()
    outs = llm.generate([[5, 6], [8]], params)
    assert [len(o.token_ids) for o in outs] == [3, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0, got inf"),
        ({"temperature": True}, "temperature must be a finite number >= 0, got True"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
        ({"min_p": False}, "min_p must be in [0, 1], got False"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -1}, "top_k must be an integer >= 0 (0 disables it), got -1"),
        ({"top_k": 2.0}, "top_k must be an integer >= 0 (0 disables it), got 2.0"),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": True}, "max_tokens must be an integer >= 1, got True"),
        ({"seed": -1}, "seed must be an integer in [0, 2**63), got -1"),
        ({"seed": 2**63}, f"seed must be an integer in [0, 2**63), got {2**63}"),
        ({"logprobs": -1}, "logprobs must be an integer >= 0, got -1"),
        ({"stop": 5}, "stop must be a list of non-empty strings, got 5"),
        ({"stop": [1]}, "stop must be a list of non-empty strings, got [1]"),
        ({"stop": [""]}, "stop must be a list of non-empty strings, got ['']"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be a list of token ids, got [-3]"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with raises(SamplingParamsError, f"invalid sampling params: {message}"):
        SamplingParams(**kwargs)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=4), max_leaves=40)


def _nesting(value: object) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max((_nesting(child) for child in children), default=0)


@given(JSON_VALUES)
def test_json_nesting_counts_levels_of_objects_and_arrays(value):
    assert json_nesting(value) == _nesting(value)
    assert json_nesting([value] * 3) == 1 + _nesting(value)


def test_json_nesting_stops_past_the_limit_and_to_dict_copies_its_containers():
    deep: list = []
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    assert json_nesting(deep) == MAX_JSON_NESTING + 1
    params = SamplingParams(stop=["x"], structured={"json_schema": {"type": "object"}})
    values = params.to_dict(skip_defaults=True)
    values["stop"].append("y")
    values["structured"]["json_schema"] = {}
    assert (params.stop, params.structured) == (["x"], {"json_schema": {"type": "object"}})
    assert values.keys() == {"stop", "structured"}


def test_checkpoint_without_tokenizer(no_tokenizer):
    with raises(RequestError, "this checkpoint has no tokenizer.json: pass prompts as token-id lists"):
        no_tokenizer.generate(["hello"])
    with raises(RequestError, "stop strings need a tokenizer; use stop_token_ids with this checkpoint"):
        no_tokenizer.generate([[0, 5]], SamplingParams(stop=["x"]))
    with raises(DeepInferError, "chat needs a tokenizer: this checkpoint has no tokenizer.json"):
        no_tokenizer.chat([[{"role": "user", "content": "hi"}]])
    assert not no_tokenizer.has_unfinished()
    [out] = no_tokenizer.generate([[0, 5]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2 and out.text is None


def test_chat_with_unknown_role_names_conversation_and_the_recipes_complaint(llm):
    good = [{"role": "user", "content": "hi"}]
    bad = [{"role": "system", "content": "be brief"}, {"role": "bot", "content": "hello"}]
    with pytest.raises(RecipeError, match=r"^conversation 1: not a chat request the recipe accepts: .*unknown variant `bot`"):
        llm.chat([good, bad])
    assert not llm.has_unfinished()


# ------------------------------------------------------------------------------------- behaviour


def test_outputs_in_prompt_order_with_length_finish(llm):
    prompts = random_prompts(3, [9, 2, 5], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 7, 1)]
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [4, 7, 1]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[0].request_id < outs[1].request_id < outs[2].request_id
    assert all(len(o.logprobs) == len(o.token_ids) and o.top_logprobs is None for o in outs)
    # each request's greedy continuation is the same as when it runs alone
    for prompt, param, out in zip(prompts, params, outs):
        assert llm.generate([prompt], param)[0].token_ids == out.token_ids


def test_timing_is_recorded_and_not_part_of_equality(llm):
    prompts = random_prompts(2, [30, 3], seed=2)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, seed=5)
    before = time.perf_counter()
    first = llm.generate(prompts, params)
    after = time.perf_counter()
    assert all(before < o.arrival_time < o.first_token_time <= o.finish_time < after for o in first)
    again = [dataclasses.replace(o, request_id=f.request_id) for o, f in zip(llm.generate(prompts, params), first)]
    assert again == first
    assert all(a.arrival_time > f.finish_time and a.first_token_time != f.first_token_time for a, f in zip(again, first))



def test_the_stream_yields_each_step_and_takes_arrivals_between_steps(llm):
    """`stream` is the loop `generate` runs: one item per step (empty while nothing finishes), and
    requests that `arrive` queues between steps are served with the bits `generate` gives them."""
    prompts = random_prompts(4, [20, 3, 9, 33], seed=4)
    params = [SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, seed=40 + i) for i in range(4)]
    want = llm.generate(prompts, params)
    waiting = list(range(1, 4))
    llm.add_request(prompts[0], params[0], request_id=0)

    def arrive() -> bool:  # one more request each step
        if waiting:
            index = waiting.pop(0)
            llm.add_request(prompts[index], params[index], request_id=index)
        return bool(waiting)

    steps = list(llm.stream(arrive))
    assert sorted(out.request_id for step in steps for out in step) == [0, 1, 2, 3]
    assert [] in steps and not llm.has_unfinished()
    assert sorted((out for step in steps for out in step), key=lambda out: out.request_id) == [
        dataclasses.replace(out, request_id=i) for i, out in enumerate(want)]


def test_submit_checks_every_prompt_before_queueing_any(llm):
    with pytest.raises(RequestError, match=r"^prompt token -1 is not an id in \[0, 1024\)$"):
        llm.submit([[5, 6], [7, -1]])
    assert not llm.has_unfinished()

@pytest.fixture(scope="module")
def greedy_runs(llm):
    """32 four-token prompts and their 32-token greedy continuations with EOS ignored."""
    prompts = random_prompts(32, 4, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert all(len(o.token_ids) == 32 for o in outs)
    return prompts, [o.token_ids for o in outs]


def test_eos_stops_generation_unless_ignored(llm, greedy_runs):
    prompts, continuations = greedy_runs
    hits = [(p, c, c.index(EOS_ID)) for p, c in zip(prompts, continuations) if EOS_ID in c]
    assert hits, "some greedy continuation of the tiny model should reach EOS"
    prompt, ref, at = hits[0]
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))
    assert out.token_ids == ref[: at + 1]
    assert out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(ref[:at])  # EOS itself is not in the text


def test_stop_token_ids_stop_right_after_the_token(llm, greedy_runs):
    prompt, ref = greedy_runs[0][0], greedy_runs[1][0]
    at = next(i for i in range(3, len(ref)) if ref.index(ref[i]) == i and ref[i] != EOS_ID)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                  stop_token_ids=[ref[at]]))
    assert out.token_ids == ref[: at + 1]
    assert out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(ref[:at])


def test_stop_strings_truncate_text_before_the_stop_string(llm):
    prompt = "the quick brown fox"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [ref] = llm.generate([prompt], greedy)
    full = ref.text
    at = next(i for i in range(2, len(full) - 1)
              if full[i:i + 2].isascii() and full[i:i + 2].isalnum() and full.find(full[i:i + 2]) == i)
    stop = full[at:at + 2]
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  stop=["\x00never\x00", stop]))
    assert out.finish_reason == "stop"
    assert out.text == full[:at]
    # generation ran exactly until the stop string was complete
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])


def test_logprobs(llm):
    prompts = random_prompts(2, 6, seed=2)
    k = 5
    sampled, greedy = llm.generate(prompts, [
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=k),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=k),
    ])
    for out in (sampled, greedy):
        assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs)
        for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
            ids = [i for i, _ in top]
            values = [v for _, v in top]
            assert len(top) == k and len(set(ids)) == k
            assert all(0 <= i < VOCAB for i in ids)
            assert values == sorted(values, reverse=True)
            assert all(v <= 0 for v in values) and logprob <= 0
            assert sum(math.exp(v) for v in values) <= 1 + 1e-5
            if token in ids:
                assert values[ids.index(token)] == logprob
            else:
                assert logprob <= values[-1]
    # greedy picks the most likely token: the first entry, ties to the lower id
    assert all(top[0] == (t, lp) for t, lp, top in zip(greedy.token_ids, greedy.logprobs, greedy.top_logprobs))


def test_text_prompts_start_with_bos(llm):
    [out] = llm.generate(["hello world"], SamplingParams(max_tokens=1))
    bos = llm.tokenizer.bos_id
    assert bos == llm.config.bos_token_id
    assert out.prompt_token_ids == [bos, *llm.tokenizer.encode("hello world")]
    assert out.prompt_token_ids.count(bos) == 1


def test_chat_prompts_with_the_official_encoding_and_parses_with_the_recipe(llm):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    [out] = llm.chat([conversation], SamplingParams(temperature=0, max_tokens=8))
    body = {"messages": conversation, "thinking": {"type": "disabled"}}
    assert out.prompt_token_ids == OfficialEncoder("v4", llm.tokenizer.text).encode(body, "chat")
    assert out.message["role"] == "assistant"
    assert out.message["content"] == out.text.removesuffix("\ufffd")  # a character cut by max_tokens is left out


# -------------------------------------------------------------------------------- seeded sampling

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2)


def seeded_batch(target: list[int]) -> tuple[list, list]:
    """The target request at index 3 among seven others: greedy, sampled, unseeded, other lengths, the
    target's prompt with another seed (index 2) and another prompt with the target's seed (index 6)."""
    others = random_prompts(6, [3, 40, 17, 9, 70, 5], seed=4)
    prompts = [others[0], others[1], target, target, others[2], others[3], others[4], others[5]]
    params = [
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=1.0, seed=1, max_tokens=30),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1235, max_tokens=24, ignore_eos=True),
        SEEDED,
        SamplingParams(temperature=0.5, max_tokens=5),
        SamplingParams(temperature=1.2, min_p=0.05, seed=99, max_tokens=20),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, logprobs=4),
    ]
    return prompts, params


def assert_same_draws(got, want):
    """The engine runs in batch-invariant numerics by default: token ids and logprob bits match exactly."""
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert got.top_logprobs == want.top_logprobs


def test_seeded_sampling_does_not_depend_on_the_batch(llm, tiny_checkpoint):
    target = random_prompts(1, 12, seed=3)[0]
    [alone] = llm.generate([target], SEEDED)
    assert alone.seed == 1234 and len(alone.token_ids) == 24

    prompts, params = seeded_batch(target)
    batched = llm.generate(prompts, params)
    assert_same_draws(batched[3], alone)
    # the same prompt with another seed draws differently; another prompt with the same seed too
    assert batched[2].token_ids != alone.token_ids
    assert batched[6].token_ids != alone.token_ids

    order = list(range(8))
    random.Random(5).shuffle(order)
    shuffled = llm.generate([prompts[i] for i in order], [params[i] for i in order])
    assert_same_draws(shuffled[order.index(3)], alone)
    for position, i in enumerate(order):
        if params[i].seed is not None or params[i].temperature == 0:  # unseeded ones derive from the request id
            assert shuffled[position].token_ids == batched[i].token_ids

    chunked = LLM(tiny_checkpoint, max_num_batched_tokens=16)
    assert_same_draws(chunked.generate(prompts, params)[3], alone)


def test_derived_seeds_never_change():
    """Certificates record runs whose unseeded requests got these seeds; a rerun must get them again."""
    assert derive_seed(0, 0) == 3818668012074767233
    assert derive_seed(7, 12) == 6773036239967155948
    assert derive_seed(0, "text-unseeded", SUITE_SEEDS) == 8312749772898587288


def test_unseeded_requests_report_a_seed_that_reproduces_them(llm):
    prompts = random_prompts(2, 8, seed=6)
    params = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompts, params)
    assert first[0].seed != first[1].seed
    for prompt, out in zip(prompts, first):
        assert 0 <= out.seed < 2**63
        [again] = llm.generate([prompt], SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True,
                                                        seed=out.seed))
        assert again.seed == out.seed
        assert again.token_ids == out.token_ids


def test_different_seeds_draw_differently(llm):
    prompt = random_prompts(1, 8, seed=8)[0]
    outs = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True)
                                       for s in (1, 2, 1)])
    assert outs[0].token_ids != outs[1].token_ids
    assert outs[0].token_ids == outs[2].token_ids


# ---------------------------------------------------------------------------------------- sampler


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), position=st.integers(0, 2**20), vocab=st.integers(1, 4096))
def test_uniform_noise_is_strictly_inside_the_unit_interval_and_exact(seed, position, vocab):
    u = uniform_noise(seed, position, vocab, "cpu")
    assert u.dtype == torch.float32 and u.shape == (vocab,)
    assert bool(((u > 0) & (u < 1)).all())
    # every value is (k + 1/2) / 2**23 exactly: u * 2**24 is an odd integer
    scaled = u.double() * 2**24
    assert bool((scaled == scaled.round()).all())
    assert bool((scaled.long() % 2 == 1).all())
    assert torch.equal(u, uniform_noise(seed, position, vocab, "cpu"))


def test_uniform_noise_varies_with_seed_position_and_token():
    u = uniform_noise(3, 10, 4096, "cpu")
    assert len(set(u.tolist())) > 4000
    assert abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u, uniform_noise(3, 11, 4096, "cpu"))
    assert not torch.equal(u, uniform_noise(4, 10, 4096, "cpu"))
    assert not torch.equal(u, uniform_noise(3 + 2**32, 10, 4096, "cpu"))  # the high seed bits count


def brute_force_order(scaled: np.ndarray) -> np.ndarray:
    """Token ids from most to least likely, ties to the lower id."""
    return np.array(sorted(range(len(scaled)), key=lambda i: (-scaled[i], i)))


def fp32_scaled(logits: list[float], temperature: float) -> np.ndarray:
    """Temperature-scaled logits as the engine computes them (fp32), widened to fp64: the same ties."""
    return (torch.tensor(logits, dtype=torch.float32) / temperature).double().numpy()


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


logit_lists = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=2, max_size=64)
temperatures = st.floats(0.25, 2.0)


def kept(logits: list[float], **kwargs) -> tuple[set[int], torch.Tensor, np.ndarray]:
    params = SamplingParams(**kwargs)
    t = torch.tensor(logits, dtype=torch.float32)
    out = filter_one(t, params)
    scaled = fp32_scaled(logits, params.temperature)
    keep = set(torch.isfinite(out).nonzero().flatten().tolist())
    # kept tokens keep their temperature-scaled logit, the rest are -inf
    assert torch.equal(out[torch.isfinite(out)], (t / params.temperature)[torch.isfinite(out)])
    assert bool((out[~torch.isfinite(out)] == float("-inf")).all())
    return keep, out, scaled


@settings(max_examples=80, deadline=None)
@given(logits=logit_lists, temperature=temperatures, data=st.data())
def test_top_k_keeps_exactly_k_tokens(logits, temperature, data):
    k = data.draw(st.integers(1, len(logits) + 2))
    keep, _, scaled = kept(logits, temperature=temperature, top_k=k)
    assert keep == set(brute_force_order(scaled)[:k].tolist())


@settings(max_examples=80, deadline=None)
@given(logits=logit_lists, temperature=temperatures, top_p=st.floats(0.01, 0.99))
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(logits, temperature, top_p):
    scaled = fp32_scaled(logits, temperature)
    order = brute_force_order(scaled)
    mass = np.cumsum(softmax64(scaled)[order])
    assume(np.abs(mass - top_p).min() > 1e-4)  # away from the boundary, fp32 and fp64 agree
    n = int(np.argmax(mass >= top_p)) + 1
    keep, _, _ = kept(logits, temperature=temperature, top_p=top_p)
    assert keep == set(order[:n].tolist())


@settings(max_examples=80, deadline=None)
@given(logits=logit_lists, temperature=temperatures, min_p=st.floats(0.0, 1.0))
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(logits, temperature, min_p):
    scaled = fp32_scaled(logits, temperature)
    probs = softmax64(scaled)
    ratio = probs / probs.max()
    assume(np.abs(ratio - min_p).min() > 1e-4 or min_p == 0.0)
    keep, _, _ = kept(logits, temperature=temperature, min_p=min_p)
    assert keep == {i for i in range(len(logits)) if ratio[i] >= min_p}


@settings(max_examples=50, deadline=None)
@given(logits=logit_lists, temperature=temperatures, top_k=st.integers(0, 3), top_p=st.floats(1e-9, 1.0),
       min_p=st.floats(0.0, 1.0))
def test_filters_always_keep_the_top_token(logits, temperature, top_k, top_p, min_p):
    keep, _, scaled = kept(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert int(brute_force_order(scaled)[0]) in keep
    assert len(keep) >= 1


@settings(max_examples=50, deadline=None)
@given(logits=logit_lists, seed=st.integers(0, 2**63 - 1), position=st.integers(0, 4096), top_k=st.integers(1, 3))
def test_sampled_token_is_never_a_filtered_one(logits, seed, position, top_k):
    params = SamplingParams(temperature=1.0, top_k=top_k)
    t = torch.tensor(logits, dtype=torch.float32)
    token = sample_one(t, params, seed, position)
    assert bool(torch.isfinite(filter_one(t, params)[token]))
    assert token == sample_one(t, params, seed, position)


def test_gumbel_sampling_follows_the_distribution():
    logits = torch.tensor([0.0, math.log(3.0), float("-inf"), -30.0])
    params = SamplingParams(temperature=1.0)
    draws = sample_positions(logits, params, seed=11, positions=range(4000))
    assert draws[:50] == [sample_one(logits, params, seed=11, position=p) for p in range(50)]
    assert set(draws) <= {0, 1, 3}
    assert draws.count(1) / len(draws) == pytest.approx(0.75, abs=0.03)


def test_greedy_takes_the_lowest_index_among_tied_maxima():
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 2.0])
    greedy = SamplingParams(temperature=0)
    assert sample_one(logits, greedy, seed=1, position=0) == 1
    assert sample_one(logits, greedy, seed=2, position=9) == 1
    assert first_argmax(torch.tensor([[3.0, 3.0], [1.0, 2.0]])).tolist() == [0, 1]
    # top_k=1 keeps the lowest id among tied maxima too
    assert torch.isfinite(filter_one(logits, SamplingParams(top_k=1))).nonzero().flatten().tolist() == [1]


# ---------------------------------------------------------------------------------- scheduler/cache


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.integers(1, 40), min_size=1, max_size=12))
def test_blocks_behind_a_sequence_are_released_once_each(steps):
    """`release_behind` frees exactly the blocks no later step can read, looking only at what became
    releasable since its last call (its watermark), and a freed sequence starts over."""
    from deepinfer.engine.cache import BlockTables, CacheManager
    from deepinfer.model.batch import PoolSpec

    specs = [PoolSpec("window", "window", (0,), 4, window=24), PoolSpec("s_state", "state", (0,), 4, ratio=4, overlap=True)]
    cache = CacheManager(specs, max_num_seqs=1, max_model_len=512, max_step_tokens=40, num_blocks=None, block_size=8,
                         dtype=torch.float32, device="cpu")
    for _ in range(2):  # the second pass: after `free`, the watermark starts over
        blocks, end = BlockTables(), 0
        for step in steps:
            end += step
            cache.grow(blocks, end)
            cache.release_behind(blocks, end)
            for name, spec in cache.specs.items():
                table, behind = blocks.table(name), spec.first_kept_row(end) // 8
                assert all(b == NULL_BLOCK for b in table[:behind]) and NULL_BLOCK not in table[behind:]
                assert blocks.released[name] == min(behind, len(table))  # where the next call starts
                assert cache.num_free()[name] == cache.num_blocks[name] - (len(table) - blocks.released[name])
        cache.free(blocks)
        assert cache.num_free() == cache.num_blocks


def test_preemption_finishes_everything_and_leaks_no_blocks(llm, tiny_checkpoint):
    # 11 blocks is the minimum for max_model_len=128 (window pool: ceil((31 + 128) / 16) + 1); 12
    # sequences growing to 127 tokens outgrow it (their CSA entries need 2 blocks each by the end),
    # so one is preempted and recomputed (at max_model_len=256 with 200 tokens, 2 were, at twice the cost)
    small = LLM(tiny_checkpoint, max_num_seqs=16, max_model_len=128, num_cache_blocks=11)
    prompts = random_prompts(12, [20 + i % 8 for i in range(12)], seed=9)
    params = [SamplingParams(temperature=0.8, top_k=50, seed=100 + i, max_tokens=100, ignore_eos=True)
              for i in range(12)]
    outs = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert not small.has_unfinished()
    assert all(o.finish_reason == "length" and len(o.token_ids) == 100 for o in outs)
    small.reset_prefix_cache()
    assert small.cache.num_free() == small.cache.num_blocks
    # recomputation after preemption draws the same tokens as an engine that never preempts
    reference = llm.generate(prompts, params)
    assert llm.scheduler.num_preemptions == 0
    for got, want in zip(outs, reference):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs


def test_preempted_sequences_resume_without_chunked_prefill(llm, tiny_checkpoint):
    # without chunked prefill the step budget is raised to max_model_len (a prompt cannot be split);
    # 7 blocks squeeze the CSA entries pool (5 blocks per sequence of 256 tokens), so one of the two
    # sequences is preempted and recomputed (a preempted sequence used to be stuck, then crash)
    engine = LLM(tiny_checkpoint, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64,
                 enable_chunked_prefill=False, num_cache_blocks=7)
    assert engine.max_num_batched_tokens == 256
    prompts = random_prompts(2, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=216, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert all(o.finish_reason == "length" and len(o.token_ids) == 216 for o in outs)
    engine.reset_prefix_cache()
    assert engine.cache.num_free() == engine.cache.num_blocks
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(("device", "message"), [
    ("tpu", "unknown device 'tpu' (expected cpu, cuda or cuda:N)"),
    ("cuda:x", "unknown device 'cuda:x' (expected cpu, cuda or cuda:N)"),
])
def test_an_unknown_device_is_one_line(tiny_checkpoint, device, message):
    with raises(DeepInferError, message):
        LLM(tiny_checkpoint, device=device)


def test_max_tokens_that_leave_no_room_for_a_prompt_are_refused_not_capped(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_model_len=64)
    with raises(RequestError, "max_tokens=64 leaves no room for a prompt: max_model_len is 64"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=64))
    assert [len(o.token_ids) for o in llm.generate([[5, 6]], SamplingParams(max_tokens=63, ignore_eos=True))] == [62]


def test_a_huge_text_prompt_is_refused_before_tokenizing(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    text = "word " * 1_000_000
    fewest = len(text) // llm.tokenizer.max_token_bytes
    with raises(PromptTooLongError, f"prompt of 5000000 bytes has at least {fewest} tokens but max_model_len is "
                                    f"{llm.max_model_len}"):
        llm.generate([text])


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=400))
def test_no_token_covers_more_bytes_than_max_token_bytes(tiny_checkpoint, text):
    tokenizer = TextTokenizer.from_folder(tiny_checkpoint)
    assert len(tokenizer.encode(text)) >= len(text.encode("utf-8")) // tokenizer.max_token_bytes
