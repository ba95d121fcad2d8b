"""Async scheduling (`EngineConfig.async_scheduling`): step t + 1 is scheduled and queued before step
t's tokens are read, with placeholders for them resolved on the device.

- outputs are bitwise those of synchronous scheduling, whatever the mix of requests, stops, chunked
  prefill, prompt logprobs and preemption (hypothesis), for V4 and for V4.1 with Engram (whose
  compressed ids and lookback take the placeholders too) and stop strings;
- a request is never scheduled past max_tokens, and one that stops early costs at most one discarded
  step; every cache block is free at the end;
- Engram tables in host memory need the tokens on the host, so those engines run synchronously (and
  record that they did);
- speculative steps are queued behind each other, the next step verifying drafts still on the device
  (a device drafter's, or prompt lookup's past the tokens the step in flight kept) at positions the
  device moves on by the drafts kept: plain decoding's bits with drafts that hold (MTP; DSpark and
  prompt lookup with Engram), under both verify policies.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, EngineConfig, RequestOutput, SamplingParams
from deepinfer.engine.config import add_engine_flags, config_from_flags
from deepinfer.errors import DeepInferError
from deepinfer.harness.invariance import ReferenceDrafter, ReferenceDrafts

SYNC = EngineConfig(max_model_len=128, async_scheduling=False)
TIMING = {f.name for f in dataclasses.fields(RequestOutput) if not f.compare}  # timing, not output


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("preset:tiny", SYNC)


@pytest.fixture(scope="module")
def v41_tiny() -> LLM:
    return LLM("preset:v41-tiny", SYNC)


def outcome(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Every output field that async scheduling must not change, in prompt order."""
    llm.reset_prefix_cache()
    free = llm.cache.num_free()
    outputs = llm.generate(prompts, params)
    llm.reset_prefix_cache()  # the blocks only cached prefixes hold
    assert llm.cache.num_free() == free, "blocks were left allocated"
    skip = TIMING | {"request_id"}  # ids count the engine's requests so far
    return [tuple(v for k, v in dataclasses.asdict(o).items() if k not in skip) for o in outputs]


def both(model: LLM, config: EngineConfig) -> tuple[LLM, LLM]:
    """Engines over `model`'s weights as `config` says, reading results synchronously and asynchronously."""
    return (model.with_engine(dataclasses.replace(config, async_scheduling=False)),
            model.with_engine(dataclasses.replace(config, async_scheduling=True)))


request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(2, 1023), min_size=1, max_size=40),
    "max_tokens": st.integers(1, 20),
    "temperature": st.sampled_from([0.0, 0.9]),
    "logprobs": st.sampled_from([None, 2]),
    "prompt_logprobs": st.booleans(),
    "stop_token_ids": st.lists(st.integers(2, 1023), max_size=40),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=6), budget=st.sampled_from([8, 24, 256]),
       blocks=st.sampled_from([None, 24]), seed=st.integers(0, 3))
def test_async_outputs_are_the_synchronous_ones(tiny, requests, budget, blocks, seed):
    config = dataclasses.replace(SYNC, max_num_batched_tokens=budget, block_size=4, num_cache_blocks=blocks)
    sync, overlapped = both(tiny, config)
    prompts = [r["prompt"] for r in requests]
    params = [SamplingParams(seed=seed + i, **{k: v for k, v in r.items() if k != "prompt"})
              for i, r in enumerate(requests)]
    assert outcome(overlapped, prompts, params) == outcome(sync, prompts, params)


