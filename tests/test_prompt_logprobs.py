"""Tests for prompt logprobs (`SamplingParams(prompt_logprobs=True)`), what lm-eval's loglikelihood needs.

The logprob of every prompt token after the first must come out bit for bit the same whatever the
batch size, the chunked-prefill size or preemption, and must equal the logprob the engine reports
when it generates that same token itself.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.engine.scheduler import scored_positions
from deepinfer.engine.sequence import Sequence
from deepinfer.sampling_params import SamplingParamsError

VOCAB = 1024  # the tiny preset's vocabulary
LENGTHS = [1, 2, 9, 17, 40, 70, 130, 200]


def prompts(seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampling, with and without top-2, some generating several tokens (so that
    they are still running, holding cache, when the small cache forces preemption)."""
    out = []
    for i in range(len(LENGTHS)):
        sampled = dict(temperature=0.8, seed=100 + i) if i % 2 else dict(temperature=0)
        out.append(SamplingParams(**sampled, max_tokens=1 if i % 3 == 0 else 40, ignore_eos=True,
                                  logprobs=2 if i % 4 < 2 else None, prompt_logprobs=True))
    return out


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<f", v) for v in values]


def signature(out: RequestOutput) -> tuple:
    top = [[(i, struct.pack("<f", lp)) for i, lp in row] for row in out.prompt_top_logprobs]
    return out.token_ids, bits(out.logprobs), bits(out.prompt_logprobs), top


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> list[RequestOutput]:
    return LLM(tiny_checkpoint, max_num_seqs=32, max_num_batched_tokens=512).generate(prompts(), mixed_params())


def test_prompt_logprobs_must_be_a_bool():
    with pytest.raises(SamplingParamsError,
                       match=f"^{re.escape('invalid sampling params: prompt_logprobs must be true or false, got 1')}$"):
        SamplingParams(prompt_logprobs=1)


def test_one_logprob_per_prompt_token_after_the_first(reference):
    for prompt, params, out in zip(prompts(), mixed_params(), reference):
        assert len(out.prompt_logprobs) == len(prompt) - 1
        assert len(out.prompt_top_logprobs) == len(prompt) - 1
        k = max(params.logprobs or 0, 1)
        for chosen, top in zip(out.prompt_logprobs, out.prompt_top_logprobs):
            assert len(top) == k
            assert chosen <= top[0][1] <= 0.0
            assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_without_the_flag_there_are_no_prompt_logprobs(tiny_checkpoint):
    out = LLM(tiny_checkpoint).generate([prompts()[3]], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_logprobs is None and out.prompt_top_logprobs is None


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_seqs": 1},
        {"max_num_seqs": 8},
        {"max_num_batched_tokens": 16},
        {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512, "num_cache_blocks": 9},
    ],
    ids=["batch-1", "batch-8", "chunk-16", "preemption"],
)
def test_bitwise_identical_across_batching_chunking_and_preemption(tiny_checkpoint, reference, engine_args):
    llm = LLM(tiny_checkpoint, **engine_args)
    got = llm.generate(prompts(), mixed_params())
    for prompt, want, out in zip(prompts(), reference, got):
        assert signature(out) == signature(want), f"prompt of {len(prompt)} tokens differs"
    if "num_cache_blocks" in engine_args:
        assert llm.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"


def test_recomputed_chunks_do_not_score_the_prompt_twice():
    seq = Sequence(0, list(range(2, 12)), SamplingParams(prompt_logprobs=True), seed=0)
    assert scored_positions(seq, 0, 4) == range(0, 4)
    seq.num_scored = 6  # scored up to position 5 (results maybe still in flight), then preempted: recomputed from 0
    assert scored_positions(seq, 0, 4) == range(0, 0)
    assert scored_positions(seq, 4, 10) == range(6, 9)  # the last prompt token scores nothing
    seq.token_ids.append(7)  # a generated token is never scored as prompt
    assert scored_positions(seq, 9, 11) == range(9, 9)


def test_refed_greedy_continuation_scores_exactly_as_generated(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_num_batched_tokens=32)
    prompt_ids = prompts()[4]
    generated = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    scored = llm.generate([prompt_ids + generated.token_ids],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True))[0]
    tail = slice(len(prompt_ids) - 1, None)
    assert bits(scored.prompt_logprobs[tail]) == bits(generated.logprobs)
    assert [top[0][0] for top in scored.prompt_top_logprobs[tail]] == generated.token_ids  # all greedy


def test_prompt_logprobs_match_transformers(tiny_checkpoint):
    transformers = pytest.importorskip("transformers")
    ids = prompts()[-1]
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = logprobs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    got = LLM(tiny_checkpoint).generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True))[0]
    assert (torch.tensor(got.prompt_logprobs) - want).abs().max().item() <= 1e-4
