"""Weight holders: the model's parameters carry the checkpoint's tensor names."""

from __future__ import annotations

import torch
from torch import nn
from deepinfer.kernels import Ops



def empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """A bias-free projection; the arithmetic goes through `ops.linear`."""

    MATMUL_WEIGHTS = ("weight",)

    def __init__(self, in_features: int, out_features: int, ops: Ops, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.weight = empty(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm whose weight is kept in fp32 (as V4 checkpoints store it)."""

    def __init__(self, dim: int, eps: float, ops: Ops, device) -> None:
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = empty(dim, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def collapsed(self, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The norm of the hyper-connection streams [T, n, hidden] collapsed by pre [T, n] (a block's
        input, seen only through this norm): `ops.collapsed_norm`, one launch on CUDA."""
        return self.ops.collapsed_norm(pre, streams, self.weight, self.eps)
