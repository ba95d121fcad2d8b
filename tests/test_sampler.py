"""Statistical check of the counter-based Gumbel-max sampler: with a fixed seed, the sampled
frequencies match softmax(logits / T) restricted to the tokens that top-k / top-p / min-p keep."""

from __future__ import annotations

import math

import pytest
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
    from deepinfer.engine.sampler import SamplingBatch, sample
    from sampling import OPS

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = logits[1].max()  # a tie: the lower id wins either way
    batch = SamplingBatch.from_tensors(SamplingBatch.host_tensors([(SamplingParams(temperature=0), 5, 9)] * 3))
    assert torch.equal(sample(logits, batch, OPS, greedy_only=True), sample(logits, batch, OPS))
