"""Prefix caching (`EngineConfig.prefix_caching`, `deepinfer.engine.prefix`) changes what is computed,
never outputs: token ids, logprob bits, top and prompt logprobs are the same with the prefix cache
off, on with requests sharing prefixes, and hot (every prompt cached), for V4 and V4.1, fp32 and
bf16, greedy and sampled, including multi-turn chains, eviction under small caches, preemption with
shared blocks, async scheduling and prompt logprobs. Every block's holder count stays exact, and on
the sample traces replayed teacher-forced the cache supplies at least 90 % of the repeated prefill."""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_paths import bf16_refusal
from deepinfer import LLM, EngineConfig, RequestOutput, SamplingParams
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.config import add_engine_flags, config_from_flags
from deepinfer.errors import DeepInferError
from deepinfer.model import NULL_BLOCK
from deepinfer.harness.certify import prefix_summary
from deepinfer.harness.invariance import STANDARD_VARIANTS, ReferenceDrafter
from deepinfer.harness.record import record_run
from deepinfer.harness.replay import prefill_cost, teacher_forced
from deepinfer.harness.run_writer import STATS_FILE, read_stats
from deepinfer.harness.suite_registry import load_suite
from deepinfer.harness.sweep import default_sweep, variant_from_dict
from deepinfer.harness.traces import load_traces

TRACES = sorted((Path(__file__).resolve().parent / "fixtures" / "traces").glob("*.jsonl"))
COLD = EngineConfig(max_model_len=256, prefix_caching=False)


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("preset:tiny", COLD)


def outcome(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Every output field the prefix cache must not change, in prompt order."""
    skip = {f.name for f in dataclasses.fields(RequestOutput) if not f.compare} | {"request_id"}  # timing, ids
    return [tuple(v for k, v in dataclasses.asdict(o).items() if k not in skip) for o in llm.generate(prompts, params)]


def hot(llm: LLM, **settings) -> LLM:
    """An engine over `llm`'s model with prefix caching on."""
    return llm.with_engine(dataclasses.replace(llm.engine_config, prefix_caching=True, **settings))


def check_holders(llm: LLM) -> None:
    """Each block's holder count is the number of block tables and prefix entries (evicted ones that
    a child still needs included) that hold it, and exactly the blocks nobody holds are free."""
    cache, prefix = llm.cache, llm.scheduler.prefix
    held = {name: Counter() for name in cache.specs}
    for seq in [*llm.scheduler.running, *llm.scheduler.waiting]:
        for name, table in seq.blocks.tables.items():
            held[name].update(block for block in table if block != NULL_BLOCK)
    alive, stack = {}, list(prefix.entries.values()) if prefix else []
    while stack:
        entry = stack.pop()
        if id(entry) not in alive:
            alive[id(entry)] = entry
            stack.extend([entry.parent] if entry.parent else [])
    for entry in alive.values():
        for name, (_, blocks) in [*entry.pins.items(), *entry.kept.items()]:
            held[name].update(blocks)
    for name, count in cache.num_blocks.items():
        free = set(cache.free_blocks[name])
        assert len(free) == len(cache.free_blocks[name]), f"{name}: a block is free twice"
        for block in range(1, count + 1):
            assert cache.refs[name][block] == held[name][block], f"{name} block {block}"
            assert (block in free) == (held[name][block] == 0), f"{name} block {block}"


def shared_prompts(rng: random.Random, base: int, lengths: list[int], tails: int, vocab: int = 1024) -> list[list[int]]:
    """Prompts that start with the first `length` tokens of one `base`-token prompt, then differ."""
    stem = [rng.randrange(2, vocab) for _ in range(base)]
    return [stem[:length] + [rng.randrange(2, vocab) for _ in range(rng.randrange(tails + 1))] for length in lengths]


@pytest.mark.parametrize("preset,dtype", [("tiny", "float32"), ("tiny", "bfloat16"),
                                          ("v41-tiny", "float32"), ("v41-tiny", "bfloat16")])
def test_outputs_are_the_same_bits_with_the_prefix_cache_cold_and_hot(preset: str, dtype: str, monkeypatch) -> None:
    """Few-shot style prompts sharing prefixes of lengths off the block grid, then a second turn of
    each (its prompt: the first turn's prompt, its output and new text)."""
    if dtype == "bfloat16" and (refusal := bf16_refusal()):
        pytest.skip(f"the engine refuses bf16 on this CPU code path: {refusal}")
    rng = random.Random(7)
    prompts = shared_prompts(rng, 90, [90, 90, 61, 37, 83, 17], tails=9)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, top_k=0 if i % 2 else 40, seed=50 + i, max_tokens=6,
                             logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    cold = LLM(f"preset:{preset}", dataclasses.replace(COLD, dtype=dtype))
    warm = hot(cold)
    copies = []
    copy_block = CacheManager.copy_block
    monkeypatch.setattr(CacheManager, "copy_block", lambda self, *a: copies.append(a) or copy_block(self, *a))
    want = outcome(cold, prompts, params)
    assert outcome(warm, prompts, params) == want  # sharing while they run
    assert warm.scheduler.num_prefix_hits >= 4
    assert outcome(warm, prompts, params) == want  # hot: each prompt cached by the pass before
    assert copies, "no prefix ended inside a block of compressed rows (copy on write untested)"
    turns = [p + list(out[1]) + [rng.randrange(2, 1024) for _ in range(5)] for p, out in zip(prompts, want)]
    hits = warm.scheduler.num_prefix_hit_tokens
    assert outcome(warm, turns, params) == outcome(cold, turns, params)
    # each second turn takes at least its first turn's prompt and output but the last partial block
    assert warm.scheduler.num_prefix_hit_tokens - hits >= sum((len(t) - 5 - 1) // 16 * 16 for t in turns)
    check_holders(warm)


request = st.fixed_dictionaries({
    "shared": st.integers(0, 70),
    "tail": st.integers(1, 12),
    "max_tokens": st.integers(1, 10),
    "temperature": st.sampled_from([0.0, 0.9]),
    "prompt_logprobs": st.booleans(),
})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=2, max_size=6), block_size=st.sampled_from([4, 16]),
       budget=st.sampled_from([16, 64, 512]), blocks=st.sampled_from([None, 20]), async_scheduling=st.booleans(),
       seed=st.integers(0, 3))
