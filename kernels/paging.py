"""The paged caches' slot arithmetic as one op: integers only, so every table gives the same values; on
CUDA it is one Triton launch (`triton_fused.paged_slots`) instead of this chain's eight or so."""

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
