"""`numerics="fast"`: every primitive the V4 model uses, as plain PyTorch ops.

Shapes are "flat batch" shapes: the leading dimension T is the number of tokens in the step,
whatever sequences they belong to. Mathematically each op treats a row independently of the
other rows, but the library kernels behind matmuls pick their blocking from the whole shape, so a
row's bits can change with T. `kernels/invariant.py` fixes that; this module stays the baseline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.kernels.quant import accepts_quantized


@functools.cache
def scalar(value: float) -> torch.Tensor:
    """`value` as a 0-dim fp32 CPU tensor, for elementwise ops with fp32 or bf16 tensors: both take it
    as a CPU scalar rounded to fp32, as they take a Python number, so the bits are the same; but a
    Python number is wrapped in a new float64 tensor on every call (~4 us more per op on CPU, where
    small ops cost ~3 us). Shared: never write to it. Made outside inference mode, so that autograd
    may save it (training runs these ops too)."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=torch.float32)


@accepts_quantized
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` in the weight's dtype."""
    return F.linear(x.to(weight.dtype), weight)


def matmul_layout(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the layout `linear` wants: as stored."""
    return weight


@accepts_quantized
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, Din], weight [G * Dout, Din] -> [T, G, Dout]."""
    w = weight.view(groups, -1, weight.shape[-1]).transpose(1, 2)
    return torch.bmm(x.transpose(0, 1).to(weight.dtype), w).transpose(0, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with an fp32 weight: normalise and scale in fp32, cast once at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + scalar(eps))
    return (weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm without weight; the fp32 inverse RMS is cast to x's dtype before scaling. With `dtype`,
    the norm of x cast to it (a kernel reads x as it is and casts in registers: no copy of x)."""
    x = x if dtype is None else x.to(dtype)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + scalar(eps)).to(x.dtype)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x.float(), dim=dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=dim)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing `2 * cos.shape[-1]` channels of x [T, ..., D].

    cos/sin are [T, rope_dim // 2] in fp32; channel pairs (2i, 2i+1) rotate by angle i (by minus it
    with `inverse`, which undoes the rotation: sin negated, exactly).
    """
    sin = -sin if inverse else sin
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    nope, rope = x.split_with_sizes([x.shape[-1] - 2 * half, 2 * half], dim=-1)
    even, odd = rope.float().unflatten(-1, (half, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` (the library chooses the order)."""
    return x.sum(dim=dim)


def window_pool(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Compressor pooling: per window, a softmax over slots of (gate + bias) weights the kv rows.

    kv, gate: [N, S, D] (N windows of S slots); bias: [S, D] fp32. Slots with gate -inf get weight 0.
    """
    weights = torch.softmax(gate.float() + bias, dim=1)
    return (kv.float() * weights).sum(dim=1)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic projection of [..., n, n] mixing logits (softmax rows, then alternate).
    The tensors are tiny, so each op's call is the cost: eps is a `scalar`, each sum (dim, keepdim:
    positional, parsed faster) takes it in place."""
    eps = scalar(eps)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / comb.sum(-2, True).add_(eps)
    for _ in range(iters - 1):
        comb = comb / comb.sum(-1, True).add_(eps)
        comb = comb / comb.sum(-2, True).add_(eps)
    return comb


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV attention with a per-head sink logit.

    q [T, H, D], kv [T, K, D] (each query's own gathered keys, K = V), valid [T, K] bool,
    sinks [H] fp32. The sink takes part in the softmax normalisation and contributes no value.
    """
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0)  # invalid rows are stale cache rows, NaN possibly
    scores = torch.einsum("thd,tkd->thk", q, kv.to(q.dtype)) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs.to(kv.dtype), kv)


