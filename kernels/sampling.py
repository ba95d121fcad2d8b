"""The sampler's counter-based noise and argmax as op chains: the reference the CUDA tables' one-launch
kernels (`kernels.triton_fused.first_argmax` and `gumbel_argmax`) reproduce bit for bit.

The noise for (seed, position, token id) comes from an integer hash evaluated in int64 arithmetic, so
it is the same on every device and independent of batch composition: a request's draw at a position
never depends on anything but itself (`deepinfer.engine.sampler`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def noise_keys(seed_low: torch.Tensor, seed_high: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from the seed's two 32-bit halves and the token position (int64 [R])."""
    key = mix32(seed_low ^ mix32(seed_high))
    return mix32((key + positions * GOLDEN) & MASK32)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms strictly inside (0, 1), [R, vocab], one per (row key, token id).

    23 hash bits plus one half give values (k + 0.5) / 2**23, exactly representable in fp32 (24
    significant bits), never 0 or 1. (With 24 bits, k + 0.5 would need 25 bits and round: half the
    values would not be of that form and k = 2**24 - 1 would give exactly 1.0, an infinite Gumbel draw.)
    """
    ids = torch.arange(vocab, dtype=torch.long, device=keys.device)
    bits = mix32(((ids * GOLDEN) & MASK32).unsqueeze(0) ^ keys.unsqueeze(1)) >> 9
    return (bits.float() + 0.5) / float(1 << 23)


def first_argmax(values: torch.Tensor) -> torch.Tensor:
    """Per row of [R, V], the index of the maximum, ties to the lowest index (int64 [R]). A row
    holding NaN has no maximum and gives 0 (the runner reports such rows as non-finite)."""
    vocab = values.shape[-1]
    ids = torch.arange(vocab, device=values.device).expand_as(values)
    top = values.max(dim=-1, keepdim=True).values
    return torch.where(values == top, ids, vocab).min(dim=-1).values % vocab


def gumbel_argmax(logits: torch.Tensor, seed_low: torch.Tensor, seed_high: torch.Tensor, position: torch.Tensor,
                  temperature: torch.Tensor | None = None, *, log: Callable[[torch.Tensor], torch.Tensor]
                  ) -> torch.Tensor:
    """Per row of fp32 logits [R, V], the Gumbel-max draw: `first_argmax` of the logits plus
    -log(-log(u)), u the row's uniforms for (seed, position) (int64 [R] each). With `temperature` [R]
    the logits are divided by it first, and a row at temperature 0 is its greedy choice."""
    if temperature is not None:
        greedy = first_argmax(logits)
        logits = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    u = uniforms(noise_keys(seed_low, seed_high, position), logits.shape[-1])
    drawn = first_argmax(logits + -log(-log(u)))
    return drawn if temperature is None else torch.where(temperature > 0, drawn, greedy)
