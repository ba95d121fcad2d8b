"""Speculative decoding changes speed, never outputs: with drafts verified in one step, every
request's token ids, logprob bits and top logprobs are those of plain decoding (greedy and seeded
sampling, V4 and V4.1, fp32 and bf16), whatever the drafts are, including when stop rules, the
token budget, max_tokens or preemption cut a run of held drafts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpu_paths import bf16_refusal
from deepinfer import LLM, EngineConfig, SamplingParams
from deepinfer.audit.certificate import CERTIFICATE, build_certificate, seal, verify_certificate, write_certificate
from deepinfer.audit.files import json_bytes
from deepinfer.audit.store import read_run
from deepinfer.engine.drafter import NgramDrafter
from deepinfer.engine.sequence import Sequence
from deepinfer.errors import DeepInferError
from deepinfer.harness.certify import speculation_summary
from deepinfer.harness.invariance import ReferenceDrafter, signature, standard_requests
from deepinfer.harness.record import record_run
from deepinfer.harness.run_writer import STATS_FILE, read_stats
from deepinfer.harness.suite_registry import load_suite
from deepinfer.harness.sweep import default_sweep


def _requests(count: int) -> list:
    return standard_requests(vocab_size=1024, count=count, max_tokens=16)


def _run(llm: LLM, requests, drafter=None) -> tuple[list, list]:
    if drafter is not None:
        llm.scheduler.drafter = drafter
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    return [signature(out) for out in outputs], outputs


def _speculating(llm: LLM, **settings) -> LLM:
    return llm.with_engine(replace(llm.engine_config, speculation="ngram", **settings))


@pytest.mark.parametrize("preset,dtype", [("tiny", "float32"), ("tiny", "bfloat16"),
                                          ("v41-tiny", "float32"), ("v41-tiny", "bfloat16")])
def test_outputs_are_the_same_bits_with_speculation_on_and_off(preset: str, dtype: str) -> None:
    if dtype == "bfloat16" and (refusal := bf16_refusal()):
        pytest.skip(f"the engine refuses bf16 on this CPU code path: {refusal}")
    requests = _requests(4)
    llm = LLM(f"preset:{preset}", dtype=dtype)
    reference, outputs = _run(llm, requests)
    streams = [r.prompt + out.token_ids for r, out in zip(requests, outputs)]
    for draft_tokens, wrong_every in ((1, 3), (3, 4), (5, 5)):
        spec = _speculating(llm, draft_tokens=draft_tokens)
        got, _ = _run(spec, requests, ReferenceDrafter(streams, wrong_every))
        assert got == reference, f"k={draft_tokens}: outputs changed with speculation"
        drafted, kept = spec.scheduler.num_drafted, spec.scheduler.num_draft_kept
        assert 0 < kept < drafted, f"k={draft_tokens}: {kept} of {drafted} drafts held (both paths must run)"


def test_held_drafts_cut_by_stop_rules_budget_and_preemption(tiny_checkpoint) -> None:
    """Perfect drafts run past a stop token, max_tokens and a stop string; a 4-token step budget
    caps the drafts; a cache of few blocks preempts sequences with drafts in flight."""
    llm = LLM(tiny_checkpoint)
    prompts = [r.prompt for r in _requests(8)]
    free = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)] * 8
    streams = [p + out.token_ids for p, out in zip(prompts, llm.generate(prompts, free))]
    outputs = [s[len(p):] for s, p in zip(streams, prompts)]
    text = llm.tokenizer.decode(outputs[2][:9]) if llm.tokenizer is not None else None
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[outputs[0][6]]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)] + free[4:]
    if text:
        params[2] = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[text[-3:]])
    reference = [signature(out) for out in llm.generate(prompts, params)]
    for settings in ({"draft_tokens": 5}, {"draft_tokens": 5, "max_num_batched_tokens": 4},
                     {"draft_tokens": 4, "num_cache_blocks": 6, "max_num_batched_tokens": 32}):
        spec = _speculating(llm, **settings)
        spec.scheduler.drafter = ReferenceDrafter(streams, wrong_every=10**9)
        got = [signature(out) for out in spec.generate(prompts, params)]
        assert got == reference, f"{settings}: outputs changed with speculation"
        assert spec.scheduler.num_draft_kept > 0
        if "num_cache_blocks" in settings:
            assert spec.scheduler.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_perfect_drafts_take_fewer_steps(tiny_checkpoint, async_scheduling: bool) -> None:
    """Synchronously, or queued behind the step in flight (drafted past the tokens it may keep)."""
    llm = LLM(tiny_checkpoint)
    prompt = _requests(1)[0].prompt
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stream = prompt + llm.generate([prompt], params)[0].token_ids
    spec = _speculating(llm, draft_tokens=5, async_scheduling=async_scheduling)
    spec.scheduler.drafter = ReferenceDrafter([stream], wrong_every=10**9)
    spec.add_request(prompt, params)
    steps = 0
    execute = spec.runner.execute

    def counting(scheduled, in_flight=None):
        nonlocal steps
        steps += 1
        return execute(scheduled, in_flight)

    spec.runner.execute = counting
    while spec.has_unfinished():
        spec.step()
    # the prompt's step draws token 1; then 6, 6, 6 tokens (5 drafts held + 1), then 5: max_tokens
    # leaves room for 4 drafts only
    assert steps == 1 + 4
    assert spec.scheduler.num_draft_kept == spec.scheduler.num_drafted == 5 * 3 + 4


def test_ngram_speculation_keeps_outputs_under_async_scheduling(tiny_checkpoint) -> None:
    """Prompt lookup on the standard requests (long random prompts: a generated token has often
    been seen before, so drafts are made, and nearly all are rejected), its steps queued behind each
    other (every fourth request is structured: those steps are read back at once)."""
    llm = LLM(tiny_checkpoint)
    spec = _speculating(llm)
    assert spec.engine_config.async_scheduling is True
    requests = _requests(8)
    assert _run(spec, requests)[0] == _run(llm, requests)[0]
    assert spec.scheduler.num_drafted > 0


@pytest.mark.parametrize("settings,message", [
    ({"speculation": "medusa"}, "unknown speculation 'medusa' (expected one of off, ngram, dspark, mtp)"),
    ({"draft_tokens": 0}, "draft_tokens must be a positive integer, got 0"),
    ({"draft_tokens": 1000}, "draft_tokens must be from 1 to 16 (a step verifies at most that many drafts per "
                             "sequence), got 1000"),
])
def test_bad_speculation_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(DeepInferError) as err:
        EngineConfig(**settings)
    assert str(err.value) == message


def _latest_continuation(ids: list[int], limit: int, max_ngram: int) -> list[int]:
    """What prompt lookup should propose, by brute force."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == ids[-n:]:
                return ids[start + n:start + n + limit]
    return []