def test_small_caches_preempt_requests_with_tokens_in_flight(tiny):
    """Preemption picks sequences whose last token is still a placeholder; recomputing them resolves it."""
    config = dataclasses.replace(SYNC, max_num_batched_tokens=16, block_size=4, num_cache_blocks=24)
    sync, overlapped = both(tiny, config)
    prompts = [list(range(2, 30 + 5 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20 + 3 * i, logprobs=2,
                             prompt_logprobs=bool(i % 2)) for i in range(6)]
    assert outcome(overlapped, prompts, params) == outcome(sync, prompts, params)
    assert overlapped.scheduler.num_preemptions > 0


def test_engram_and_stop_strings_match_synchronous_scheduling(v41_tiny):
    sync, overlapped = both(v41_tiny, dataclasses.replace(SYNC, max_num_batched_tokens=32))
    prompts = ["The quick brown fox", "Reproducible inference means", "1 2 3 4 5 6", "Once"]
    free = [SamplingParams(temperature=0.9, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    text = sync.generate(prompts, free)[1].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a string the second request is known to produce
    assert stop.strip(), f"no usable stop string in {text!r}"
    params = [dataclasses.replace(p, stop=[stop], ignore_eos=False) for p in free]
    want = outcome(sync, prompts, params)
    assert outcome(overlapped, prompts, params) == want
    assert sync.generate(prompts[1:2], params[1:2])[0].finish_reason == "stop"


def sampling_rows_per_request(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[int, int]:
    """How many tokens the engine sampled for each request (discarded ones included)."""
    counts: dict[int, int] = {}
    execute = llm.runner.execute

    def counting(scheduled, in_flight=None):
        for chunk in scheduled.sampling:
            counts[chunk.seq.request_id] = counts.get(chunk.seq.request_id, 0) + 1
        return execute(scheduled, in_flight)

    llm.runner.execute = counting
    try:
        outputs = llm.generate(prompts, params)
    finally:
        del llm.runner.execute
    return {o.request_id: (counts[o.request_id], len(o.token_ids)) for o in outputs}


def test_length_limits_cost_no_step_and_stops_at_most_one(tiny):
    sync, overlapped = both(tiny, SYNC)
    prompts = [list(range(2, 12)), list(range(20, 40)), list(range(50, 53))]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 7, 15)]
    for llm in (sync, overlapped):
        rows = sampling_rows_per_request(llm, prompts, greedy)
        assert [rows[i] for i in sorted(rows)] == [(1, 1), (7, 7), (15, 15)]
    produced = sync.generate(prompts, greedy)
    stops = [SamplingParams(temperature=0, max_tokens=15, stop_token_ids=[o.token_ids[-1]]) for o in produced]
    for llm, waste in ((sync, 0), (overlapped, 1)):
        rows = sampling_rows_per_request(llm, prompts, stops)
        for sampled, kept in rows.values():
            assert kept <= sampled <= kept + waste


def test_host_engram_tables_run_synchronously(v41_tiny):
    host = LLM("preset:v41-tiny", max_model_len=128, engram_tables="host")
    assert host.engine_config.async_scheduling is False  # what ran is what the run records
    prompts = [[2, 3, 4, 5], [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    overlapped = v41_tiny.with_engine(dataclasses.replace(SYNC, async_scheduling=True))
    assert overlapped.engine_config.async_scheduling is True
    assert outcome(host, prompts, [params] * 2) == outcome(overlapped, prompts, [params] * 2)


def test_the_flag_and_its_validation():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert config_from_flags(parser.parse_args([])).async_scheduling is True
    assert config_from_flags(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    with pytest.raises(DeepInferError, match="^async_scheduling must be true or false, got 'no'$"):
        EngineConfig(async_scheduling="no")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny", "v41-tiny"])
def test_cuda_async_steps_replayed_from_graphs_match_synchronous_ones(preset):
    """On CUDA the placeholders resolve inside steps replayed from graphs, and results come down
    through pinned memory behind the next step's work."""
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=256, max_num_batched_tokens=24,
                          async_scheduling=False)
    sync, overlapped = both(LLM(f"preset:{preset}", config), config)
    prompts = [[2 + (i * 7 + j) % 900 for j in range(n)] for i, n in enumerate((10, 37, 5, 21, 64, 3))]
    produced = sync.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = [SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=10 + 5 * i, logprobs=2,
                             prompt_logprobs=i == 1, stop_token_ids=[o.token_ids[8 + i]])
              for i, o in enumerate(produced)]
    assert outcome(overlapped, prompts, params) == outcome(sync, prompts, params)
    assert overlapped.runner.graphs  # decode steps were replayed


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_that_fails_to_run_is_redone_by_the_next(tiny, async_scheduling):
    """A step whose execution raises (out of device memory, say) leaves its sequences as they were
    before it was scheduled, and the step in flight still lands: stepping on gives the same outputs."""
    config = dataclasses.replace(SYNC, max_num_batched_tokens=24, async_scheduling=async_scheduling)
    prompts = [list(range(2, 40)), list(range(50, 57)), list(range(60, 90))]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=9, logprobs=1, prompt_logprobs=True,
                             stop_token_ids=[100 + i]) for i in range(3)]
    want = outcome(tiny.with_engine(config), prompts, params)
    llm = tiny.with_engine(config)
    execute, calls, failures = llm.runner.execute, [], []

    def flaky(scheduled, in_flight=None):
        calls.append(len(calls))
        if len(calls) in (2, 3, 6):  # prefill chunks, then a decode step
            raise RuntimeError("device busy")
        return execute(scheduled, in_flight)

    llm.runner.execute = flaky
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while llm.has_unfinished():
        try:
            done.update((o.request_id, o) for o in llm.step())
        except RuntimeError as err:
            failures.append(str(err))
    assert failures == ["device busy"] * 3
    skip = TIMING | {"request_id"}
    got = [tuple(v for k, v in dataclasses.asdict(done[i]).items() if k not in skip) for i in ids]
    assert got == want
    llm.reset_prefix_cache()
    assert llm.cache.num_free() == tiny.with_engine(config).cache.num_free()


def reference_drafting(llm: LLM, streams: dict[int, list[int]], wrong_every: int) -> list[int]:
    """Make `llm`'s drafter draft from `streams` (by request seed): its device drafter
    (`ReferenceDrafts`), or for prompt lookup a host one (`ReferenceDrafter`). The list it returns
    counts, as steps run, the drafts kept by the step in flight when the next one was queued (each such
    step laid out its chunks at positions the device moved on)."""
    if llm.runner.drafts is not None:
        llm.runner.drafts = ReferenceDrafts(llm.runner.drafts, streams, wrong_every, llm.runner.device)
    else:
        llm.scheduler.drafter = ReferenceDrafter(list(streams.values()), wrong_every)
    shifted = []
    execute = llm.runner.execute

    def counting(scheduled, in_flight=None):
        if in_flight is not None:
            shifted.append(int((in_flight.num_accepted - 1).sum()))
        return execute(scheduled, in_flight)

    llm.runner.execute = counting
    return shifted


SPECULATION_PRESETS = [("tiny", "mtp"), ("v41-tiny", "dspark"), ("v41-tiny", "ngram")]


def queued_speculation(model: LLM, speculation: str, **settings) -> LLM:
    """Check that `model` with `speculation` (3 drafts, as `settings` say further) under async scheduling,
    its device drafter drafting known continuations (every third position wrong), gives plain decoding's
    outputs bit for bit with greedy and seeded sampling, logprobs, prompt logprobs, a stop token and
    length limits, with steps queued behind drafts that held and rollbacks; the engine it ran."""
    prompts = [list(range(2, 9)), [(7 * i) % 900 + 3 for i in range(45)], [5, 6, 7], list(range(60, 90))]
    free = [SamplingParams(temperature=t, seed=11 + i, max_tokens=m, logprobs=2, prompt_logprobs=i == 1,
                           ignore_eos=True) for i, (t, m) in enumerate([(0, 30), (0.9, 25), (0.8, 40), (0, 7)])]
    plain = model.with_engine(dataclasses.replace(model.engine_config, async_scheduling=False))
    reference = plain.generate(prompts, free)
    params = list(free)
    params[2] = dataclasses.replace(free[2], stop_token_ids=[reference[2].token_ids[17]], ignore_eos=False)
    want = outcome(plain, prompts, params)
    streams = {p.seed: prompt + out.token_ids for p, prompt, out in zip(free, prompts, reference)}
    spec = model.with_engine(dataclasses.replace(model.engine_config, speculation=speculation, draft_tokens=3,
                                                 async_scheduling=True, **settings))
    shifted = reference_drafting(spec, streams, wrong_every=3)
    assert outcome(spec, prompts, params) == want
    assert spec.engine_config.async_scheduling and sum(shifted) > 0, "no step was queued behind drafts that held"
    assert spec.scheduler.num_rollbacks > 0
    return spec


@pytest.mark.parametrize("preset, speculation", SPECULATION_PRESETS)
@pytest.mark.parametrize("policy", ["fixed", "throughput"])
def test_speculative_steps_queued_behind_each_other_decode_as_plain_steps(tiny, v41_tiny, preset, speculation,
                                                                          policy):
    """Drafts are verified by the step queued behind the one whose tokens they follow, at positions the
    device moves on by the drafts kept (for V4.1 with Engram's lookback too), in a cache
    small enough to preempt sequences with drafts in flight: plain decoding's bits."""
    model = (tiny if preset == "tiny" else v41_tiny).with_engine(dataclasses.replace(SYNC, block_size=4))
    spec = queued_speculation(model, speculation, verify_policy=policy, num_cache_blocks=24,
                              max_num_batched_tokens=32)
    assert spec.scheduler.num_preemptions > 0


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=5), budget=st.sampled_from([6, 24, 256]),
       blocks=st.sampled_from([None, 20]), draft_tokens=st.integers(1, 4), wrong_every=st.sampled_from([2, 3, 5]),
       speculation=st.sampled_from(["mtp", "ngram"]), policy=st.sampled_from(["fixed", "throughput"]))
