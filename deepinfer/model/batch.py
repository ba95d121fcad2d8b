"""What one forward step needs besides weights: token ids, positions and paged-cache addresses.

The runner builds a `StepBatch` from the scheduler's decisions and the sequences' block tables;
the model only reads it. All slot tensors index the flattened rows of a cache pool
(`block * block_size + offset`); read tables come with a validity mask (invalid slots point at
row 0 and are masked out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from deepinfer.transfer import upload


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

    def to(self, device: torch.device, extra: dict[str, torch.Tensor] | None = None
           ) -> tuple["StepBatch", dict[str, torch.Tensor]]:
        """This batch, and the `extra` host tensors, on `device` in one copy (`deepinfer.transfer`)."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        for kind, step in self.compressors.items():
            flat.update({f"{kind}/{f.name}": getattr(step, f.name) for f in fields(step)})
        extra = extra or {}
        flat.update({f"extra/{name}": tensor for name, tensor in extra.items()})
        moved = upload(flat, device)
        compressors = {kind: CompressorStep(**{f.name: moved[f"{kind}/{f.name}"] for f in fields(CompressorStep)})
                       for kind in self.compressors}
        own = {f.name: moved.get(f.name) for f in fields(self) if f.name != "compressors"}
        return StepBatch(**own, compressors=compressors), {name: moved[f"extra/{name}"] for name in extra}