def test_prefix_sharing_is_exact_whatever_the_schedule(tiny, requests, block_size, budget, blocks,
                                                       async_scheduling, seed) -> None:
    """Prompts sharing random prefixes, served cold and with the prefix cache (twice: the second pass
    finds its own prompts cached), with small blocks, step budgets and caches (eviction and
    preemption), both schedulings, and prompt logprobs (a request that scores its prompt takes only
    positions it scored before)."""
    rng = random.Random(seed)
    stem = [rng.randrange(2, 1024) for _ in range(70)]
    prompts = [stem[:r["shared"]] + [rng.randrange(2, 1024) for _ in range(r["tail"])] for r in requests]
    params = [SamplingParams(seed=seed + i, logprobs=1, ignore_eos=True,
                             **{k: v for k, v in r.items() if k not in ("shared", "tail")})
              for i, r in enumerate(requests)]
    config = dataclasses.replace(COLD, block_size=block_size, max_num_batched_tokens=budget, num_cache_blocks=blocks,
                                 async_scheduling=async_scheduling)
    cold = tiny.with_engine(config)
    warm = hot(cold)
    want = outcome(cold, prompts, params)
    assert outcome(warm, prompts, params) == want
    assert outcome(warm, prompts, params) == want
    check_holders(warm)
    warm.reset_prefix_cache()
    assert warm.cache.num_free() == warm.cache.num_blocks


def test_with_speculation_only_rows_that_held_are_cached(tiny) -> None:
    """Drafts that fail leave rows past the kept tokens; the cache takes rows up to the computed count
    after the rollback only, so prompts that extend these (second turns) still get the same bits."""
    rng = random.Random(6)
    prompts = shared_prompts(rng, 80, [80, 80, 45, 70], tails=6)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=20 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    cold = tiny.generate(prompts, params)
    streams = [p + out.token_ids for p, out in zip(prompts, cold)]
    spec = hot(tiny, speculation="ngram", draft_tokens=4)
    spec.scheduler.drafter = ReferenceDrafter(streams, wrong_every=3)
    want = outcome(tiny, prompts, params)
    assert outcome(spec, prompts, params) == want
    assert 0 < spec.scheduler.num_draft_kept < spec.scheduler.num_drafted
    turns = [s + [rng.randrange(2, 1024) for _ in range(3)] for s in streams]
    hits = spec.scheduler.num_prefix_hit_tokens
    assert outcome(spec, turns, params) == outcome(tiny, turns, params)
    assert spec.scheduler.num_prefix_hit_tokens - hits >= sum((len(t) - 4) // 16 * 16 for t in turns)
    check_holders(spec)


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny) -> None:
    """The first admitted computes the shared 100 tokens; the others wait for its blocks, then take
    all but the last partial block (96 tokens) each."""
    prompts = shared_prompts(random.Random(3), 100, [100] * 5, tails=0)
    prompts = [p + [7 + i] for i, p in enumerate(prompts)]
    warm = hot(tiny)
    warm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert (warm.scheduler.num_prefix_hits, warm.scheduler.num_prefix_hit_tokens) == (4, 4 * 96)
    assert warm.scheduler.num_prefix_query_tokens == 5 * 101


def test_prompt_logprobs_are_all_scored_next_to_cached_prefixes(tiny) -> None:
    """A request that scores its prompt computes all of it, even with the prompt cached; one that
    does not takes the cached blocks."""
    prompt = shared_prompts(random.Random(4), 60, [60], tails=0)[0]
    plain = SamplingParams(temperature=0, max_tokens=2, seed=1)
    scored = SamplingParams(temperature=0, max_tokens=2, seed=2, prompt_logprobs=True)
    want = outcome(tiny, [prompt, prompt], [plain, scored])
    warm = hot(tiny)
    warm.generate([prompt], plain)
    hits = warm.scheduler.num_prefix_hit_tokens
    assert outcome(warm, [prompt, prompt], [plain, scored]) == want
    assert warm.scheduler.num_prefix_hit_tokens - hits == 48  # the plain request's 3 whole blocks only
    assert len(warm.generate([prompt], scored)[0].prompt_logprobs) == len(prompt) - 1


