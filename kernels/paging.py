"""The paged caches' slot arithmetic as ops: integers only, so every table gives the same values; on
CUDA each is one Triton launch (`triton_fused.paged_slots`, `triton_fused.closing_tokens`) instead of
its chain's six to ten."""

from __future__ import annotations

import torch


def paged_slots(
    table: torch.Tensor, block_size: int, seq: torch.Tensor, first: torch.Tensor | None, offset: int, width: int,
    keep: torch.Tensor | None = None, null_slot: int = 0, limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical cache rows (`block * block_size + offset in block`) of the logical rows
    `first[n] + offset + j` (j < `width`; `first` None counts as 0) of sequence rows `seq` [N] in
    `table` [B, M] (int64), and whether each logical row is in [0, `limit[n]`) (no upper bound without
    `limit`): ([N, width] int64, [N, width] bool). Rows outside the table are clamped into it (callers mask
    what they read there and never write there); the `null_slot` replaces the slots of rows n where
    `keep` [N] is false."""
    rows = torch.arange(width, device=seq.device) + offset
    rows = rows.expand(seq.shape[0], width) if first is None else first.unsqueeze(1) + rows
    valid = rows >= 0 if limit is None else (rows >= 0) & (rows < limit.unsqueeze(1))
    clamped = rows.clamp(0, table.shape[1] * block_size - 1)
    slots = table[seq.unsqueeze(1), clamped // block_size] * block_size + clamped % block_size
    if keep is not None:
        slots = torch.where(keep.unsqueeze(1), slots, null_slot)
    return slots, valid


def closing_tokens(positions: torch.Tensor, real: torch.Tensor, ratio: int, capacity: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's tokens that close a compression window of `ratio` tokens (real tokens at positions p
    with (p + 1) % ratio == 0) first, in token order, then the others in token order: the first
    `capacity` of them as (token indices [C] int64, whether each closes [C] bool, the window of its
    position `positions[token] // ratio` [C]). A fixed-shape compaction: no host read of how many close."""
    closes = real & ((positions + 1) % ratio == 0)
    token = torch.sort((~closes).to(torch.int32), stable=True).indices[:capacity]
    return token, closes[token], positions[token] // ratio
