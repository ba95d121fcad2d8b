"""Rotary tables for V4's two rope types: `main` (sliding-only layers) and `compress`."""

from __future__ import annotations

import torch

import kernels

from deepinfer.config import ModelConfig


class RotaryTable:
    """cos/sin of interleaved RoPE at absolute positions, computed in fp32."""

    def __init__(self, config: ModelConfig, label: str) -> None:
        self.inv_freq, self.scale = config.rope_inv_freq(label)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        cos, sin = kernels.cos_sin(freqs)
        return cos * self.scale, sin * self.scale
