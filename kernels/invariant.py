"""`numerics="batch_invariant"`: the same primitives with a fixed reduction order per row.

A row's result depends only on that row's data, never on how many rows share the call, what
they hold, or how much padding the batch needed:

- matmuls run on tiles of at most `ROW_TILE` rows, never one row alone (a lone row takes the
  library's matrix-vector path, which sums differently: it is duplicated). fp32
  matmuls also reduce K in blocks of `K_BLOCK`, one library call each, summed in order, against a
  column-major weight (`matmul_layout`): then no call leaves the library a K-blocking or
  K-splitting decision, and every tile runs on its outer-product kernels, where each output is
  one fused multiply-add chain over the block whatever the tile's row count, the other rows or
  the thread count. bf16 tiles are single oneDNN calls (fp32 accumulation), which are invariant
  in that range of row counts. Both were checked for every row count and thread count we
  measured (tests/test_invariant_kernels.py); larger calls switch kernels at some shapes;
- attention and indexer scores take all of a token's keys in one batched matmul
  ([H, D] x [D, K] per token): the library computes each score as its own dot product, whatever
  K (from MIN_KEYS up) or the number of tokens. Attention then sums and applies probabilities in
  blocks of KV_BLOCK keys in block order; keys beyond a token's own list (which the batch's
  longest list decides) have probability 0 and add exact zeros at the end of each sum;
- top-k breaks ties to the lowest index;
- transcendental pointwise functions (exp, sigmoid, silu, softplus, cos, sin) go through
  `pointwise`: PyTorch's CPU loops run full SIMD vectors and finish a buffer's tail with the
  scalar function, whose last bit can differ, so where an element lands in the buffer (which
  depends on the batch) would otherwise decide its bits. Padded pieces make every element take
  the vector path;
- sums the model spells out (hyper-connection collapse, MoE weight normalisation, window
  pooling) go through `ordered_sum`, a fixed tree of elementwise adds.

The library behaviour these rely on was measured on AVX-512 CPUs (MKL 2024.2 and oneDNN 3 in
PyTorch's CPU wheels; this machine and an H200 host, 1 to 16 threads). MKL's AVX2 code path
(MKL_ENABLE_INSTRUCTIONS=AVX2 forces it) picks sgemm kernels by row count, so on AVX2-only CPUs run
with MKL_CBWR=AVX2,STRICT (set before the process's first MKL call): MKL's strict reproducibility
mode, under which tests/test_invariant_kernels.py and tests/test_invariance.py pass on both code
paths and AVX2 and AVX-512 machines compute the same fp32 bits (at about 3/4 of the AVX-512 speed).
oneDNN's AMX bf16 kernels (CPUs with amx_bf16) make a row's bits depend on the batch, so importing
this module caps oneDNN at AVX-512 BF16 (`ONEDNN_MAX_CPU_ISA`, unless already set: kernels/cpu_isa.py).
oneDNN reads the variable at the process's first matmul, fp32 ones included (an fp32 F.linear or bmm
fixes the ISA as a bf16 matmul does), and ignores it afterwards; `check_cpu_isa` finds out from
oneDNN's verbose output which ISA and bf16 kernel it actually uses and refuses batch-invariant bf16
when that is AMX (or when its probe's rows depend on the batch). The cap is process-wide (fast mode
runs without AMX too); manifests record the cap and what was in effect, certificates state it.
Measured through the engine (benchmarks/results/cpu_isa_pairs.json: small preset, 8 requests of 1 to
130 prompt tokens and 12 generated, max_num_seqs 1 vs 8, one thread, a Xeon with amx_bf16, oneDNN
3.12): fp32 is batch-invariant under every cap, and its bits depend only on MKL's code path, not on
oneDNN's cap (fp32 matmuls are MKL's): AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2, MKL_CBWR=AVX2,STRICT) and
the default cap with MKL_CBWR=AVX2,STRICT alone give the same bits, AVX512_CORE, AVX512_CORE_BF16 and
AMX give the same bits, and the two groups differ in logprob bits (not tokens) on every request.
bf16 is batch-invariant under AVX2 (PyTorch's own bf16 matmul: oneDNN runs none), AVX512_CORE
(gemm:jit:bf16) and AVX512_CORE_BF16 (brg_matmul:avx512_core_bf16), but not under AMX (6 of 8
requests' logprobs and 4 of their token sequences differ between batch 1 and 8); and no two of those
settings give the same bf16 bits, MKL_CBWR included (attention's fp32 matmuls are MKL's), so bf16
results repeat only under the same oneDNN cap and MKL code path. (AVX512_CORE's gemm:jit:bf16 also
failed the kernel probe with 2 threads: 2 rows alone differed from the same rows of 64.)

Ops whose CPU kernels already reduce each row on its own, in order (norms, softmax over a row,
rotary, Sinkhorn's sums over hc_mult elements, stream mixing: one small matmul per token with
K = hc_mult) are shared with `kernels.fast`; on CUDA the Triton kernels of `kernels/triton_ops.py`
replace the reductions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu_isa import check_cpu_isa  # noqa: F401  (importing it caps oneDNN below AMX)
from kernels.fast import (  # noqa: F401  (re-exported: already row-invariant)
    log_softmax,
    mix_streams,
    rms_norm,
    rotary,
    sinkhorn,
    softmax,
    unweighted_rms_norm,
    weighted_combine,
)
from kernels.quant import QuantizedWeight, accepts_quantized

K_BLOCK = 512
ROW_TILE = 256
KV_BLOCK = 64
MIN_KEYS = 8
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
    pad = -n % POINTWISE_ALIGN
    if pad:
        flat = F.pad(flat, (0, pad))
    if flat.numel() <= POINTWISE_PIECE:
        out = fn(flat)
    else:
        out = torch.cat([fn(flat[i:i + POINTWISE_PIECE]) for i in range(0, flat.numel(), POINTWISE_PIECE)])
    return (out[:n] if pad else out).view(x.shape)


def log(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.log, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.softplus, x)


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return pointwise(torch.cos, angles), pointwise(torch.sin, angles)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return pointwise(F.silu, gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def matmul_layout(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """The weight ([..., N, K]) stored the way `linear` wants it: fp32 CPU weights column-major. A
    QuantizedWeight stays as the checkpoint stores it (`linear` decodes it)."""
    if isinstance(weight, QuantizedWeight):
        return weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or _column_major(weight):
        return weight
    return weight.mT.contiguous().mT


def _column_major(weight: torch.Tensor) -> bool:
    return weight.stride(-2) == 1 and weight.stride(-1) >= weight.shape[-2]


@accepts_quantized
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`; a row's bits depend only on that row (see the module docstring).

    A weight that is not in `matmul_layout` is converted on every call: load weights through it.
    (Decode calls are small, so this avoids every torch op it can: each costs microseconds.)
    """
    weight = matmul_layout(weight)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != weight.dtype:
        rows = rows.to(weight.dtype)
    n = rows.shape[0]
    lone = n % ROW_TILE == 1  # no call may see a lone row: it gets a copy of itself as a neighbour
    if lone:
        rows = rows.expand(2, -1) if n == 1 else torch.cat([rows, rows[-1:]])
    if rows.shape[0] <= ROW_TILE:
        out = _tile_linear(rows, weight)
    else:
        out = torch.cat([_tile_linear(rows[i:i + ROW_TILE], weight) for i in range(0, rows.shape[0], ROW_TILE)])
    if lone:
        out = out[:n]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def _tile_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float32 or rows.shape[1] <= K_BLOCK:
        return F.linear(rows, weight)
    out = F.linear(rows[:, :K_BLOCK], weight[:, :K_BLOCK])
    for start in range(K_BLOCK, rows.shape[1], K_BLOCK):
        out += F.linear(rows[:, start:start + K_BLOCK], weight[:, start:start + K_BLOCK])
    return out


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


