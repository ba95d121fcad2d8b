"""Ops composed from a numerics table's own primitives: attention and indexer scores over keys read
from the paged caches, the compressors' pooling of state rows read from them, the indexer's ordered
top-k, the rotary table, the hyper-connection ops (DeepSeek-V4's manifold-constrained residual
streams), the MoE router's routing and V4.1's Engram gating. `kernels.bind` builds them from the
table's `sink_attention`, `indexer_scores`, `window_pool`, `cos_sin`, `sigmoid`, `sinkhorn`,
`ordered_sum`, `mix_streams`, `softplus`, `softmax` and `topk_indices`, so their bits in each mode are
those of that mode's primitives. The batch-invariant CUDA table replaces them with Triton kernels that
compute the same bits: the paged ones read keys through their slots instead of gathering them
(`kernels/triton_ops.py`), the others fuse a chain of launches into one or two
(`kernels/triton_fused.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.kernels.fast import scalar

Op = Callable[..., torch.Tensor]


def paged_sink_attention(
    q: torch.Tensor, window: torch.Tensor, window_slots: torch.Tensor, window_valid: torch.Tensor,
    entries: torch.Tensor | None, entry_slots: torch.Tensor | None, entry_valid: torch.Tensor | None,
    sinks: torch.Tensor, scale: float, *, sink_attention: Op,
) -> torch.Tensor:
    """Sink attention of q [T, H, D] over each token's window keys (rows window_slots [T, W] of the
    window pool [rows, D], validity window_valid) followed by its compressed keys (rows entry_slots
    [T, E] of the entries pool [rows, >= D], their first D columns; none when `entries` is None)."""
    keys, valid = [window[window_slots]], [window_valid]
    if entries is not None:
        keys.append(entries[entry_slots, :q.shape[-1]])
        valid.append(entry_valid)
    return sink_attention(q, torch.cat(keys, dim=1), torch.cat(valid, dim=1), sinks, scale)


def paged_window_pool(
    state: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor | None, dim: int,
    overlap: bool, *, window_pool: Op,
) -> torch.Tensor:
    """A compressor's pooling of the state rows `slots` [C, S] (validity `valid`) of its state pool
    columns `state` [rows, 2 * width] ([kv | gate], width = 2 * dim with `overlap`, else dim) into
    [C, dim] fp32. With `overlap` the first S / 2 slots pool the first series (kv, gate and `bias`
    columns :dim) and the others the second (dim:); `bias` [S or S / 2, width] fp32, or None for
    none (zeros). Invalid slots (stale rows, NaN possibly) weigh nothing."""
    width = 2 * dim if overlap else dim
    if bias is None:
        bias = torch.zeros(slots.shape[1] // (2 if overlap else 1), width, device=state.device)
    rows = state[slots]
    kv, gate = rows[..., :width], rows[..., width:2 * width]
    if overlap:
        half = slots.shape[1] // 2
        kv = torch.cat([kv[:, :half, :dim], kv[:, half:, dim:]], dim=1)
        gate = torch.cat([gate[:, :half, :dim], gate[:, half:, dim:]], dim=1)
        bias = torch.cat([bias[:, :dim], bias[:, dim:]], dim=0)
    gate = gate.float().masked_fill(~valid.unsqueeze(-1), float("-inf"))
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0)
    return window_pool(kv, gate, bias)


def ascending_topk(scores: torch.Tensor, k: int, *, topk_indices: Op) -> tuple[torch.Tensor, torch.Tensor]:
    """The `topk_indices` of each row of scores [T, W] (the k best, ties to the lower index), reordered:
    those scoring above -inf first in ascending order, then the others in ascending order, where
    padding cannot move them -> (chosen [T, k], whether each scores above -inf [T, k])."""
    width = scores.shape[1]
    chosen = topk_indices(scores, k)
    good = scores.gather(1, chosen) > float("-inf")
    order = torch.sort(torch.where(good, chosen, chosen + width), dim=-1).values
    good = order < width
    return torch.where(good, order, order - width), good


def paged_indexer_scores(
    q: torch.Tensor, entries: torch.Tensor, entry_slots: torch.Tensor, column: int, head_weights: torch.Tensor,
    valid: torch.Tensor, scale: float, *, weight_scale: float = 1.0, indexer_scores: Op,
) -> torch.Tensor:
    """Indexer scores of q [T, H, Di] against the index keys of each token's entries: columns
    column .. column + Di of rows entry_slots [T, E] of the entries pool."""
    keys = entries[entry_slots, column:column + q.shape[-1]]
    return indexer_scores(q, keys, head_weights, valid, scale, weight_scale=weight_scale)


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
    pre_w, post_w, comb_w = mixes.split_with_sizes([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split_with_sizes([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.unbind()
    pre = sigmoid(pre_w * pre_scale + pre_b) + scalar(eps)
    post = sigmoid(post_w * post_scale + post_b) * scalar(2.0)
    comb = sinkhorn(comb_w.reshape(-1, n, n) * comb_scale + comb_b.view(n, n), iters, eps)
    return pre, post, comb


def hyper_collapse(pre: torch.Tensor, streams: torch.Tensor, *, ordered_sum: Op) -> torch.Tensor:
    """A block's input: streams [T, n, hidden] weighted by pre [T, n] (fp32) and summed in stream order,
    in the streams' dtype."""
    return ordered_sum(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)


