"""Fused small ops for CUDA: each kernel does in one launch what a chain of PyTorch elementwise ops
(or of our own small kernels) does in several, and gives the same bits as that chain on the GPU.

A decode step is hundreds of tiny launches (rotary, the hyper-connection mixing around every block,
SwiGLU, the MoE combine, the caches' quantize-dequantize); each costs a few microseconds of GPU time
whatever its size. The kernels here replace them, one program per row (or per row and column block),
so a row's bits never depend on the batch. How the bits stay those of the unfused ops:

- every elementwise step is the same IEEE fp32 operation, in the same order, rounded to the same
  dtype at the same points as the PyTorch op chain does (a bf16 op computes in fp32 and rounds its
  result to bf16); the kernels are compiled with `enable_fp_fusion=False`, so no multiply and add
  are contracted into one fused multiply-add the chain would not have;
- PyTorch's CUDA sigmoid and SiLU compute x / (1 + exp(-x)) (or 1 / ...) in fp32 with the accurate
  `expf` and an IEEE division, and its cos and sin are `cosf` and `sinf`: the kernels use libdevice's
  `exp`, `cos`, `sin` and `div_rn`, the same functions (the GPU tests compare them with torch's bit for
  bit);
- sums keep the reference's order: `invariant.ordered_sum`'s fixed tree (alone and in the collapse), the MoE
  combine's rank order (`fast.combine_ranks`), Sinkhorn's tile code shared with `sinkhorn`;
- the cache formats' roundings are done on the bits: E4M3 ties to even by adding the dropped bits'
  half less one plus the kept lowest bit (below 2^-6, adding 2^14 rounds to the 2^-9 grid), E2M1 by
  counting the midpoints passed; every division is by a power of two or `div_rn`.

`mix_streams` (comb^T @ streams with K = hc_mult) is defined here rather than by a library matmul:
the comb entries rounded to the streams' dtype, products summed over the source streams in order in
fp32, rounded once. So `hyper_expand`, which fuses it, has a written-down reference.

Under the Triton interpreter (CPU tests) libdevice is not available: the tests map its `exp`, `cos`
and `sin` to the interpreter's own (NumPy's) while they run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.kernels import composite, invariant, sampling

BLOCK_H = 256  # hidden-dimension block of the per-token kernels
ROTARY_ROWS = 16  # rows per rotary program


def _fused(kernel, grid, *args, **constexprs) -> None:
    """Launch without multiply-add contraction (see the module docstring)."""
    kernel[grid](*args, **constexprs, enable_fp_fusion=False)


@triton.jit
def _sigmoid(z):
    """torch.sigmoid's fp32 formula on CUDA."""
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-z))


@triton.jit
def _silu(z):
    """torch's SiLU formula on CUDA (fp32)."""
    return tl.math.div_rn(z, 1.0 + libdevice.exp(-z))


# rotary -----------------------------------------------------------------------------------------

@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, per_token, D, HALF,
                   ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr):
    """ROWS rows of x [rows, D] per program: the leading D - 2 * HALF channels copied, the pairs of
    the trailing ones rotated by their token's angles (row // per_token; minus them if INVERSE) as
    `fast.rotary` does."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    base = row.to(tl.int64)[:, None] * D
    plain = D - 2 * HALF
    for start in range(0, plain, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (cols < plain)[None, :]
        tl.store(out_ptr + base + cols[None, :], tl.load(x_ptr + base + cols[None, :], mask=ok), mask=ok)
    pairs = tl.arange(0, BLOCK_HALF)
    ok = row_ok[:, None] & (pairs < HALF)[None, :]
    angle = (row // per_token).to(tl.int64)[:, None] * HALF + pairs[None, :]
    cos = tl.load(cos_ptr + angle, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + angle, mask=ok, other=0.0)
    if INVERSE:
        sin = -sin
    even_at = base + plain + 2 * pairs[None, :]
    even = tl.load(x_ptr + even_at, mask=ok, other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + even_at + 1, mask=ok, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + even_at, (even * cos - odd * sin).to(out_ty), mask=ok)
    tl.store(out_ptr + even_at + 1, (odd * cos + even * sin).to(out_ty), mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`fast.rotary` in one launch: interleaved RoPE on the trailing `2 * cos.shape[-1]` channels of
    x [T, ..., D]; cos/sin [T, rope_dim // 2] fp32; `inverse` negates sin in the kernel."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    width, half = x.shape[-1], cos.shape[-1]
    rows = x.numel() // width
    plain = width - 2 * half
    _fused(_rotary_kernel, (triton.cdiv(rows, ROTARY_ROWS),), x, cos.float().contiguous(), sin.float().contiguous(),
           out, rows, rows // x.shape[0], width, half, ROWS=ROTARY_ROWS,
           BLOCK_D=min(max(triton.next_power_of_2(plain), 16), 512), BLOCK_HALF=max(triton.next_power_of_2(half), 2),
           INVERSE=inverse)
    return out


@triton.jit
def _rotary_table_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, tokens, HALF, scale, ROWS: tl.constexpr,
                         BLOCK_HALF: tl.constexpr):
    """ROWS tokens per program: angle = position (as fp32) times inverse frequency, its cos and sin
    (libdevice's, which torch's CUDA cos and sin are) times `scale`."""
    token = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pairs = tl.arange(0, BLOCK_HALF)
    ok = (token < tokens)[:, None] & (pairs < HALF)[None, :]
    position = tl.load(pos_ptr + token, mask=token < tokens, other=0).to(tl.float32)
    angle = position[:, None] * tl.load(inv_freq_ptr + pairs, mask=pairs < HALF, other=0.0)[None, :]
    at = token.to(tl.int64)[:, None] * HALF + pairs[None, :]
    tl.store(cos_ptr + at, libdevice.cos(angle) * scale, mask=ok)
    tl.store(sin_ptr + at, libdevice.sin(angle) * scale, mask=ok)


def rotary_table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`composite.rotary_table` with torch's CUDA cos and sin, in one launch."""
    half = inv_freq.shape[0]
    cos = torch.empty(positions.shape[0], half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if cos.numel():
        _fused(_rotary_table_kernel, (triton.cdiv(positions.shape[0], ROTARY_ROWS),), positions.contiguous(),
               inv_freq.float().contiguous(), cos, sin, positions.shape[0], half, scale, ROWS=ROTARY_ROWS,
               BLOCK_HALF=max(triton.next_power_of_2(half), 2))
    return cos, sin


# Sinkhorn and the hyper-connection coefficients ---------------------------------------------------

@triton.jit
def _sinkhorn_tile(logits, ok, iters, eps):
    """Sinkhorn's projection of one [BLOCK, BLOCK] tile of logits (entries outside `ok` are padding):
    softmax rows, then alternate column/row scaling."""
    top = tl.max(tl.where(ok, logits, float("-inf")), axis=1)
    e = tl.where(ok, tl.exp(logits - top[:, None]), 0.0)
    comb = tl.where(ok, e / tl.maximum(tl.sum(e, axis=1), 1.0e-30)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    return comb


@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, n, iters, eps, BLOCK: tl.constexpr):
    """One program per matrix, held in registers."""
    matrix = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    ok = (rows[:, None] < n) & (rows[None, :] < n)
    offsets = matrix * n * n + rows[:, None] * n + rows[None, :]
    logits = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, _sinkhorn_tile(logits, ok, iters, eps), mask=ok)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic projection of [..., n, n] mixing logits (softmax rows, then alternate)."""
    n = logits.shape[-1]
    flat = logits.reshape(-1, n, n).float().contiguous()
    out = torch.empty_like(flat)
    if out.numel():
        _fused(_sinkhorn_kernel, (flat.shape[0],), flat, out, n, iters, eps, BLOCK=max(triton.next_power_of_2(n), 2))
    return out.view(logits.shape)


@triton.jit
def _hyper_coefficients_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, n, iters, eps,
                               BLOCK: tl.constexpr):
    """One program per token: `composite.hyper_coefficients` from its mixing logits [(2 + n) * n]."""
    token = tl.program_id(0).to(tl.int64)
    row = mix_ptr + token * (2 + n) * n
    idx = tl.arange(0, BLOCK)
    ok = idx < n
    pre = tl.load(row + idx, mask=ok, other=0.0) * tl.load(scale_ptr) + tl.load(base_ptr + idx, mask=ok, other=0.0)
    tl.store(pre_ptr + token * n + idx, _sigmoid(pre) + eps, mask=ok)
    post = (tl.load(row + n + idx, mask=ok, other=0.0) * tl.load(scale_ptr + 1)
            + tl.load(base_ptr + n + idx, mask=ok, other=0.0))
    tl.store(post_ptr + token * n + idx, 2.0 * _sigmoid(post), mask=ok)
    tile_ok = ok[:, None] & ok[None, :]
    cells = idx[:, None] * n + idx[None, :]
    logits = (tl.load(row + 2 * n + cells, mask=tile_ok, other=0.0) * tl.load(scale_ptr + 2)
              + tl.load(base_ptr + 2 * n + cells, mask=tile_ok, other=0.0))
    tl.store(comb_ptr + token * n * n + cells, _sinkhorn_tile(logits, tile_ok, iters, eps), mask=tile_ok)


def hyper_coefficients(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`composite.hyper_coefficients` (with torch's sigmoid and `sinkhorn`) in one launch."""
    tokens = mixes.shape[0]
    pre = torch.empty(tokens, n, dtype=torch.float32, device=mixes.device)
    post, comb = torch.empty_like(pre), torch.empty(tokens, n, n, dtype=torch.float32, device=mixes.device)
    if tokens:
        _fused(_hyper_coefficients_kernel, (tokens,), mixes.float().contiguous(), base.float().contiguous(),
               scale.float().contiguous(), pre, post, comb, n, iters, eps, BLOCK=max(triton.next_power_of_2(n), 2))
    return pre, post, comb


