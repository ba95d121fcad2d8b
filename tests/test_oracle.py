"""Numerical agreement with the public reference implementation (`transformers`' DeepseekV4ForCausalLM).

Our engine runs the model over paged caches; the oracle runs it as one dense forward. In fp32 on
CPU the logits must agree to 1e-4 at every position of a >= 300-token prompt, whether the engine
prefills the prompt in one step, in chunks, or token by token through the decode path.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import preset_config, write_weights
from deepinfer.checkpoint.random_init import RandomTensors
from deepinfer.families.v4.config import CSA, HCA, SLIDING
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPT_LEN = 320


def write_variant(folder: Path, seed: int, **changes) -> Path:
    """A checkpoint folder whose config is the tiny preset with `changes`."""
    config = dataclasses.replace(preset_config("tiny"), **changes)
    folder.mkdir(parents=True)
    write_weights(folder, RandomTensors(config, seed, torch.float32, include_mtp=False))
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return folder


@pytest.fixture(scope="module")
def oracle_checkpoints(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("oracle")
    return {
        "tiny": tiny_checkpoint,
        # every layer type twice over, an HCA ratio of 8, plain rope on the compressed branch,
        # hash routing in the middle of the stack and a narrow indexer choice
        "mixed": write_variant(
            root / "mixed", seed=1, num_hidden_layers=5, layer_types=[CSA, HCA, SLIDING, HCA, CSA],
            mlp_layer_types=["moe", "hash_moe", "moe", "moe", "hash_moe"], sliding_window=16,
            compress_rates={CSA: 4, HCA: 8}, index_topk=8,
            rope_parameters={**preset_config("tiny").rope_parameters,
                             "compress": {"rope_type": "default", "rope_theta": 40000.0,
                                          "partial_rotary_factor": 0.25}},
        ),
        # a wide window, long HCA windows, an indexer that keeps more entries, fewer Sinkhorn steps
        "wide": write_variant(
            root / "wide", seed=2, num_hidden_layers=3, layer_types=[HCA, CSA, SLIDING],
            mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=64, compress_rates={CSA: 4, HCA: 32},
            index_topk=40, hc_sinkhorn_iters=10, num_experts_per_tok=3,
        ),
    }


def reference_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def engine_logits(llm: LLM, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computing the prompt `chunk` tokens per step through the
    engine's own cache manager and runner."""
    seq = Sequence(0, ids, SamplingParams(temperature=0), seed=0)
    rows = []
    for start in range(0, len(ids), chunk):
        piece = ScheduledChunk(seq, start, min(chunk, len(ids) - start))
        llm.cache.grow(seq.blocks, piece.end)
        batch, _ = llm.runner.build_batch([piece])
        batch.sample_index = None
        rows.append(llm.model.logits(llm.model(batch, llm.cache.layer_views))[:piece.num_tokens])
        llm.cache.release_behind(seq.blocks, piece.end)
    llm.cache.free(seq.blocks)
    return torch.cat(rows)


@pytest.mark.parametrize("name", ["tiny", "mixed", "wide"])
def test_logits_match_transformers_in_prefill_chunks_and_decode(oracle_checkpoints, name):
    folder = oracle_checkpoints[name]
    ids = torch.randint(0, 1024, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    reference = reference_logits(folder, ids)
    llm = LLM(folder, max_num_batched_tokens=PROMPT_LEN, max_model_len=1024)
    for chunk in (PROMPT_LEN, 37, 1):
        drift = (engine_logits(llm, ids, chunk) - reference).abs().max().item()
        assert drift <= TOLERANCE, f"{name}: chunk {chunk} drifts {drift:.2e} from transformers"


PROMPT_LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 64, 100, 128, 129, 200, 300, 400]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def greedy_case(tiny_checkpoint):
    """16 prompts of mixed lengths and transformers' greedy continuation of each, run alone."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )
        expected.append(out[0, len(prompt):].tolist())
    return prompts, expected


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 1024},
        # slow: the invariance matrix (tests/test_invariance.py) holds every request's bits across these
        # schedules, so they agree with transformers wherever the one-batch engine does
        pytest.param({"max_num_batched_tokens": 16}, marks=pytest.mark.slow),
        pytest.param({"max_num_batched_tokens": 64}, marks=pytest.mark.slow),
        pytest.param({"max_num_batched_tokens": 64, "max_model_len": 512, "num_cache_blocks": 12},
                     marks=pytest.mark.slow),
    ],
    ids=["one-batch", "chunk16", "chunk64", "preemption"],
)
def test_batched_greedy_generation_matches_transformers_alone(tiny_checkpoint, greedy_case, engine_args):
    prompts, expected = greedy_case
    llm = LLM(tiny_checkpoint, max_num_seqs=16, **engine_args)
    outputs = llm.generate(prompts, GREEDY)
    for prompt, want, got in zip(prompts, expected, outputs):
        assert got.token_ids == want, f"prompt of {len(prompt)} tokens diverges"
    if "num_cache_blocks" in engine_args:
        assert llm.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
