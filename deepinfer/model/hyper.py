"""Manifold-constrained hyper-connections: `hc_mult` residual streams mixed around each block."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.model.layers import empty
from kernels import Ops


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
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post, comb, the streams collapsed with this site's own `pre`): V4's mixing."""
        pre, post, comb = self.coefficients(streams, fn, base, scale)
        return post, comb, collapse(self.ops, pre, streams)

    def coefficients(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [T, n], post [T, n], comb [T, n, n]) in fp32 from the streams [T, n, hidden]."""
        n = self.n
        flat = self.ops.unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = self.ops.linear(flat, fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre = self.ops.sigmoid(pre_w * scale[0] + pre_b) + self.hc_eps
        post = 2 * self.ops.sigmoid(post_w * scale[1] + post_b)
        comb = self.ops.sinkhorn(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), self.iters, self.hc_eps)
        return pre, post, comb


def collapse(ops: Ops, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block input: streams [T, n, hidden] weighted by pre [T, n] and summed in stream order."""
    return ops.ordered_sum(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)


def expand(ops: Ops, post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
           ) -> torch.Tensor:
    """New streams = post * block output + comb^T @ old streams (comb mixes over its first axis)."""
    return post.to(streams.dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + ops.mix_streams(comb, streams)


class HyperHead(nn.Module):
    """Final collapse of the streams into one hidden vector per token."""

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
        flat = self.ops.unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = self.ops.sigmoid(self.ops.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return collapse(self.ops, pre, streams)