# sums over one dimension --------------------------------------------------------------------------

ORDERED_SUM_ELEMENTS = 4096  # leaves a program holds (8 warps): sums per program = this / a tree's leaves


@triton.jit
def _tree_leaves(n, LEVELS: tl.constexpr):
    """`invariant.ordered_sum`'s tree over n terms (first half plus second half, an odd last term
    carried up) as a halving tree of 2^LEVELS leaves, leaf p pairing with p + half level by level: the
    term each leaf holds, -1 where the odd-carry tree has no partner. Leaf p's term is found by walking
    from the root down the bits of p."""
    leaf = tl.arange(0, 1 << LEVELS)
    term = tl.zeros([1 << LEVELS], dtype=tl.int64)  # the root: the odd-carry tree's one top node
    for step in tl.static_range(LEVELS):
        level = LEVELS - 1 - step  # the odd-carry tree's level below `term`'s nodes: ceil(n / 2^level) nodes
        half = ((n + (1 << level) - 1) >> level) // 2
        second = ((leaf >> step) & 1) == 1  # bit `step` of p: leaf p lies under its node's second child
        first_child = tl.where(term < half, term, tl.where(term == half, 2 * half, -1))
        second_child = tl.where(term < half, term + half, -1)
        term = tl.where(term < 0, -1, tl.where(second, second_child, first_child))
    return term


@triton.jit
def _tree_sum(terms, held, ROWS: tl.constexpr, LEVELS: tl.constexpr, DTYPE: tl.constexpr):
    """Sum rows of fp32 terms [ROWS, 2^LEVELS] laid out by `_tree_leaves` (`held`: the leaves holding a
    term) by the halving tree, rounding to DTYPE after every add; where a pair's second leaf holds
    nothing, the first passes up unchanged (no add). -> [ROWS] fp32."""
    for step in tl.static_range(LEVELS):
        first, second = tl.split(tl.permute(tl.reshape(terms, (ROWS, 2, (1 << LEVELS) >> (step + 1))), (0, 2, 1)))
        first_held, second_held = tl.split(
            tl.permute(tl.reshape(held.to(tl.int8), (ROWS, 2, (1 << LEVELS) >> (step + 1))), (0, 2, 1)))
        paired = (first + second).to(DTYPE).to(tl.float32)
        terms = tl.where(second_held != 0, paired, first)
        held = (first_held | second_held) != 0
    return tl.reshape(terms, (ROWS,))


