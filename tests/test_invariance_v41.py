"""The determinism contract on CPU for V4.1 (every CSA2 role, Engram, the cache formats on): the
matrix of tests/test_invariance.py, in a file of its own so that the suite's workers run the two
families' matrices side by side."""

from __future__ import annotations

import pytest

from cpu_paths import bf16_refusal
from deepinfer.harness.invariance import model_variants, run_matrix, standard_requests
from deepinfer.harness.sweep import Variant
from test_invariance import DRAFT_MODEL


@pytest.fixture(scope="module")
def v41_requests():
    """Half the standard set (each prompt length once), to keep V4.1's six layers within the CI budget:
    the first half; the fp32 matrix serves the second (its structured rows are the llguidance ones)."""
    return standard_requests(vocab_size=1024, count=12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_v41_is_bitwise_invariant(v41_requests, dtype):
    """The same matrix on V4.1 (every CSA2 role, Engram, the cache formats on)."""
    if dtype == "bfloat16" and (refusal := bf16_refusal()):
        pytest.skip(f"the engine refuses bf16 on this CPU code path: {refusal}")
    variants = model_variants("preset:v41-tiny")
    assert DRAFT_MODEL <= {v.name for v in variants}
    served = standard_requests(vocab_size=1024, count=24)[12:] if dtype == "float32" else v41_requests
    result = run_matrix("preset:v41-tiny", served, variants, dtype=dtype, numerics="batch_invariant")
    assert set(result.diverged) == {v.name for v in variants[1:]}
    assert result.invariant, f"{dtype}: requests diverged from {result.reference}: {result.diverged}"


def test_v41_fast_mode_diverges_somewhere_in_bf16(v41_requests):
    variants = (Variant.of("all-at-once"), Variant.of("batch-1", max_num_seqs=1), Variant.of("chunk-16", max_num_batched_tokens=16))
    result = run_matrix("preset:v41-tiny", v41_requests, variants, dtype="bfloat16", numerics="fast", stop_at_first=True)
    assert not result.invariant
