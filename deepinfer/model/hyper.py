"""Manifold-constrained hyper-connections: `hc_mult` residual streams mixed around each block."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from deepinfer.config import ModelConfig
from deepinfer.model.layers import empty


class HyperMix(nn.Module):
    """Computes (pre, post, comb) from the streams; `pre` collapses them into the block input.

    The parameters live on the decoder layer under the checkpoint's names (`hc_attn_fn`, ...),
    so this module receives them rather than owning them.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n = config.hc_mult
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps

    def forward(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        flat = kernels.unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = kernels.linear(flat, fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre = kernels.sigmoid(pre_w * scale[0] + pre_b) + self.hc_eps
        post = 2 * kernels.sigmoid(post_w * scale[1] + post_b)
        comb = kernels.sinkhorn(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), self.iters, self.hc_eps)
        collapsed = kernels.ordered_sum(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)
        return post, comb, collapsed


def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """New streams = post * block output + comb^T @ old streams (comb mixes over its first axis)."""
    return post.to(streams.dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + kernels.mix_streams(comb, streams)


class HyperHead(nn.Module):
    """Final collapse of the streams into one hidden vector per token."""

    MATMUL_WEIGHTS = ("hc_fn",)

    def __init__(self, config: ModelConfig, device) -> None:
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = empty(n, n * h, dtype=torch.float32, device=device)
        self.hc_base = empty(n, dtype=torch.float32, device=device)
        self.hc_scale = empty(1, dtype=torch.float32, device=device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = kernels.unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = kernels.sigmoid(kernels.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return kernels.ordered_sum(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)