def test_eviction_under_a_small_cache_keeps_hits_exact_and_frees_everything(tiny, monkeypatch) -> None:
    """Nine blocks per pool where the pool allows: entries pile up and are evicted before anyone is
    preempted, sequences are preempted holding blocks they share, holder counts are exact after
    every step, and nothing deadlocks."""
    prompts = shared_prompts(random.Random(5), 100, [100, 77, 100, 50], tails=20)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(len(prompts))]
    small = hot(tiny.with_engine(dataclasses.replace(tiny.engine_config, num_cache_blocks=9,
                                                     max_num_batched_tokens=32)))
    evictions = []
    evict, step = small.scheduler.prefix.evict, small.core.step
    monkeypatch.setattr(small.scheduler.prefix, "evict", lambda: evictions.append(1) or evict())
    monkeypatch.setattr(small.core, "step", lambda: (step(), check_holders(small))[0])
    want = outcome(tiny, prompts, params)
    assert outcome(small, prompts, params) == want
    assert outcome(small, prompts, params) == want
    assert evictions and small.scheduler.num_preemptions and small.scheduler.num_prefix_hits
    assert small.scheduler.prefix.entries, "the last entries stay cached"
    small.reset_prefix_cache()
    assert small.cache.num_free() == small.cache.num_blocks


def test_sample_traces_replayed_teacher_forced_prefill_each_shared_prefix_once(tiny, capsys) -> None:
    """Every fixture trace's turns, submitted together: the cache supplies >= 90 % of the prompt tokens
    a turn shares with an earlier one (prefix-trie count), with the outputs of a cold replay."""
    episodes = [e for path in TRACES for e in load_traces(path)[0]]
    engine = dataclasses.replace(tiny.engine_config, max_model_len=2048)
    warm = hot(tiny.with_engine(engine))
    runs = teacher_forced(warm, episodes, progress=False)
    cost = prefill_cost(runs)
    repeated, hit = cost.prompt_tokens - cost.unique_tokens, warm.scheduler.num_prefix_hit_tokens
    with capsys.disabled():
        print(f"\nprefix cache on {len(TRACES)} trace files ({sum(len(r.turns) for r in runs)} turns): "
              f"{cost.prompt_tokens} prompt tokens, {cost.unique_tokens} distinct, {repeated} repeated, "
              f"{hit} taken from the cache ({hit / repeated:.1%} of the repeated)")
    assert hit >= 0.9 * repeated
    cold = teacher_forced(tiny.with_engine(engine), episodes[:2], progress=False)
    assert [t.record for r in cold for t in r.turns] == [t.record for r in runs[:2] for t in r.turns]


def test_runs_count_prefix_hits_and_sweeps_cover_cold_and_hot(tmp_path) -> None:
    """stats.json counts the prompt tokens asked for and supplied (older files read as none); the
    invariance matrix and the default certify sweep compare the cache off and hot."""
    variant = {v.name: v for _, v in default_sweep().configurations()}["prefix-hot"]
    assert variant.warm and variant.engine.prefix_caching
    assert not {v.name: v for v in default_sweep().variants}["prefix-cold"].engine.prefix_caching
    assert {"prefix-cold", "prefix-hot"} <= {v.name for v in STANDARD_VARIANTS}
    suite = load_suite("smoke")
    record_run("preset:tiny", suite, dataclasses.replace(variant, engine=dataclasses.replace(
        variant.engine, max_model_len=512)), tmp_path / "run", progress=False)
    stats = read_stats(tmp_path / "run")
    assert stats["prefix_query_tokens"] > stats["prefix_hit_tokens"] > 0  # the warm pass cached every prompt
    assert prefix_summary(stats).startswith(f"prefix cache: {stats['prefix_hit_tokens']} of ")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / STATS_FILE).write_text('{"sessions": 1, "wall_s": 2.0, "preemptions": 0}')
    old = read_stats(tmp_path / "old")
    assert (old["prefix_hit_tokens"], old["prefix_query_tokens"]) == (0, 0)
    assert prefix_summary(old) == "prefix cache: 0 of 0 tokens of admitted requests taken from cached prefixes"


def test_prefix_caching_settings() -> None:
    assert EngineConfig().prefix_caching
    with pytest.raises(DeepInferError, match=r"^prefix_caching must be true or false, got 'yes'$"):
        EngineConfig(prefix_caching="yes")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert not config_from_flags(parser.parse_args(["--no-prefix-caching"])).prefix_caching
    with pytest.raises(DeepInferError, match=r"^sweep: 'warm' must be bool, got 1$"):
        variant_from_dict({"name": "w", "warm": 1}, "sweep")
