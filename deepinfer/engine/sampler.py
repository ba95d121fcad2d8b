"""Token choice from logits: greedy, or Gumbel-max with counter-based noise.

The noise for (seed, position, token id) comes from an integer hash evaluated in int64
arithmetic, so it is the same on every device and independent of batch composition, arrival
order or preemption: a request's draw at a position never depends on anything but itself.
"""

from __future__ import annotations

import torch

import kernels
from deepinfer.sampling_params import SamplingParams

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    """Uniforms strictly inside (0, 1), one per token id, for one (seed, position).

    23 hash bits plus one half give values (k + 0.5) / 2**23, exactly representable in fp32 (24
    significant bits), never 0 or 1. (With 24 bits, k + 0.5 would need 25 bits and round: half the
    values would not be of that form and k = 2**24 - 1 would give exactly 1.0, an infinite Gumbel draw.)
    """
    key = mix32(torch.tensor([seed & MASK32], dtype=torch.long) ^ mix32(torch.tensor([seed >> 32], dtype=torch.long)))
    key = mix32((key + position * GOLDEN) & MASK32).to(device)
    ids = torch.arange(vocab, dtype=torch.long, device=device)
    bits = mix32(((ids * GOLDEN) & MASK32) ^ key) >> 9
    return (bits.float() + 0.5) / float(1 << 23)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with tokens outside top-k / top-p / min-p set to -inf."""
    scaled = logits / params.temperature
    order = torch.sort(scaled, descending=True, stable=True).indices
    keep = torch.ones_like(scaled, dtype=torch.bool)
    ranked_keep = torch.ones(scaled.shape[0], dtype=torch.bool, device=scaled.device)
    if params.top_k:
        ranked_keep[params.top_k:] = False
    probs = kernels.softmax(scaled[order])
    if params.top_p < 1.0:
        before = torch.cumsum(probs, dim=0) - probs
        ranked_keep &= before < params.top_p
    if params.min_p > 0.0:
        ranked_keep &= probs >= params.min_p * probs[0]
    ranked_keep[0] = True
    keep[order] = ranked_keep
    return scaled.masked_fill(~keep, float("-inf"))


def first_argmax(values: torch.Tensor) -> int:
    """Index of the maximum, ties to the lowest index."""
    return int((values == values.max()).nonzero()[0, 0])


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Choose the token at `position` (the index the token will have in the sequence)."""
    if params.temperature == 0:
        return first_argmax(logits)
    scaled = filtered_logits(logits, params)
    u = uniform_noise(seed, position, logits.shape[0], logits.device)
    gumbel = -torch.log(-torch.log(u))
    return first_argmax(scaled + gumbel)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens, ties to the lower id."""
    order = torch.sort(logprobs, descending=True, stable=True).indices[:k]
    return [(int(i), float(logprobs[i])) for i in order]
