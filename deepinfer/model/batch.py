"""What one forward step needs besides weights: token ids, positions and paged-cache addresses.

The runner builds a `StepBatch` from the scheduler's decisions and the sequences' block tables;
the model only reads it. All slot tensors index the flattened rows of a cache pool
(`block * block_size + offset`); read tables come with a validity mask (invalid slots point at
row 0 and are masked out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class CompressorStep:
    """Addresses for one compressor kind (CSA or HCA) in one step.

    state_write [T]: where each new token's projections go in the state pool.
    close_read [C, S] / close_valid [C, S]: for each of the C windows this step closes, the state
    rows pooled into its entry; close_write [C]: the entry's slot; close_position [C]: the entry's
    rope position (first token of its window).
    entry_read [T, N] / entry_valid [T, N]: the entries each query may attend to (or score).
    """

    state_write: torch.Tensor
    close_read: torch.Tensor
    close_valid: torch.Tensor
    close_write: torch.Tensor
    close_position: torch.Tensor
    entry_read: torch.Tensor
    entry_valid: torch.Tensor

    def to(self, device: torch.device) -> "CompressorStep":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


@dataclass
class StepBatch:
    """One engine step, flattened over the scheduled sequences (T tokens in all)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    window_write: torch.Tensor
    window_read: torch.Tensor
    window_valid: torch.Tensor
    compressors: dict[str, CompressorStep] = field(default_factory=dict)
    sample_index: torch.Tensor | None = None

    def to(self, device: torch.device) -> "StepBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        moved["compressors"] = {k: step.to(device) for k, step in self.compressors.items()}
        return StepBatch(**moved)