@triton.jit
def _ordered_sum_kernel(x_ptr, out_ptr, outputs, inner, n, LEVELS: tl.constexpr, ROWS: tl.constexpr):
    """Program: ROWS sums r = o * inner + i, each of x[o, :, i] over its n terms by `invariant.ordered_sum`'s
    tree, rounded to x's dtype after every add (`_tree_leaves`, `_tree_sum`)."""
    sums = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = sums < outputs
    outer, column = sums // inner, sums % inner
    term = _tree_leaves(n, LEVELS)
    real = term >= 0
    offsets = (outer * n * inner + column)[:, None] + term[None, :] * inner
    terms = tl.load(x_ptr + offsets, mask=ok[:, None] & real[None, :], other=0.0).to(tl.float32)
    held = tl.broadcast_to(real[None, :], (ROWS, 1 << LEVELS))
    total = _tree_sum(terms, held, ROWS, LEVELS, out_ptr.dtype.element_ty)
    tl.store(out_ptr + sums, total.to(out_ptr.dtype.element_ty), mask=ok)


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`invariant.ordered_sum` in one launch (fp32, bf16 and fp16; other dtypes, and dimensions of
    fewer than two terms, take the op chain)."""
    n = x.shape[dim]
    if n < 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return invariant.ordered_sum(x, dim)
    dim %= x.ndim
    x = x.contiguous()
    shape = x.shape[:dim] + x.shape[dim + 1:]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.numel():
        levels = (n - 1).bit_length()
        rows = max(1, ORDERED_SUM_ELEMENTS >> levels)
        _fused(_ordered_sum_kernel, (triton.cdiv(out.numel(), rows),), x, out, out.numel(),
               x.shape[dim + 1:].numel(), n, LEVELS=levels, ROWS=rows, num_warps=8)
    return out


# V4.1's Engram gating ----------------------------------------------------------------------------------

ENGRAM_BLOCK = 1024  # output columns per program


@triton.jit
def _engram_sums_kernel(streams_ptr, kv_ptr, q_ptr, k_ptr, sums_ptr, H, N, LEVELS: tl.constexpr):
    """Program per (token, stream, quantity): one of the three fp32 sums over H of `composite.engram_mix`
    (0: the stream's squares, 1: the key's squares, 2: the (q * k)-weighted products) by
    `invariant.ordered_sum`'s tree, on terms loaded in its leaf order (`_tree_leaves`). One tree per
    program: Triton 3.6 takes minutes to compile three 8192-leaf trees in one kernel."""
    program = tl.program_id(0).to(tl.int64)
    row, quantity = program // 3, program % 3
    token, stream = row // N, row % N
    term = _tree_leaves(H, LEVELS)[None, :]  # [1, leaves]: the tree's rows as `_tree_sum` takes them
    real = term >= 0
    quantity_of = tl.broadcast_to(quantity, term.shape)  # (the interpreter masks by a tensor, not a scalar)
    hidden = tl.load(streams_ptr + row * H + term, mask=real & (quantity_of != 1), other=0.0).to(tl.float32)
    key = tl.load(kv_ptr + (token * (N + 1) + stream) * H + term, mask=real & (quantity_of != 0), other=0.0)
    key = key.to(tl.float32)
    weighted = real & (quantity_of == 2)
    qk = tl.load(q_ptr + stream * H + term, mask=weighted, other=0.0) * tl.load(k_ptr + stream * H + term,
                                                                                mask=weighted, other=0.0)
    terms = tl.where(quantity == 0, hidden * hidden, tl.where(quantity == 1, key * key, (hidden * qk) * key))
    total = _tree_sum(terms, real, 1, LEVELS, tl.float32)
    tl.store(sums_ptr + program + tl.arange(0, 1), total)


@triton.jit
def _engram_out_kernel(streams_ptr, kv_ptr, sums_ptr, out_ptr, H, inverse_h, eps, scale, floor, N,
                       BLOCK: tl.constexpr):
    """Program per (token, stream, column block): the stream's gate from its three sums, then its columns
    plus gate * value. The mean of the squares multiplies by 1/H (`inverse_h`, fp32): PyTorch's CUDA
    division by a host scalar is a multiplication by its reciprocal."""
    row = tl.program_id(0).to(tl.int64)
    token = row // N
    hidden_squares = tl.load(sums_ptr + row * 3)
    key_squares = tl.load(sums_ptr + row * 3 + 1)
    dot = tl.load(sums_ptr + row * 3 + 2)
    rstd = libdevice.rsqrt(hidden_squares * inverse_h + eps) * libdevice.rsqrt(key_squares * inverse_h + eps)
    dot = dot * rstd * scale
    magnitude = tl.sqrt_rn(tl.where(tl.abs(dot) < floor, floor, tl.abs(dot)))  # NaN stays NaN, as clamp_min
    sign = dot.to(tl.uint32, bitcast=True) & 0x80000000
    gate = _sigmoid((magnitude.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True))  # copysign
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = columns < H
    stream_part = tl.load(streams_ptr + row * H + columns, mask=ok, other=0.0).to(tl.float32)
    value = tl.load(kv_ptr + (token * (N + 1) + N) * H + columns, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + columns, (stream_part + gate * value).to(out_ptr.dtype.element_ty), mask=ok)


def engram_mix(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
               floor: float) -> torch.Tensor:
    """`composite.engram_mix` with `invariant.ordered_sum` and torch's sigmoid, in two launches (the sums,
    then the gates and the output)."""
    tokens, n, width = streams.shape
    out = torch.empty_like(streams)
    if out.numel():
        streams, kv = streams.contiguous(), kv.contiguous()
        sums = torch.empty(tokens * n * 3, dtype=torch.float32, device=streams.device)
        _fused(_engram_sums_kernel, (tokens * n * 3,), streams, kv, q_weight.float().contiguous(),
               k_weight.float().contiguous(), sums, width, n, LEVELS=max(1, (width - 1).bit_length()), num_warps=8)
        block = min(ENGRAM_BLOCK, triton.next_power_of_2(width))
        _fused(_engram_out_kernel, (tokens * n, triton.cdiv(width, block)), streams, kv, sums, out, width,
               1.0 / width, eps, width ** -0.5, floor, n, BLOCK=block)
    return out


# the MoE router ---------------------------------------------------------------------------------------

GATE_MAX_EXPERTS = 4096  # experts a router program holds; more take the op chain


@triton.jit
def _first_largest(keys, candidates, columns, BLOCK: tl.constexpr):
    """The column of the largest key among `candidates`, ties to the lowest column, NaN above every
    number (as a stable descending sort orders them)."""
    nan = candidates & (keys != keys)
    first_nan = tl.min(tl.where(nan, columns, BLOCK), axis=0)
    numbers = candidates & (keys == keys)
    top = tl.max(tl.where(numbers, keys, float("-inf")), axis=0)
    first_top = tl.min(tl.where(numbers & (keys == top), columns, BLOCK), axis=0)
    return tl.where(first_nan < BLOCK, first_nan, first_top)


@triton.jit
def _sqrtsoftplus_gate_kernel(logits_ptr, bias_ptr, chosen_ptr, indices_ptr, weights_ptr, E, scale,
                              K: tl.constexpr, LEVELS: tl.constexpr, BLOCK_E: tl.constexpr, CHOSEN: tl.constexpr):
    """Program per token: scores sqrt(softplus(logits)) rounded to the logits' dtype after each function
    (torch's softplus: x above 20, else log1p(exp(x))), the experts picked one by one as the first
    largest score + bias (or read from `chosen`), their scores summed by `invariant.ordered_sum`'s tree
    (leaves filled as the experts are picked), then each divided by sum + 1e-20 and times `scale`, all
    rounded to the logits' dtype as the op chain rounds them."""
    DTYPE: tl.constexpr = weights_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_E)
    ok = columns < E
    logits = tl.load(logits_ptr + token * E + columns, mask=ok, other=0.0).to(tl.float32)
    soft = tl.where(logits > 20.0, logits, libdevice.log1p(libdevice.exp(logits))).to(DTYPE).to(tl.float32)
    scores = tl.sqrt_rn(soft).to(DTYPE).to(tl.float32)
    if not CHOSEN:
        keys = scores + tl.load(bias_ptr + columns, mask=ok, other=0.0)
    ranks = tl.arange(0, 1 << LEVELS)
    leaves = _tree_leaves(K, LEVELS)
    picked_scores = tl.zeros([1 << LEVELS], dtype=tl.float32)
    leaf_scores = tl.zeros([1 << LEVELS], dtype=tl.float32)
    left = ok
    for rank in tl.static_range(K):
        if CHOSEN:
            expert = tl.load(chosen_ptr + token * K + rank)
        else:
            expert = _first_largest(keys, left, columns, BLOCK_E)
            left = left & (columns != expert)
            tl.store(indices_ptr + token * K + rank, expert.to(tl.int64))
        score = tl.sum(tl.where(columns == expert, scores, 0.0), axis=0)  # the one score (scores are >= +0)
        picked_scores = tl.where(ranks == rank, score, picked_scores)
        leaf_scores = tl.where(leaves == rank, score, leaf_scores)
    total = _tree_sum(leaf_scores[None, :], (leaves >= 0)[None, :], 1, LEVELS, DTYPE)
    denominator = (total + 1e-20).to(DTYPE).to(tl.float32)
    weights = tl.math.div_rn(picked_scores, denominator).to(DTYPE).to(tl.float32) * scale
    tl.store(weights_ptr + token * K + ranks, weights.to(DTYPE), mask=ranks < K)


