"""Manifold-constrained hyper-connections: `hc_mult` residual streams mixed around each block."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.families.v4.config import ModelConfig
from deepinfer.model.layers import RMSNorm, empty
from deepinfer.kernels import Ops


class HyperMix(nn.Module):
    """Computes (pre, post, comb) from the streams; `pre` collapses them into the block input.

    The parameters live on the decoder layer under the checkpoint's names (`hc_attn_fn`, ...),
    so this module receives them rather than owning them.
    """

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.n = config.hc_mult
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps

    def forward(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post, comb, the streams collapsed with this site's own `pre`, normed by the block's `norm`):
        V4's mixing."""
        pre, post, comb = self.coefficients(streams, fn, base, scale)
        return post, comb, norm.collapsed(pre, streams)

    def coefficients(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [T, n], post [T, n], comb [T, n, n]) in fp32 from the streams [T, n, hidden]."""
        flat = self.ops.unweighted_rms_norm(streams.flatten(1), self.norm_eps, torch.float32)
        return self.ops.hyper_coefficients(self.ops.linear(flat, fn), base, scale, self.n, self.iters, self.hc_eps)


class HyperHead(nn.Module):
    """The final collapse's weights: `pre` [T, n] from the streams, which the decoder's final norm
    collapses them with (`RMSNorm.collapsed`) into one hidden vector per token."""

    MATMUL_WEIGHTS = ("hc_fn",)

    def __init__(self, config: ModelConfig, ops: Ops, device) -> None:
        super().__init__()
        self.ops = ops
        n, h = config.hc_mult, config.hidden_size
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = empty(n, n * h, dtype=torch.float32, device=device)
        self.hc_base = empty(n, dtype=torch.float32, device=device)
        self.hc_scale = empty(1, dtype=torch.float32, device=device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return head_pre(self.ops, streams, (self.hc_fn, self.hc_base, self.hc_scale), self.eps, self.norm_eps)


def head_pre(ops: Ops, streams: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse's `pre` [T, n] (fp32) of streams [T, n, hidden] with (fn, base, scale)
    [n, n * hidden], [n], [1]: a function, since the MTP block holds its own under other names
    (`hc_head_fn`, ...)."""
    fn, base, scale = weights
    flat = ops.unweighted_rms_norm(streams.flatten(1), norm_eps, torch.float32)
    return ops.sigmoid(ops.linear(flat, fn) * scale + base) + eps