def collapsed_norm(pre: torch.Tensor, streams: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   hyper_collapse: Op, rms_norm: Op) -> torch.Tensor:
    """A block's normed input: `rms_norm` (fp32 weight, eps) of the streams collapsed by pre; the collapsed
    input itself is not kept (hyper-connections read it only through the norm)."""
    return rms_norm(hyper_collapse(pre, streams), weight, eps)


def hyper_expand(
    post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor, *, mix_streams: Op,
) -> torch.Tensor:
    """New streams = post * block output + comb^T @ old streams (comb mixes over its first axis):
    post [T, n], comb [T, n, n] fp32, block_out [T, hidden], streams [T, n, hidden]."""
    return post.to(streams.dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mix_streams(comb, streams)


def gate_scores(logits: torch.Tensor, score_func: str, *, softplus: Op, softmax: Op, sigmoid: Op) -> torch.Tensor:
    """The router's expert scores from its logits [T, E], in the logits' dtype."""
    if score_func == "sqrtsoftplus":
        return softplus(logits).sqrt()
    if score_func == "softmax":
        return softmax(logits).to(logits.dtype)
    if score_func == "sigmoid":
        return sigmoid(logits)
    raise ValueError(f"unknown scoring function {score_func!r}")


def moe_gate(logits: torch.Tensor, score_func: str, bias: torch.Tensor | None, chosen: torch.Tensor | None,
             top_k: int, scale: float, *, softplus: Op, softmax: Op, sigmoid: Op, topk_indices: Op,
             ordered_sum: Op) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing from the router's logits [T, E]: each token's experts (the top_k of score + bias, ties
    to the lowest index; or `chosen` [T, top_k], a hash layer's) and their weights, the scores
    normalised to sum to one (`ordered_sum`) times `scale` (int64 [T, top_k], the logits' dtype)."""
    scores = gate_scores(logits, score_func, softplus=softplus, softmax=softmax, sigmoid=sigmoid)
    indices = topk_indices(scores + bias, top_k) if chosen is None else chosen
    weights = scores.gather(1, indices)
    weights = weights / (ordered_sum(weights, dim=-1).unsqueeze(-1) + 1e-20)
    return indices, weights * scale



def engram_mix(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
               floor: float, *, ordered_sum: Op, sigmoid: Op) -> torch.Tensor:
    """V4.1's Engram gating (`families.v41.engram.Engram`): streams [T, n, H] plus gate * value, from kv
    [T, (n + 1) H] (n keys, one per stream, then the value) and q_weight, k_weight [n, H] (fp32), where
    gate = sigmoid(signed sqrt(max(|dot|, floor))) and dot is the (q_weight * k_weight)-weighted dot
    product of the stream and its key, each RMS-normalised (eps), scaled by H^-1/2. In fp32, sums over
    H by `ordered_sum`; the result in the streams' dtype."""
    n, width = streams.shape[1:]
    key, value = kv.float().split((n * width, width), dim=-1)
    key = key.unflatten(-1, (n, width))
    hidden = streams.float()

    def rsqrt_mean_square(x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(ordered_sum(x.square(), dim=-1) / width + eps)

    rstd = rsqrt_mean_square(hidden) * rsqrt_mean_square(key)
    weighted = hidden * (q_weight * k_weight) * key
    dot = ordered_sum(weighted, dim=-1) * rstd * width ** -0.5
    gate = sigmoid(torch.copysign(dot.abs().clamp_min(floor).sqrt(), dot))
    return (hidden + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(streams.dtype)
