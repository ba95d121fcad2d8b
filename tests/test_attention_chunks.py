"""Attention gathers each query's keys (and, in index layers, the index keys of every entry it may
see); `deepinfer.model.batch.query_chunks` splits a step's queries into row chunks whose gathers fit
`READ_BUDGET_BYTES`, so memory stays bounded at any step size and context. Rows are independent, so
a request's tokens and logprob bits are the same however its queries are chunked."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model import batch as batch_module
from deepinfer.model.batch import query_chunks


def test_query_chunks_cover_the_rows_in_order_within_the_budget(monkeypatch):
    monkeypatch.setattr(batch_module, "READ_BUDGET_BYTES", 1000)
    assert query_chunks(10, 300) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert query_chunks(2, 10_000) == [slice(0, 1), slice(1, 2)]  # a row over budget still runs, alone
    assert query_chunks(7, 100) == [slice(0, 7)]
    assert query_chunks(0, 100) == [slice(0, 0)]


@pytest.mark.parametrize("preset", ["tiny", "v41-tiny"])
@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "bfloat16"), ("cuda", "bfloat16")])
def test_chunked_queries_give_the_bits_of_whole_steps(monkeypatch, preset, device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(f"preset:{preset}", device=device, dtype=dtype, max_model_len=256, max_num_batched_tokens=256)
    prompts = [[2 + (5 * i + j) % 900 for j in range(n)] for i, n in enumerate((70, 9, 41))]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=True)

    def run() -> list[tuple]:
        return [(o.token_ids, o.logprobs, o.top_logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params)]

    whole = run()
    chunked: list[int] = []
    chunks = batch_module.query_chunks
    monkeypatch.setattr(batch_module, "READ_BUDGET_BYTES", 1)  # one query per chunk
    monkeypatch.setattr(batch_module, "query_chunks", lambda tokens, row_bytes: chunked.append(tokens)
                        or chunks(tokens, row_bytes))
    for module in ("deepinfer.families.v4.attention", "deepinfer.families.v41.csa2"):
        monkeypatch.setattr(f"{module}.query_chunks", batch_module.query_chunks)
    assert run() == whole
    assert max(chunked) > 100  # the prefill steps' queries ran one by one
