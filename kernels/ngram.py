"""The n-gram hashing V4.1's Engram reads its tables with (`deepinfer.families.v41.engram`): integer op
chains, so every table gives the same rows; on CUDA `engram_rows` is one Triton launch
(`triton_fused.engram_rows`) instead of this chain's two dozen."""

from __future__ import annotations

import torch


def ngram_context(compressed: torch.Tensor, query_start: torch.Tensor, lookback: torch.Tensor) -> torch.Tensor:
    """Each token's compressed id and the ones before it in its sequence: [T, N], column k = k back.

    compressed [T]: the step's compressed ids, rows flattened, padding after `query_start[-1]`;
    query_start [B + 1]: row b's tokens are [query_start[b], query_start[b + 1]); lookback [B, N - 1]:
    row b's compressed ids just before its first token here, most recent last, the pad id where the
    sequence has none. Positions before a row's first token come from its lookback, so a sequence's
    context is the same however its tokens are split into steps. Padding tokens get in-range values.
    """
    tokens = torch.arange(compressed.shape[0], device=compressed.device, dtype=query_start.dtype)
    last_row = query_start.shape[0] - 2
    row = (torch.searchsorted(query_start, tokens, right=True) - 1).clamp(0, last_row)
    pos = tokens - query_start[row]
    width = lookback.shape[1]
    back = torch.arange(width + 1, device=compressed.device, dtype=query_start.dtype)
    in_step = back <= pos.unsqueeze(1)
    from_step = compressed[(tokens.unsqueeze(1) - back).clamp(min=0)]
    slot = (width - back + pos.unsqueeze(1)).clamp(0, width - 1)
    from_lookback = lookback[row.unsqueeze(1), slot]
    return torch.where(in_step, from_step, from_lookback)


def hash_rows(
    context: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """One layer's table rows per token: [T, (N - 1) * heads], order 2's heads first.

    The order-(k + 1) n-gram hashes to r_k = XOR of context[:, i] * multipliers[i] for i <= k, and
    head h of it to r_k mod its prime plus its offset.
    """
    products = context * multipliers
    heads = primes.shape[0] // (products.shape[1] - 1)
    rolling = products[:, 0]
    per_order = []
    for k in range(1, products.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[:, k])
        per_order.append(rolling.unsqueeze(1) % primes[(k - 1) * heads:k * heads])
    return torch.cat(per_order, dim=1) + offsets


def engram_rows(
    compressed: torch.Tensor, query_start: torch.Tensor, lookback: torch.Tensor,
    multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """`hash_rows` of `ngram_context` (arguments as there)."""
    return hash_rows(ngram_context(compressed, query_start, lookback), multipliers, primes, offsets)
