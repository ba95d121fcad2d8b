"""Rotary tables for V4's two rope types: `main` (sliding-only layers) and `compress`."""

from __future__ import annotations

import torch

from deepinfer.families.v4.config import ModelConfig
from deepinfer.kernels import Ops


class RotaryTable:
    """cos/sin of interleaved RoPE at absolute positions, computed in fp32. The inverse frequencies
    live where the model does (`to`), so a step copies nothing to the device for them."""

    def __init__(self, config: ModelConfig, ops: Ops, label: str) -> None:
        self.ops = ops
        self.inv_freq, self.scale = config.rope_inv_freq(label)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_table(positions, self.inv_freq, self.scale)

    def to(self, device: torch.device | str) -> None:
        self.inv_freq = self.inv_freq.to(device)