@given(ids=st.lists(st.integers(0, 5), max_size=40), limit=st.integers(0, 6), every=st.integers(1, 7))
def test_ngram_drafter_proposes_what_followed_the_latest_longest_match(ids: list[int], limit: int, every: int) -> None:
    """Asked as the sequence grows (every `every` tokens, as decoding asks with drafts kept), and once
    after it shrank (a stop cuts it), the incremental index proposes what a search of the whole
    list finds."""
    drafter = NgramDrafter(max_ngram=3)
    seq = Sequence(0, ids[:1], SamplingParams(), 0)
    for length in [*range(1, len(ids) + 1, every), len(ids), len(ids) // 2]:
        seq.token_ids = ids[:length]
        assert drafter.propose(seq, limit) == _latest_continuation(ids[:length], limit, 3)


def test_a_recorded_run_counts_its_drafts_and_certify_says_what_they_did(tiny_checkpoint, tmp_path) -> None:
    """The smoke suite (chats quoting tool output: prompt lookup finds matches) under the default
    sweep's speculation variant: stats.json counts drafts made, kept and the chunks that carried
    them; a run recorded before those counters existed reads as none."""
    variant = {v.name: v for _, v in default_sweep().configurations()}["speculation"]
    record_run(tiny_checkpoint, load_suite("smoke"), variant, tmp_path / "run", progress=False)
    stats = read_stats(tmp_path / "run")
    assert stats["drafted"] > 0 and stats["verify_chunks"] > 0 and 0 <= stats["drafts_kept"] <= stats["drafted"]
    lengths = {int(k): n for k, n in stats["verify_lengths"].items()}
    assert sum(lengths.values()) == stats["verify_chunks"]
    assert sum(k * n for k, n in lengths.items()) == stats["drafted"] and max(lengths) <= variant.engine.draft_tokens
    assert speculation_summary(stats).startswith(f"speculation: {stats['drafts_kept']} of {stats['drafted']} drafts")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / STATS_FILE).write_text(json.dumps({"sessions": 1, "wall_s": 2.0, "preemptions": 0}))
    old = read_stats(tmp_path / "old")
    assert (old["drafted"], old["drafts_kept"], old["verify_chunks"]) == (0, 0, 0)
    assert speculation_summary(old) == "speculation: no drafts were proposed, so this configuration ran as plain decoding"
    assert speculation_summary({"drafted": 8, "drafts_kept": 6, "verify_chunks": 2}) == (
        "speculation: 6 of 8 drafts kept (75%), 4.00 tokens per step with drafts")
    _check_sealed_speculation(tmp_path, stats)


def _check_sealed_speculation(base, stats: dict) -> None:
    """A certificate over the speculating run states its figures; a figure changed in the certificate
    (resealed or not) or in the run's stats.json fails verification."""
    manifest = read_run(base / "run").manifest
    configurations = [{"name": name, "role": role, "config": manifest["variant"], "run": "run"}
                      for name, role in (("reference", "reference"), ("again", "variant"))]
    cert = seal(build_certificate(out_dir=base, reference="reference", configurations=configurations,
                                  suite=manifest["suite"], checkpoint=manifest["checkpoint"], rerun={}))
    figures = cert["configurations"][1]["speculation"]
    assert figures == {"drafted": stats["drafted"], "kept": stats["drafts_kept"], "verify_chunks": stats["verify_chunks"],
                       "rollbacks": stats["rollbacks"], "verify_lengths": stats["verify_lengths"],
                       "acceptance": round(stats["drafts_kept"] / stats["drafted"], 4),
                       "mean_accepted_length": round(stats["drafts_kept"] / stats["verify_chunks"], 4),
                       "tokens_per_forward": round(1 + stats["drafts_kept"] / stats["verify_chunks"], 4)}
    write_certificate(base / CERTIFICATE, cert)
    assert verify_certificate(base) == []
    tampered = json.loads(json.dumps(cert))
    tampered["configurations"][1]["speculation"]["kept"] += 1
    (base / CERTIFICATE).write_bytes(json_bytes(tampered))
    assert any("content hash does not match" in problem for problem in verify_certificate(base))
    write_certificate(base / CERTIFICATE, seal(tampered))
    [problem] = verify_certificate(base)
    assert problem.startswith("certificate.json: speculation figures of 'again' ")
    write_certificate(base / CERTIFICATE, cert)
    edited = {**stats, "rollbacks": stats["rollbacks"] + 1}
    (base / "run" / STATS_FILE).write_text(json.dumps(edited))
    assert [p.split(" {")[0] for p in verify_certificate(base)] == [
        "certificate.json: speculation figures of 'reference'", "certificate.json: speculation figures of 'again'"]
