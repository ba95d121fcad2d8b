"""Ops composed from a numerics table's own primitives: the rotary table and the hyper-connection ops
(DeepSeek-V4's manifold-constrained residual streams). `kernels.bind` builds them from the table's
`cos_sin`, `sigmoid`, `sinkhorn`, `ordered_sum` and `mix_streams`, so their bits in each mode are
those of that mode's primitives. The batch-invariant CUDA table replaces them with fused Triton
kernels that compute the same bits (`kernels/triton_fused.py`): one launch instead of a chain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Op = Callable[..., torch.Tensor]


def rotary_table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, *, cos_sin: Op
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, half] (fp32, times `scale`) of the angles positions [T] x inv_freq [half]."""
    cos, sin = cos_sin(positions.float().unsqueeze(-1) * inv_freq)
    return cos * scale, sin * scale


def hyper_coefficients(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float, *,
    sigmoid: Op, sinkhorn: Op,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) in fp32 from one site's mixing logits [T, (2 + n) * n]
    (the projection of the normalised streams), its bias `base` [(2 + n) * n] and `scale` [3]."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * sigmoid(post_w * scale[1] + post_b)
    comb = sinkhorn(comb_w.reshape(-1, n, n) * scale[2] + comb_b.view(n, n), iters, eps)
    return pre, post, comb


def hyper_collapse(pre: torch.Tensor, streams: torch.Tensor, *, ordered_sum: Op) -> torch.Tensor:
    """A block's input: streams [T, n, hidden] weighted by pre [T, n] (fp32) and summed in stream order,
    in the streams' dtype."""
    return ordered_sum(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)


def hyper_expand(
    post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor, *, mix_streams: Op,
) -> torch.Tensor:
    """New streams = post * block output + comb^T @ old streams (comb mixes over its first axis):
    post [T, n], comb [T, n, n] fp32, block_out [T, hidden], streams [T, n, hidden]."""
    return post.to(streams.dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mix_streams(comb, streams)