def moe_gate(logits: torch.Tensor, score_func: str, bias: torch.Tensor | None, chosen: torch.Tensor | None,
             top_k: int, scale: float, *, composed) -> tuple[torch.Tensor, torch.Tensor]:
    """`composite.moe_gate` in one launch for sqrtsoftplus scores of fp32 or bf16 logits [T, E]
    (E <= GATE_MAX_EXPERTS); anything else runs `composed`, the op chain of the same table."""
    tokens, experts = logits.shape
    if score_func != "sqrtsoftplus" or logits.dtype not in (torch.float32, torch.bfloat16) or experts > GATE_MAX_EXPERTS:
        return composed(logits, score_func, bias, chosen, top_k, scale)
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    indices = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device) if chosen is None else chosen
    if tokens:
        _fused(_sqrtsoftplus_gate_kernel, (tokens,), logits.contiguous(),
               logits if bias is None else bias.float().contiguous(), indices.contiguous(), indices, weights,
               experts, scale, K=top_k, LEVELS=(top_k - 1).bit_length(), BLOCK_E=triton.next_power_of_2(experts),
               CHOSEN=chosen is not None)
    return indices, weights


# collapse, stream mixing and expansion ------------------------------------------------------------

@triton.jit
def _collapsed_columns(pre, streams_ptr, token, cols, ok, H, N: tl.constexpr, LEVELS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Columns `cols` of a token's block input, in fp32 before its cast: the sum over the N = 2^LEVELS
    streams of pre [N] (fp32) * stream, as `invariant.ordered_sum`'s tree (first half plus second half,
    halving)."""
    streams = tl.arange(0, N)
    rows = tl.load(streams_ptr + (token * N + streams[None, :]) * H + cols[:, None], mask=ok[:, None], other=0.0)
    terms = pre[None, :] * rows.to(tl.float32)  # [BLOCK, N]: a power of two, every leaf holding its stream
    return _tree_sum(terms, tl.full((BLOCK, N), 1, tl.int1), BLOCK, LEVELS, tl.float32)


@triton.jit
def _hyper_collapse_kernel(pre_ptr, streams_ptr, out_ptr, H, N: tl.constexpr, LEVELS: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Program (token, column block): `_collapsed_columns`, cast to the output."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    pre = tl.load(pre_ptr + token * N + tl.arange(0, N))
    total = _collapsed_columns(pre, streams_ptr, token, cols, ok, H, N, LEVELS, BLOCK)
    tl.store(out_ptr + token * H + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def hyper_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """`composite.hyper_collapse` with `invariant.ordered_sum`, in one launch (a power-of-two stream count;
    any other takes two: the products, then `ordered_sum`)."""
    tokens, n, width = streams.shape
    if n & (n - 1):
        return composite.hyper_collapse(pre, streams, ordered_sum=ordered_sum)
    out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
    if out.numel():
        _fused(_hyper_collapse_kernel, (tokens, triton.cdiv(width, BLOCK_H)), pre.float().contiguous(),
               streams.contiguous(), out, width, N=n, LEVELS=n.bit_length() - 1, BLOCK=BLOCK_H)
    return out


@triton.jit
def _mixed_stream(comb_ptr, streams_ptr, token, target, cols, ok, H, N: tl.constexpr):
    """Stream `target` of comb^T @ streams at columns `cols`, in fp32: sum over source streams i in
    order of comb[i, target] (rounded to the streams' dtype) times stream i."""
    ty = streams_ptr.dtype.element_ty
    row = streams_ptr + token * N * H + cols
    acc = tl.load(comb_ptr + token * N * N + target).to(ty).to(tl.float32) * tl.load(row, mask=ok, other=0.0).to(tl.float32)
    for source in tl.static_range(1, N):
        weight = tl.load(comb_ptr + token * N * N + source * N + target).to(ty).to(tl.float32)
        acc = acc + weight * tl.load(row + source * H, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _mix_streams_kernel(comb_ptr, streams_ptr, out_ptr, H, N: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    for target in tl.static_range(N):
        mixed = _mixed_stream(comb_ptr, streams_ptr, token, target, cols, ok, H, N)
        tl.store(out_ptr + (token * N + target) * H + cols, mixed.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _hyper_expand_kernel(post_ptr, comb_ptr, block_ptr, streams_ptr, out_ptr, H, N: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Program (token, column block): new stream j = post[j] * block output + mixed stream j, each
    term and the sum rounded to the streams' dtype as the op chain rounds them."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    ty = out_ptr.dtype.element_ty
    block_out = tl.load(block_ptr + token * H + cols, mask=ok, other=0.0).to(tl.float32)
    for target in tl.static_range(N):
        post = tl.load(post_ptr + token * N + target).to(ty).to(tl.float32)
        scaled = (post * block_out).to(ty).to(tl.float32)
        mixed = _mixed_stream(comb_ptr, streams_ptr, token, target, cols, ok, H, N).to(ty).to(tl.float32)
        tl.store(out_ptr + (token * N + target) * H + cols, (scaled + mixed).to(ty), mask=ok)


def mix_streams(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """comb^T @ streams per token: comb [T, n, n] fp32, streams [T, n, H] -> [T, n, H] (module docstring)."""
    tokens, n, width = streams.shape
    streams = streams.contiguous()
    out = torch.empty_like(streams)
    if out.numel():
        _fused(_mix_streams_kernel, (tokens, triton.cdiv(width, BLOCK_H)), comb.float().contiguous(), streams, out,
               width, N=n, BLOCK=BLOCK_H)
    return out


def hyper_expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
                 ) -> torch.Tensor:
    """`composite.hyper_expand` with this module's `mix_streams`, in one launch."""
    if block_out.dtype != streams.dtype:
        return composite.hyper_expand(post, comb, block_out, streams, mix_streams=mix_streams)
    tokens, n, width = streams.shape
    streams = streams.contiguous()
    out = torch.empty_like(streams)
    if out.numel():
        _fused(_hyper_expand_kernel, (tokens, triton.cdiv(width, BLOCK_H)), post.float().contiguous(),
               comb.float().contiguous(), block_out.contiguous(), streams, out, width, N=n, BLOCK=BLOCK_H)
    return out


# SwiGLU and the MoE combine -----------------------------------------------------------------------

@triton.jit
def _clamped_swiglu_kernel(gate_ptr, up_ptr, out_ptr, width, gate_stride, up_stride, limit, BLOCK: tl.constexpr):
    """Program (row, column block): silu(min(gate, limit)) * clamp(up, -limit, limit), each op's
    result rounded to the output dtype as the op chain rounds it (NaN passes through the clamps)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    ty = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + cols, mask=ok, other=0.0).to(tl.float32)
    gate = tl.where(gate > limit, limit, gate).to(ty).to(tl.float32)
    up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up)).to(ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (_silu(gate).to(ty).to(tl.float32) * up).to(ty), mask=ok)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`invariant.clamped_swiglu` in one launch: gate, up [..., I] (rows may be strided, as halves of
    one projection are) -> [..., I] in gate's dtype."""
    width = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, width), up.reshape(-1, width)
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1:
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        limit = torch.tensor(limit, dtype=gate.dtype).item()  # torch clamps to the limit in the input's dtype
        _fused(_clamped_swiglu_kernel, (gate2.shape[0], triton.cdiv(width, BLOCK_H)), gate2, up2, out, width,
               gate2.stride(0), up2.stride(0), limit, BLOCK=BLOCK_H)
    return out.view(gate.shape)


@triton.jit
def _combine_kernel(slots_ptr, weights_ptr, shared_ptr, out_ptr, H, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Program (token, column block): sum over ranks, in order, of slot * weight (the weight rounded to
    the slots' dtype, each product and partial sum rounded to it), then with SHARED plus the token's
    shared-expert row, rounded the same way."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    ty = out_ptr.dtype.element_ty
    row = slots_ptr + token * TOP_K * H + cols
    acc = (tl.load(row, mask=ok, other=0.0).to(tl.float32)
           * tl.load(weights_ptr + token * TOP_K).to(ty).to(tl.float32)).to(ty)
    for rank in tl.static_range(1, TOP_K):
        weight = tl.load(weights_ptr + token * TOP_K + rank).to(ty).to(tl.float32)
        term = (tl.load(row + rank * H, mask=ok, other=0.0).to(tl.float32) * weight).to(ty)
        acc = (acc.to(tl.float32) + term.to(tl.float32)).to(ty)
    if SHARED:
        acc = (acc.to(tl.float32) + tl.load(shared_ptr + token * H + cols, mask=ok, other=0.0).to(tl.float32)).to(ty)
    tl.store(out_ptr + token * H + cols, acc, mask=ok)


def weighted_combine(slots: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """`fast.weighted_combine` in one launch: slots [T, k, H], weights [T, k], shared [T, H] or None
    -> [T, H]. A shared term of another dtype is added after, by the op chain."""
    tokens, top_k, width = slots.shape
    if shared is not None and shared.dtype != slots.dtype:
        return weighted_combine(slots, weights) + shared
    out = torch.empty(tokens, width, dtype=slots.dtype, device=slots.device)
    if out.numel():
        _fused(_combine_kernel, (tokens, triton.cdiv(width, BLOCK_H)), slots.contiguous(), weights.contiguous(),
               out if shared is None else shared.contiguous(), out, width, TOP_K=top_k, SHARED=shared is not None,
               BLOCK=BLOCK_H)
    return out


# cache quantize-dequantize ---------------------------------------------------------------------

QDQ_BLOCK = 128  # channels per cache-QDQ program: whole groups of every format (16 and 32 divide it)
QDQ_FORMATS = {"fp8_ue8m0": 32, "mxfp4": 32, "nvfp4": 16}  # format -> the reference's default group


@triton.jit
def _not_below(x, floor):
    """torch.clamp_min(x, floor): NaN stays NaN."""
    return tl.where(x != x, x, tl.maximum(x, floor))


@triton.jit
def _within(x, bound):
    """torch.clamp(x, -bound, bound): NaN stays NaN, infinities saturate."""
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, -bound), bound))


@triton.jit
def _pow2_at_or_above(x):
    """`quant._pow2_at_or_above`: the mantissa carried into the exponent, then dropped (NaN -> -0.0)."""
    magnitude = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return ((magnitude + 0x7FFFFF) & -0x800000).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_round(x):
    """x (fp32, |x| <= 448 or NaN) rounded to the nearest E4M3 number, ties to even, as an fp32 value:
    3 mantissa bits from 2^-6 up (the dropped bits added with the kept lowest bit, then cut), the 2^-9
    grid of E4M3's subnormals below (adding 2^14, whose ulp is 2^-9, rounds there). Zeros and NaN keep
    their bits."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -0x80000000
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    normal = ((bits & 0x7FFFFFFF) + 0x7FFFF + ((bits >> 20) & 1)) & 0x7FF00000
    tiny = ((magnitude + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
    rounded = tl.where(magnitude >= 0.015625, normal, tiny)
    return tl.where(x != x, x, (rounded | sign).to(tl.float32, bitcast=True))


@triton.jit
def _e2m1_round(x, scale):
    """`quant._e2m1_round`: x / scale clamped to +-6, rounded to the nearest E2M1 magnitude (ties to
    the even code; NaN beyond every midpoint: 6), its sign copied back, times scale."""
    scaled = _within(tl.math.div_rn(x, scale), 6.0)
    magnitude = tl.abs(scaled)
    code = ((magnitude > 0.25).to(tl.int32) + (magnitude >= 0.75).to(tl.int32) + (magnitude > 1.25).to(tl.int32)
            + (magnitude >= 1.75).to(tl.int32) + (magnitude > 2.5).to(tl.int32) + (magnitude >= 3.5).to(tl.int32)
            + (magnitude > 5.0).to(tl.int32))
    code = tl.where(magnitude != magnitude, 7, code)
    exponent, mantissa = code >> 1, code & 1
    quarters = tl.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)
    value = quarters.to(tl.float32) * 0.25
    signed = (value.to(tl.int32, bitcast=True) | (scaled.to(tl.int32, bitcast=True) & -0x80000000))
    return signed.to(tl.float32, bitcast=True) * scale


@triton.jit
def _cache_qdq_kernel(x_ptr, out_ptr, width, x_stride, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program (row, channel block): each group of GROUP channels quantized and dequantized as
    `quant.<FORMAT>_qdq` does, channels past the row's end read as the reference's zero padding."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    groups = tl.reshape(x, (BLOCK // GROUP, GROUP))
    magnitudes = tl.abs(groups)
    has_nan = tl.max((magnitudes != magnitudes).to(tl.int32), axis=1)
    amax = tl.where(has_nan > 0, float("nan"), tl.max(magnitudes, axis=1))[:, None]
    if FORMAT == "fp8_ue8m0":
        scale = _pow2_at_or_above(_not_below(amax, 1e-4) * (1.0 / 448.0))
        out = _e4m3_round(_within(tl.math.div_rn(groups, scale), 448.0)) * scale
    elif FORMAT == "mxfp4":
        scale = _pow2_at_or_above(_not_below(amax, 6.0 * 2.0 ** -126) * (1.0 / 6.0))
        out = _e2m1_round(groups, scale)
    else:
        scale = tl.math.div_rn(_not_below(amax, 6.0 * 2.0 ** -9), 6.0)
        scale = _e4m3_round(tl.where(scale != scale, scale, tl.minimum(scale, 448.0)))
        out = _e2m1_round(groups, scale)
    tl.store(out_ptr + row * width + cols, tl.reshape(out, (BLOCK,)).to(out_ptr.dtype.element_ty), mask=ok)


def _cache_qdq(fmt: str, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """`quant.<fmt>_qdq(x)` in one launch (its default group size only): x [..., D] -> x's shape and dtype."""
    if group_size != QDQ_FORMATS[fmt]:
        raise ValueError(f"{fmt}_qdq: the fused kernel groups {QDQ_FORMATS[fmt]} channels, got {group_size}")
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        _fused(_cache_qdq_kernel, (rows.shape[0], triton.cdiv(width, QDQ_BLOCK)), rows, out, width, rows.stride(0),
               FORMAT=fmt, GROUP=QDQ_FORMATS[fmt], BLOCK=QDQ_BLOCK)
    return out.view(x.shape)


def fp8_ue8m0_qdq(x: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    return _cache_qdq("fp8_ue8m0", x, group_size)


def mxfp4_qdq(x: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    return _cache_qdq("mxfp4", x, group_size)


def nvfp4_qdq(x: torch.Tensor, group_size: int = 16) -> torch.Tensor:
    return _cache_qdq("nvfp4", x, group_size)


# the sampler's argmax and Gumbel draw ------------------------------------------------------------------

ARGMAX_BLOCK = 2048  # vocabulary columns per iteration of the argmax programs


@triton.jit
def _mix32(x):
    """`sampling.mix32` on int64 values in [0, 2^32): the same ops, masked to 32 bits the same way."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _argmax_kernel(values_ptr, low_ptr, high_ptr, position_ptr, temperature_ptr, out_ptr, V, stride,
                   NOISE: tl.constexpr, TEMPERATURE: tl.constexpr, BLOCK: tl.constexpr):
    """Program per row: `sampling.first_argmax` of the row's values, with NOISE of the values plus the
    row's Gumbel noise (`sampling.gumbel_argmax`: the uniforms' integer hash as its int64 chain, the
    division by 2^23 exact as a product, libdevice's log, which is torch's on CUDA), and with
    TEMPERATURE of the values divided by the row's temperature first (`div_rn`, an IEEE division as
    torch's), a row at temperature 0 taking the values as they are, without noise. The first index of
    the largest value, blocks swept in order (a later block takes over only with a larger value); any
    NaN in the row gives 0."""
    row = tl.program_id(0).to(tl.int64)
    if NOISE:
        key = _mix32(tl.load(low_ptr + row) ^ _mix32(tl.load(high_ptr + row)))
        key = _mix32((key + tl.load(position_ptr + row) * 0x9E3779B1) & 0xFFFFFFFF)
    if TEMPERATURE:
        temperature = tl.load(temperature_ptr + row)
        drawn = temperature > 0
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.zeros([], tl.int32)
    nan = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(values_ptr + row * stride + cols, mask=ok, other=float("-inf"))
        if NOISE:
            bits = _mix32(((cols.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF) ^ key) >> 9
            u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            noise = -libdevice.log(-libdevice.log(u))
            if TEMPERATURE:
                x = tl.where(drawn, tl.math.div_rn(x, tl.where(drawn, temperature, 1.0)) + noise, x)
            else:
                x = x + noise
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=0))
        x = tl.where(x != x, float("-inf"), x)
        top = tl.max(x, axis=0)
        at = tl.min(tl.where(x == top, cols, V + BLOCK), axis=0)
        better = top > best
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, top, best)
    tl.store(out_ptr + row, tl.where(nan > 0, 0, best_at).to(tl.int64))


def _argmax(values: torch.Tensor, keys: tuple[torch.Tensor, ...] | None,
            temperature: torch.Tensor | None = None) -> torch.Tensor:
    rows, vocab = values.shape
    if values.stride(-1) != 1:
        values = values.contiguous()
    out = torch.empty(rows, dtype=torch.long, device=values.device)
    if rows:
        low, high, position = (k.contiguous() for k in keys) if keys is not None else (out, out, out)
        temperatures = values if temperature is None else temperature.float().contiguous()
        _fused(_argmax_kernel, (rows,), values, low, high, position, temperatures, out, vocab, values.stride(0),
               NOISE=keys is not None, TEMPERATURE=temperature is not None,
               BLOCK=min(ARGMAX_BLOCK, triton.next_power_of_2(vocab)))
    return out


def first_argmax(values: torch.Tensor) -> torch.Tensor:
    """`sampling.first_argmax` of fp32 rows [R, V] in one launch (other dtypes: the op chain)."""
    if values.dtype != torch.float32 or values.dim() != 2:
        return sampling.first_argmax(values)
    return _argmax(values, None)


def gumbel_argmax(logits: torch.Tensor, seed_low: torch.Tensor, seed_high: torch.Tensor, position: torch.Tensor,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    """`sampling.gumbel_argmax` with torch's CUDA log, in one launch (fp32 rows [R, V])."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        return sampling.gumbel_argmax(logits, seed_low, seed_high, position, temperature, log=torch.log)
    return _argmax(logits, (seed_low, seed_high, position), temperature)


# Engram's n-gram rows ------------------------------------------------------------------------------

ENGRAM_ROWS = 16  # tokens per program


@triton.jit
def _engram_rows_kernel(compressed_ptr, query_start_ptr, lookback_ptr, multipliers_ptr, primes_ptr, offsets_ptr,
                        out_ptr, T, B, H, J, N: tl.constexpr, ROWS: tl.constexpr, BLOCK_B: tl.constexpr,
                        BLOCK_J: tl.constexpr):
    """`ngram.engram_rows` for ROWS tokens: each token's sequence row (how many of query_start[1..B-1]
    it has reached), its context column by column (from the step or its row's lookback), the rolling
    XOR of context * multiplier (int64, wrapping as torch's does) and each column j's order
    j // H + 2 n-gram hash taken modulo its prime as torch's remainder (the divisor's sign, here +)."""
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t_ok = t < T
    t64 = t.to(tl.int64)
    b = tl.arange(0, BLOCK_B)
    starts = tl.load(query_start_ptr + 1 + b, mask=b < B - 1, other=T + 1)
    row = tl.sum((starts[None, :] <= t64[:, None]).to(tl.int64), axis=1)
    pos = t64 - tl.load(query_start_ptr + row, mask=t_ok, other=0)
    j = tl.arange(0, BLOCK_J)
    j_ok = j < J
    order = j // H + 1  # the last context column of column j's n-gram
    rolling = tl.zeros((ROWS, BLOCK_J), tl.int64)
    for k in tl.static_range(N):
        from_step = tl.load(compressed_ptr + tl.maximum(t64 - k, 0), mask=t_ok, other=0)
        slot = tl.minimum(tl.maximum(N - 1 - k + pos, 0), N - 2)
        from_lookback = tl.load(lookback_ptr + row * (N - 1) + slot, mask=t_ok, other=0)
        product = tl.where(k <= pos, from_step, from_lookback) * tl.load(multipliers_ptr + k)
        rolling = tl.where((k <= order)[None, :], rolling ^ product[:, None], rolling)
    primes = tl.load(primes_ptr + j, mask=j_ok, other=1)
    rest = rolling % primes[None, :]
    rest = tl.where(rest < 0, rest + primes[None, :], rest)
    out = rest + tl.load(offsets_ptr + j, mask=j_ok, other=0)[None, :]
    tl.store(out_ptr + t64[:, None] * J + j[None, :], out, mask=t_ok[:, None] & j_ok[None, :])


def engram_rows(compressed: torch.Tensor, query_start: torch.Tensor, lookback: torch.Tensor,
                multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`ngram.engram_rows` in one launch (the same integers)."""
    tokens, orders = compressed.shape[0], multipliers.shape[0]
    out = torch.empty(tokens, primes.shape[0], dtype=torch.int64, device=compressed.device)
    if out.numel():
        rows_of = query_start.shape[0] - 1
        _engram_rows_kernel[(triton.cdiv(tokens, ENGRAM_ROWS),)](
            compressed.contiguous(), query_start.contiguous(), lookback.contiguous(), multipliers.contiguous(),
            primes.contiguous(), offsets.contiguous(), out, tokens, rows_of, primes.shape[0] // (orders - 1),
            primes.shape[0], N=orders, ROWS=ENGRAM_ROWS, BLOCK_B=max(triton.next_power_of_2(rows_of), 2),
            BLOCK_J=max(triton.next_power_of_2(primes.shape[0]), 2))
    return out


# the indexer's choice ------------------------------------------------------------------------------

@triton.jit
def _ascending_topk_kernel(scores_ptr, chosen_ptr, out_ptr, good_ptr, W, K, stride, BLOCK: tl.constexpr):
    """One program per row: the row's k chosen entries keyed by index (plus W where the entry scores
    -inf or NaN), sorted, the keys at W and above moved back below it."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < K
    chosen = tl.load(chosen_ptr + row * K + i, mask=ok, other=0)
    score = tl.load(scores_ptr + row * stride + chosen, mask=ok, other=float("-inf"))
    key = tl.where(ok, tl.where(score > float("-inf"), chosen, chosen + W), 3 * W)
    key = tl.sort(key)
    good = key < W
    tl.store(out_ptr + row * K + i, tl.where(good, key, key - W), mask=ok)
    tl.store(good_ptr + row * K + i, good.to(tl.int8), mask=ok)


def ascending_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`composite.ascending_topk` with the invariant `topk_indices`, the reordering in one launch."""
    chosen = invariant.topk_indices(scores, k).contiguous()
    out = torch.empty_like(chosen)
    good = torch.empty(chosen.shape, dtype=torch.bool, device=chosen.device)
    if out.numel():
        if scores.stride(-1) != 1:
            scores = scores.contiguous()
        _ascending_topk_kernel[(scores.shape[0],)](scores, chosen, out, good.view(torch.int8), scores.shape[1], k,
                                                   scores.stride(0), BLOCK=max(triton.next_power_of_2(k), 2))
    return out, good


# paged slots -------------------------------------------------------------------------------------

PAGED_ROWS, PAGED_COLS = 16, 64  # (rows, logical rows) per program of the slot arithmetic


@triton.jit
def _paged_slots_kernel(table_ptr, seq_ptr, first_ptr, keep_ptr, limit_ptr, slots_ptr, valid_ptr, N, W,
                        table_width, block_size, last_row, offset, null_slot, HAS_FIRST: tl.constexpr,
                        HAS_KEEP: tl.constexpr, HAS_LIMIT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A (ROWS, COLS) tile of `paging.paged_slots`: int64 throughout; every row clamped into the
    table is non-negative, so C's division and remainder are Python's there."""
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1) * COLS + tl.arange(0, COLS)
    n_ok = n < N
    ok = n_ok[:, None] & (j < W)[None, :]
    rows = j.to(tl.int64)[None, :] + offset
    if HAS_FIRST:
        rows = rows + tl.load(first_ptr + n, mask=n_ok, other=0).to(tl.int64)[:, None]
    valid = rows >= 0
    if HAS_LIMIT:
        valid = valid & (rows < tl.load(limit_ptr + n, mask=n_ok, other=0).to(tl.int64)[:, None])
    clamped = tl.minimum(tl.maximum(rows, 0), last_row)
    seq = tl.load(seq_ptr + n, mask=n_ok, other=0).to(tl.int64)[:, None]
    block = tl.load(table_ptr + seq * table_width + clamped // block_size, mask=ok, other=0).to(tl.int64)
    slots = block * block_size + clamped % block_size
    if HAS_KEEP:
        keep = tl.load(keep_ptr + n, mask=n_ok, other=0) != 0
        slots = tl.where(keep[:, None], slots, null_slot)
    at = n.to(tl.int64)[:, None] * W + j[None, :]
    tl.store(slots_ptr + at, slots, mask=ok)
    tl.store(valid_ptr + at, valid.to(tl.int8), mask=ok)


def paged_slots(
    table: torch.Tensor, block_size: int, seq: torch.Tensor, first: torch.Tensor | None, offset: int, width: int,
    keep: torch.Tensor | None = None, null_slot: int = 0, limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paging.paged_slots` in one launch (the same integers)."""
    rows = seq.shape[0]
    slots = torch.empty(rows, width, dtype=torch.int64, device=seq.device)
    valid = torch.empty(rows, width, dtype=torch.bool, device=seq.device)
    if slots.numel():
        table = table.contiguous()
        seq = seq.contiguous()
        keep = keep.view(torch.int8) if keep is not None else None
        args = [t.contiguous() if t is not None else seq for t in (first, keep, limit)]
        grid = (triton.cdiv(rows, PAGED_ROWS), triton.cdiv(width, PAGED_COLS))
        _paged_slots_kernel[grid](table, seq, *args, slots, valid.view(torch.int8), rows, width, table.shape[1],
                                  block_size, table.shape[1] * block_size - 1, offset, null_slot,
                                  HAS_FIRST=first is not None, HAS_KEEP=keep is not None,
                                  HAS_LIMIT=limit is not None, ROWS=PAGED_ROWS, COLS=PAGED_COLS)
    return slots, valid


CLOSING_BLOCK = 1024  # tokens per pass of the compaction's one program


@triton.jit
def _closing_block(pos_ptr, real_ptr, start, T, ratio, BLOCK: tl.constexpr):
    """Tokens start .. start + BLOCK: (index, in range, position, closes a window)."""
    t = start + tl.arange(0, BLOCK)
    ok = t < T
    pos = tl.load(pos_ptr + t, mask=ok, other=0)
    return t, ok, pos, ok & (tl.load(real_ptr + t, mask=ok, other=0) != 0) & ((pos + 1) % ratio == 0)


@triton.jit
def _closing_tokens_kernel(pos_ptr, real_ptr, token_ptr, used_ptr, window_ptr, T, ratio, capacity,
                           BLOCK: tl.constexpr):
    """`paging.closing_tokens` as a stable partition in one program: a pass counting the closing
    tokens, then one placing each token at (closing ones before it) or (all closing ones + the others
    before it), the running counts carried from block to block."""
    closing = tl.zeros([], tl.int64)
    for start in range(0, T, BLOCK):
        _, _, _, closes = _closing_block(pos_ptr, real_ptr, start, T, ratio, BLOCK)
        closing += tl.sum(closes.to(tl.int64), axis=0)
    before, others = tl.zeros([], tl.int64), tl.zeros([], tl.int64)
    for start in range(0, T, BLOCK):
        t, ok, pos, closes = _closing_block(pos_ptr, real_ptr, start, T, ratio, BLOCK)
        rank = tl.cumsum(closes.to(tl.int64), axis=0)
        other_rank = tl.cumsum((ok & ~closes).to(tl.int64), axis=0)
        at = tl.where(closes, before + rank - 1, closing + others + other_rank - 1)
        keep = ok & (at < capacity)
        tl.store(token_ptr + at, t.to(tl.int64), mask=keep)
        tl.store(used_ptr + at, closes.to(tl.int8), mask=keep)
        tl.store(window_ptr + at, pos.to(tl.int64) // ratio, mask=keep)
        before += tl.sum(closes.to(tl.int64), axis=0)
        others += tl.sum((ok & ~closes).to(tl.int64), axis=0)


def closing_tokens(positions: torch.Tensor, real: torch.Tensor, ratio: int, capacity: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`paging.closing_tokens` in one launch (the same integers; positions are never negative)."""
    token = torch.empty(capacity, dtype=torch.int64, device=positions.device)
    used = torch.empty(capacity, dtype=torch.bool, device=positions.device)
    window = torch.empty(capacity, dtype=torch.int64, device=positions.device)
    if capacity:
        _closing_tokens_kernel[(1,)](positions.contiguous(), real.contiguous().view(torch.int8), token,
                                     used.view(torch.int8), window, positions.shape[0], ratio, capacity,
                                     BLOCK=min(CLOSING_BLOCK, max(triton.next_power_of_2(positions.shape[0]), 16)))
    return token, used, window


OPS = {
    "ascending_topk": ascending_topk,
    "engram_rows": engram_rows,
    "paged_slots": paged_slots,
    "closing_tokens": closing_tokens,
    "first_argmax": first_argmax,
    "gumbel_argmax": gumbel_argmax,
    "rotary": rotary,
    "rotary_table": rotary_table,
    "sinkhorn": sinkhorn,
    "hyper_coefficients": hyper_coefficients,
    "ordered_sum": ordered_sum,
    "hyper_collapse": hyper_collapse,
    "engram_mix": engram_mix,
    "mix_streams": mix_streams,
    "hyper_expand": hyper_expand,
    "clamped_swiglu": clamped_swiglu,
    "fp8_ue8m0_qdq": fp8_ue8m0_qdq,
    "mxfp4_qdq": mxfp4_qdq,
    "nvfp4_qdq": nvfp4_qdq,
}
