"""Pinned engine outputs: every token id and logprob bit of a mixed batch on the seeded `tiny` preset
(greedy and sampled requests, top-k / top-p / min-p, top logprobs, prompt logprobs, fp32 and bf16).

Seeds recorded by users must keep reproducing, so any change to the sampler, the kernels or the
model that moves one of these bits is a breaking change; after an intended one, regenerate with

    DEEPINFER_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_engine_golden.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from cpu_paths import bf16_refusal, code_path
from deepinfer import LLM, SamplingParams

GOLDEN_PATH = Path(__file__).parent / "golden" / "engine_vectors.json"
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, seed=2**40 + 3, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.8, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.3, min_p=0.05, top_k=20, seed=11, max_tokens=12, ignore_eos=True,
                   prompt_logprobs=True, logprobs=1),
    SamplingParams(temperature=0.5, top_p=0.95, min_p=0.01, seed=5, max_tokens=12, ignore_eos=True),
]


def _bits(values: list[float]) -> list[str]:
    return [float(v).hex() for v in values]


def _record(outputs) -> list[dict]:
    rows = []
    for out in outputs:
        detail = {
            "logprobs": _bits(out.logprobs),
            "top": [[(i, float(v).hex()) for i, v in top] for top in out.top_logprobs or []],
            "prompt": _bits(out.prompt_logprobs or []),
            "prompt_top": [[(i, float(v).hex()) for i, v in top] for top in out.prompt_top_logprobs or []],
        }
        digest = hashlib.sha256(json.dumps(detail, sort_keys=True).encode()).hexdigest()
        rows.append({"seed": out.seed, "token_ids": out.token_ids, "logprob_bits_sha256": digest})
    return rows


def _generate(dtype: str) -> list[dict]:
    llm = LLM("preset:tiny", dtype=dtype, seed=3, max_model_len=256)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in (5, 40, 17, 3, 33, 64)]
    return _record(llm.generate(prompts, PARAMS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pinned_tokens_and_logprob_bits(dtype):
    """Pinned per CPU code path (the bits depend on it, see tests/cpu_paths.py); a path with no pinned
    values is skipped and named, so regenerating on it adds its values beside the others."""
    if dtype == "bfloat16" and (refusal := bf16_refusal()):
        pytest.skip(f"the engine refuses bf16 on this CPU code path: {refusal}")
    key = f"{dtype} / {code_path(dtype)}"
    pinned = json.loads(GOLDEN_PATH.read_text()) if GOLDEN_PATH.exists() else {}
    got = _generate(dtype)
    if os.environ.get("DEEPINFER_REGEN_GOLDEN"):
        pinned[key] = got
        GOLDEN_PATH.write_text(json.dumps(pinned, indent=1) + "\n")
    if key not in pinned:
        pytest.skip(f"no values pinned for {key!r} (pinned: {', '.join(pinned)})")
    assert got == pinned[key]