@accepts_quantized
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, Din], weight [G * Dout, Din] -> [T, G, Dout]."""
    per_group = weight.view(groups, -1, weight.shape[-1])
    return torch.stack([linear(x[:, g], per_group[g]) for g in range(groups)], dim=1)


def _at_least(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key lists padded (with invalid zero keys) to MIN_KEYS: narrower score matmuls take the
    library's matrix-vector paths, which sum differently."""
    pad = MIN_KEYS - keys.shape[1]
    if pad <= 0:
        return keys, valid
    return F.pad(keys, (0, 0, 0, pad)), F.pad(valid, (0, pad), value=False)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV attention with a per-head sink; probabilities summed and applied in KV_BLOCK blocks.

    q [T, H, D], kv [T, K, D], valid [T, K], sinks [H] fp32 -> [T, H, D] in q's dtype, with fp32
    statistics and accumulator. Scores come from one matmul over all K keys (a key's score does
    not depend on K); the max is exact in any order; exp runs on whole padded blocks; each block's
    sum and its value matmul (K <= KV_BLOCK, trailing keys of probability 0 add exact zeros) are
    added in block order after the sink's term. Keys past a token's own list (the batch's longer
    lists) have probability 0 and are zeroed (they are whatever the cache row held), so they add nothing.
    """
    tokens, heads, _ = q.shape
    keys, valid = _at_least(kv.float(), valid)
    keys = keys.masked_fill(~valid.unsqueeze(-1), 0)  # a stale row may hold NaN, and 0 * NaN is NaN
    width = keys.shape[1]
    blocks = -(-width // KV_BLOCK)
    scores = torch.bmm(q.float(), keys.transpose(1, 2)) * scale
    scores = scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    if blocks * KV_BLOCK != width:
        scores = F.pad(scores, (0, blocks * KV_BLOCK - width), value=float("-inf"))
    sinks = sinks.float()
    top = torch.maximum(scores.amax(dim=-1), sinks)
    probs = pointwise(torch.exp, scores - top.unsqueeze(-1))
    block_sums = probs.view(tokens, heads, blocks, KV_BLOCK).sum(dim=-1)
    total = pointwise(torch.exp, sinks - top)
    acc = None
    for block in range(blocks):
        start, stop = block * KV_BLOCK, min((block + 1) * KV_BLOCK, width)
        total = total + block_sums[..., block]
        part = torch.bmm(probs[..., start:stop], keys[:, start:stop])
        acc = part if acc is None else acc + part
    return (acc / total.unsqueeze(-1)).to(q.dtype)


def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Lightning-indexer scores sum_h w[t,h] * relu(q[t,h] . k[t,s]) * scale, heads summed in order."""
    width = keys.shape[1]
    keys, _ = _at_least(keys.float(), valid)
    weighted = torch.relu(torch.bmm(q.float(), keys.transpose(1, 2))) * scale * head_weights.unsqueeze(-1)
    summed = weighted[:, 0]
    for h in range(1, weighted.shape[1]):
        summed = summed + weighted[:, h]
    return summed[:, :width].masked_fill(~valid, float("-inf"))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties to the lowest index (so the choice does not
    depend on how many trailing candidates the row was padded with)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
