"""The sampler on one row, for tests that reason about a single distribution."""

from __future__ import annotations

import torch

from deepinfer import kernels
from deepinfer.engine.sampler import SamplingBatch, filtered_logits, sample
from deepinfer.sampling_params import SamplingParams

OPS = kernels.bind("batch_invariant", "cpu")


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token the sampler draws from logits [V] at (seed, position)."""
    return int(sample(logits.unsqueeze(0), SamplingBatch.of(params, seed, position), OPS)[0])


def sample_positions(logits: torch.Tensor, params: SamplingParams, seed: int, positions: range) -> list[int]:
    """The tokens the sampler draws from logits [V] at (seed, p) for each p in `positions`, as one batch
    of identical rows: rows are sampled independently, so each is `sample_one(logits, params, seed, p)`
    (callers check a few), at a fraction of the cost of one call per draw."""
    rows = [(params, seed, position) for position in positions]
    batch = SamplingBatch.from_tensors(SamplingBatch.host_tensors(rows))
    return sample(logits.repeat(len(rows), 1), batch, OPS).tolist()


def filter_one(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] after the temperature and the top-k / top-p / min-p filters."""
    return filtered_logits(logits.unsqueeze(0), SamplingBatch.of(params, 0, 0), OPS)[0]
