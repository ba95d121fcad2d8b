"""`numerics="batch_invariant"`: the same primitives with a fixed reduction order per row.

A row's result depends only on that row's data, never on how many rows share the call, what
they hold, or how much padding the batch needed:

- matmuls run on fixed tiles of `TILE` rows (padded with zeros), each its own library call, so
  the library sees one shape whatever the batch; 8 rows stay on the same kernel for every
  thread count we measured (larger tiles let the library split the reduction across threads);
- attention and indexer scores work on full blocks of `KV_BLOCK` keys: per token one batched
  matmul of a fixed shape ([H, D] x [D, KV_BLOCK], then [H, KV_BLOCK] x [KV_BLOCK, D]), which
  the library computes entry by entry with the same kernel whatever the number of tokens
  (checked for every thread count and head shape we use), and an online softmax in block
  order; a block that is all padding is an exact no-op, so the batch's longest key list does
  not change a shorter one's result;
- top-k breaks ties to the lowest index; stream mixing sums its n terms in a fixed order;
- transcendental pointwise functions (exp, sigmoid, silu, softplus, cos, sin) go through
  `pointwise`: PyTorch's CPU loops run full SIMD vectors and finish a buffer's tail with the
  scalar function, whose last bit can differ, so where an element lands in the buffer (which
  depends on the batch) would otherwise decide its bits. Padded pieces make every element take
  the vector path.

- sums the model spells out (hyper-connection collapse, MoE weight normalisation, window
  pooling) go through `ordered_sum`, a fixed tree of elementwise adds.

Ops whose CPU kernels already reduce each row on its own, in order (norms, softmax over a row,
rotary, Sinkhorn's sums over hc_mult elements) are shared with `kernels.fast`; on CUDA the Triton
kernels of `kernels/triton_ops.py` replace the reductions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from kernels.fast import (  # noqa: F401  (re-exported: already row-invariant)
    log_softmax,
    rms_norm,
    rotary,
    sinkhorn,
    softmax,
    unweighted_rms_norm,
)

TILE = 8
KV_BLOCK = 64
POINTWISE_ALIGN = 64  # a multiple of two SIMD vectors on every x86 ISA PyTorch targets
POINTWISE_PIECE = 16384  # below PyTorch's parallel grain, so one thread runs each piece from its start


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) elementwise, with every element computed by the same (vectorised) code path.

    On CUDA every element runs the same code already, so fn applies directly.
    """
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = flat.new_zeros((n + POINTWISE_ALIGN - 1) // POINTWISE_ALIGN * POINTWISE_ALIGN)
    padded[:n] = flat
    pieces = [fn(padded[i:i + POINTWISE_PIECE].clone()) for i in range(0, padded.numel(), POINTWISE_PIECE)]
    out = torch.cat(pieces) if pieces else padded
    return out[:n].view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.softplus, x)


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return pointwise(torch.cos, angles), pointwise(torch.sin, angles)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return pointwise(F.silu, gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`, computed TILE rows per library call."""
    rows = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    n = rows.shape[0]
    padded = rows.new_zeros((n + TILE - 1) // TILE * TILE, rows.shape[1])
    padded[:n] = rows
    tiles = [F.linear(padded[i:i + TILE], weight) for i in range(0, padded.shape[0], TILE)]
    out = torch.cat(tiles) if tiles else rows.new_zeros(0, weight.shape[0])
    return out[:n].view(*x.shape[:-1], weight.shape[0])


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a fixed tree of elementwise adds (first half + second half, an odd last
    element carried to the next level): library reductions (CUDA's in particular) pick how to split
    a reduction from the whole tensor's shape; elementwise adds do not. log2(n) adds, not n - 1."""
    while x.shape[dim] > 1:
        n = x.shape[dim]
        half = n // 2
        paired = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
        x = paired if n % 2 == 0 else torch.cat([paired, x.narrow(dim, n - 1, 1)], dim=dim)
    return x.squeeze(dim)


def window_pool(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Compressor pooling: per window, a softmax over slots of (gate + bias) weights the kv rows.

    kv, gate: [N, S, D]; bias: [S, D] fp32 -> [N, D] fp32. The softmax runs over a last dimension
    (row-local) and the slots are summed in order.
    """
    weights = softmax((gate.float() + bias).transpose(1, 2), dim=-1).transpose(1, 2)
    return ordered_sum(kv.float() * weights, dim=1)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, Din], weight [G * Dout, Din] -> [T, G, Dout]."""
    per_group = weight.view(groups, -1, weight.shape[-1])
    return torch.stack([linear(x[:, g], per_group[g]) for g in range(groups)], dim=1)


def mix_streams(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """comb^T @ streams per token, summed over the n input streams in order."""
    comb = comb.to(streams.dtype)
    out = comb[:, 0, :, None] * streams[:, 0, None, :]
    for j in range(1, comb.shape[1]):
        out = out + comb[:, j, :, None] * streams[:, j, None, :]
    return out


def _key_blocks(keys: torch.Tensor, valid: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The key axis in whole KV_BLOCKs (start, keys [T, KV_BLOCK, D], valid [T, KV_BLOCK]), so every
    block's matmuls and reductions have one shape; only the last block is padded (with invalid zeros)."""
    width = keys.shape[1]
    for start in range(0, width, KV_BLOCK):
        block, block_valid = keys[:, start:start + KV_BLOCK], valid[:, start:start + KV_BLOCK]
        pad = KV_BLOCK - block.shape[1]
        if pad:
            block = torch.cat([block, block.new_zeros(block.shape[0], pad, block.shape[2])], dim=1)
            block_valid = torch.cat([block_valid, block_valid.new_zeros(block_valid.shape[0], pad)], dim=1)
        yield start, block, block_valid


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV attention with a per-head sink, keys reduced in KV_BLOCK blocks in order.

    q [T, H, D], kv [T, K, D], valid [T, K], sinks [H] fp32 -> [T, H, D] in q's dtype.
    Softmax statistics and the accumulator are fp32.
    """
    tokens, heads, dim = q.shape
    qf = q.float()
    top = sinks.float().view(1, heads).expand(tokens, heads).clone()  # running max, starts at the sink
    total = torch.ones(tokens, heads, device=q.device)  # the sink's exp(sink - top) = 1
    acc = torch.zeros(tokens, heads, dim, device=q.device)
    for _, block, block_valid in _key_blocks(kv, valid):
        if not bool(block_valid.any()):
            continue  # all padding (or all before position 0): an exact no-op, skipped
        keys = block.float()
        scores = torch.bmm(qf, keys.transpose(1, 2).contiguous()) * scale  # [T, H, B]
        scores = scores.masked_fill(~block_valid.unsqueeze(1), float("-inf"))
        new_top = torch.maximum(top, scores.max(dim=-1).values)
        correction = pointwise(torch.exp, top - new_top)
        probs = pointwise(torch.exp, scores - new_top.unsqueeze(-1))
        total = total * correction + probs.sum(-1)
        acc = acc * correction.unsqueeze(-1) + torch.bmm(probs, keys)
        top = new_top
    return (acc / total.unsqueeze(-1)).to(q.dtype)


def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Lightning-indexer scores sum_h w[t,h] * relu(q[t,h] . k[t,s]) * scale, heads summed in order."""
    width = keys.shape[1]
    qf = q.float()
    out = torch.full((keys.shape[0], width), float("-inf"), device=q.device)
    for start, block, _ in _key_blocks(keys, valid):
        block = block.float().transpose(1, 2).contiguous()
        weighted = torch.relu(torch.bmm(qf, block)) * scale * head_weights.unsqueeze(-1)  # [T, H, B]
        summed = weighted[:, 0]
        for h in range(1, weighted.shape[1]):
            summed = summed + weighted[:, h]
        out[:, start:start + KV_BLOCK] = summed[:, :width - start]
    return out.masked_fill(~valid, float("-inf"))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties to the lowest index (so the choice does not
    depend on how many trailing candidates the row was padded with)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