def test_queued_speculation_keeps_the_synchronous_outputs(tiny, requests, budget, blocks, draft_tokens, wrong_every,
                                                          speculation, policy):
    """Any mix of requests, stops, budgets that cut drafts and caches that preempt: speculative steps
    queued behind each other, their drafts holding where known continuations say, give the outputs
    of synchronous plain decoding."""
    config = dataclasses.replace(SYNC, max_num_batched_tokens=budget, block_size=4, num_cache_blocks=blocks)
    plain = tiny.with_engine(config)
    prompts = [r["prompt"] for r in requests]
    params = [SamplingParams(seed=100 + i, **{k: v for k, v in r.items() if k != "prompt"})
              for i, r in enumerate(requests)]
    reference = plain.generate(prompts, params)
    want = outcome(plain, prompts, params)
    spec = tiny.with_engine(dataclasses.replace(config, speculation=speculation, draft_tokens=draft_tokens,
                                                verify_policy=policy, async_scheduling=True))
    reference_drafting(spec, {p.seed: prompt + out.token_ids for p, prompt, out in zip(params, prompts, reference)},
                       wrong_every)
    assert outcome(spec, prompts, params) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset, speculation", SPECULATION_PRESETS)
def test_cuda_speculative_steps_queued_from_graphs_decode_as_plain_steps(preset, speculation):
    """On CUDA the drafts held on the device feed the next step's graph replay, and a model drafter's
    own graph reads the moved positions (prompt lookup has no drafter pass)."""
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=256, async_scheduling=False)
    spec = queued_speculation(LLM(f"preset:{preset}", config), speculation)
    assert spec.runner.graphs  # verify steps were replayed
    assert bool(spec.runner.draft_graphs) == (speculation != "ngram")  # and so were the drafter's passes
