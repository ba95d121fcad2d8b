"""The sampler on one row, for tests that reason about a single distribution."""

from __future__ import annotations

import torch

import kernels
from deepinfer.engine.sampler import SamplingBatch, filtered_logits, sample
from deepinfer.sampling_params import SamplingParams

OPS = kernels.bind("batch_invariant", "cpu")


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token the sampler draws from logits [V] at (seed, position)."""
    return int(sample(logits.unsqueeze(0), SamplingBatch.of(params, seed, position), OPS)[0])


def filter_one(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] after the temperature and the top-k / top-p / min-p filters."""
    return filtered_logits(logits.unsqueeze(0), SamplingBatch.of(params, 0, 0), OPS)[0]