def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, valid: torch.Tensor, scale: float, *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """Lightning-indexer scores sum_h w[t,h] * relu(q[t,h] . k[t,s]) * scale; invalid -> -inf.

    q [T, H, Di], keys [T, S, Di], head_weights [T, H] (w: in fp32, times weight_scale), valid [T, S]
    -> [T, S] fp32.
    """
    dots = torch.einsum("thd,tsd->ths", q.float(), keys.float())
    head_weights = head_weights.float() * weight_scale
    scores = (torch.relu(dots) * scale * head_weights.unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(~valid, float("-inf"))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row (ties as the library breaks them)."""
    return torch.topk(scores, k, dim=-1).indices


def mix_streams(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """comb^T @ streams per token: comb [T, n, n], streams [T, n, H] -> [T, n, H]."""
    return torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x)


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return angles.cos(), angles.sin()


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


def sort_by_expert(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, rank) slots of indices [T, k] grouped by expert, on the indices' device:
    `order` [T * k] lists flat slot ids (token * k + rank) by expert, ascending slot ids within one;
    expert e's slots are order[offsets[e]:offsets[e + 1]] (offsets [E + 1]). No host sync."""
    flat = indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    bounds = torch.arange(n_experts + 1, dtype=flat.dtype, device=flat.device)
    return order, torch.searchsorted(flat[order], bounds)


def expert_outputs(
    x: torch.Tensor,
    experts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    swiglu: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slot s through expert experts[s], unweighted: x[rows[s]] (x[s] when rows is None) [S, H] ->
    [S, H], with w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I].

    Slots are grouped by expert (`sort_by_expert`) and each expert's rows go through `matmul`
    together, so a slot's output does not depend on which other slots the experts served (given a
    `matmul` whose rows do not depend on each other): the experts of one rank under expert
    parallelism give the bits one rank holding them all gives. The per-expert loop reads the group
    sizes on the host: free on CPU, one sync on CUDA (the batch-invariant CUDA table has a grouped
    Triton kernel instead)."""
    order, offsets = sort_by_expert(experts.unsqueeze(-1), w13.shape[0])
    source = order if rows is None else rows[order]
    out = x.new_zeros(order.shape[0], x.shape[-1])
    bounds = offsets.tolist()
    for expert in range(w13.shape[0]):
        if bounds[expert] == bounds[expert + 1]:
            continue
        span = slice(bounds[expert], bounds[expert + 1])
        gate, up = matmul(x[source[span]], w13[expert]).chunk(2, dim=-1)
        out[order[span]] = matmul(swiglu(gate, up, limit), w2[expert])
    return out


def grouped_expert_outputs(
    x: torch.Tensor,
    experts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    swiglu: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`expert_outputs` without reading group sizes on the host: the slots sorted by expert on the
    device go through each matrix in one grouped GEMM (`torch._grouped_mm`, the groups' ends as its
    offsets), so a step that runs it can be captured in a CUDA graph. Plain weights."""
    if experts.numel() == 0:  # a rank the exchange sent nothing (shapes are known on the host)
        return x.new_empty(0, w2.shape[1], dtype=w2.dtype)
    order, offsets = sort_by_expert(experts.unsqueeze(-1), w13.shape[0])
    source = order if rows is None else rows[order]
    ends = offsets[1:].to(torch.int32)
    hidden = torch._grouped_mm(x[source].to(w13.dtype), w13.transpose(1, 2), offs=ends)
    gate, up = hidden.chunk(2, dim=-1)
    out = torch._grouped_mm(swiglu(gate, up, limit).contiguous(), w2.transpose(1, 2), offs=ends)
    return torch.empty_like(out).index_copy_(0, order, out)


def weighted_combine(slots: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """slots [T, k, H] times their weights [T, k] (in the slots' dtype), summed over k in rank order; plus
    `shared` [T, H] (the shared expert's output) after them, in the slots' dtype."""
    combined = combine_ranks(slots * weights.unsqueeze(-1).to(slots.dtype))
    return combined if shared is None else combined + shared


def slot_rows(indices: torch.Tensor) -> torch.Tensor:
    """The token of each flat (token, rank) slot of indices [T, k]: slot // k."""
    return torch.arange(indices.numel(), device=indices.device) // indices.shape[-1]


def routed_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    swiglu: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts with a per-token combine in top-k rank order: x [T, H]; indices/weights [T, k].
    Each (token, rank) slot goes through its expert (`expert_outputs`), then a token's slots are
    weighted and summed rank by rank, the shared expert's output `shared` [T, H] added last
    (`weighted_combine`)."""
    slots = expert_outputs(x, indices.reshape(-1), w13, w2, limit, matmul, swiglu, rows=slot_rows(indices))
    return weighted_combine(slots.view(*indices.shape, -1), weights, shared)


def combine_ranks(slots: torch.Tensor) -> torch.Tensor:
    """slots [T, k, H] summed over k in rank order."""
    combined = slots[:, 0]
    for rank in range(1, slots.shape[1]):
        combined = combined + slots[:, rank]
    return combined
