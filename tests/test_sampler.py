"""Statistical check of the counter-based Gumbel-max sampler: with a fixed seed, the sampled
frequencies match softmax(logits / T) restricted to the tokens that top-k / top-p / min-p keep."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from deepinfer.sampling_params import SamplingParams
from sampling import filter_one, sample_one, sample_positions


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value of chi-square at p ~ 0.001 (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.2, min_p=0.05, top_k=10),
    ],
    ids=["plain", "top-k", "top-p", "min-p+top-k"],
)
def test_sampled_frequencies_match_the_filtered_softmax(params):
    logits = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 1.5
    kept = filter_one(logits, params)
    expected = torch.softmax(kept, dim=0)
    draws = 12_000
    tokens = sample_positions(logits, params, seed=2024, positions=range(draws))
    assert tokens[:50] == [sample_one(logits, params, seed=2024, position=p) for p in range(50)]
    counts = torch.bincount(torch.tensor(tokens), minlength=16).float()
    support = expected > 0
    assert counts[~support].sum() == 0, "a filtered-out token was sampled"
    observed, wanted = counts[support], expected[support] * draws
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    assert statistic < chi_square_critical(int(support.sum()) - 1), f"chi-square {statistic:.1f}"


def test_the_greedy_only_shortcut_chooses_as_the_full_path():
    from deepinfer.engine.sampler import SamplingBatch, SamplingNeeds, sample
    from sampling import OPS

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = logits[1].max()  # a tie: the lower id wins either way
    params = [SamplingParams(temperature=0)] * 3
    batch = SamplingBatch.from_tensors(SamplingBatch.host_tensors([(p, 5, 9) for p in params]))
    assert SamplingNeeds.of(params) == SamplingNeeds(greedy_only=True, filtering=False)
    assert torch.equal(sample(logits, batch, OPS, SamplingNeeds.of(params)), sample(logits, batch, OPS))


@settings(max_examples=40, deadline=None)
@given(temperatures=st.lists(st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.7]), min_size=1, max_size=5),
       seed=st.integers(0, 2**40), position=st.integers(0, 10**6))
def test_skipping_the_filter_no_row_uses_chooses_as_the_full_path(temperatures, seed, position):
    """Without top-k / top-p / min-p in any row, the sort over the vocabulary is skipped: the same draws."""
    from deepinfer.engine.sampler import SamplingBatch, SamplingNeeds, sample
    from sampling import OPS

    params = [SamplingParams(temperature=t, seed=seed) for t in temperatures]
    needs = SamplingNeeds.of(params)
    assert needs == SamplingNeeds(greedy_only=all(t == 0 for t in temperatures), filtering=False)
    logits = torch.randn(len(params), 512, generator=torch.Generator().manual_seed(seed % 1000)) * 4
    logits[:, 100] = logits[:, 3]  # ties
    batch = SamplingBatch.from_tensors(SamplingBatch.host_tensors([(p, seed + i, position) for i, p in enumerate(params)]))
    assert torch.equal(sample(logits, batch, OPS, needs), sample(logits, batch, OPS))


def test_a_row_that_filters_makes_the_step_filter():
    from deepinfer.engine.sampler import SamplingNeeds

    plain = SamplingParams(temperature=0.7)
    for filtering in (SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.7, top_p=0.9),
                      SamplingParams(temperature=0.7, min_p=0.1)):
        assert SamplingNeeds.of([plain, filtering]) == SamplingNeeds(greedy_only=False, filtering=True)
    # a greedy row's top-k filters nothing it draws
    assert SamplingNeeds.of([plain, SamplingParams(temperature=0, top_k=5)]) == SamplingNeeds(False, False)
