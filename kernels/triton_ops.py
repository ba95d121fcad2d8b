"""Batch-invariant Triton kernels for CUDA (ops not listed in `OPS` fall back to the PyTorch
batch-invariant implementations of `kernels/invariant.py`, whose signatures these match).

Why a row's bits cannot depend on the batch, kernel by kernel:

- every reduction but the split matmul's runs inside one program, over blocks of a fixed
  compile-time size, in a fixed order; no atomics, and which programs exist, and how many, never
  enters a row's arithmetic;
- the row-wise kernels never see the row count (it only sizes the grid), and the matmul's M is
  marked `do_not_specialize`, so Triton compiles one kernel for M = 1 and M = 10_000 alike;
- `_matmul_kernel` computes output tile (m, n) from row tile m of x and column tile n of the
  weight with `tl.dot` over BLOCK_K slices in increasing k, each dot adding its slice into the
  accumulator in k order (16-wide steps of the matrix instructions in bf16, one k at a time in
  fp32 FMA). So an output element is a fold over k in increasing order that depends on its own
  row and column only: the tile shape (`matmul_tiles` and `expert_tiles`, chosen for speed), the
  warps and the pipeline depth leave its bits unchanged (on the H200 BLOCK_K does not matter either,
  but the interpreter's dot does depend on it, so it is one constant). The instruction family does
  not: tiles of 16 or 32 rows, which Hopper computes with mma.sync, gave other bf16 bits than tiles of
  64 rows and more, which it computes with wgmma (H100, V4.1-Flash's experts, K = 5120:
  benchmarks/results/expert_kernel_sweep_v41-flash-5l_h100.json), so every shape has at least 64 rows
  (tests/test_triton_kernels.py checks the dispatchers). That is a property of the compiled code, not
  a promise of Triton's, so the CUDA tests check every tile shape those can pick bit for bit against
  one another;
- products of more than 512 rows of a plain weight run `_persistent_matmul_kernel`: one program per
  SM walks the output tiles, its operands brought in by tensor descriptors (TMA) instead of masked
  pointer loads; a tile's arithmetic is the same `tl.dot` fold over the same BLOCK_K slices, and
  what a descriptor reads past the tensor's edge is +0.0 as the masked loads read it (tested
  bitwise against `_matmul_kernel`, on the interpreter and the H200);
- a weight with fewer than SPLIT_WIDTH columns and a long K (the hyper-connection projections: N =
  24, K = 16384; the query and KV down-projections, compressors, shared experts: N = 256 .. 2048, K
  = 4096) would leave the chip idle at decode sizes in one program per column tile, so its K is cut
  into chunks of K_CHUNK (`k_splits`, from N and K only, never from M): each chunk's product is a
  separate fp32 fold, and the folds are added in chunk order. Up to SPLIT_ROWS rows, and for weights
  of at most NARROW_WIDTH columns at any row count, each chunk runs in its own program and
  `_sum_splits_kernel` adds the fp32 partials; other products (whose row and column tiles fill the
  chip, and whose partials would cost memory) add them inside the program. The same adds in the
  same order: the bits do not depend on which (tested bitwise);
- the norms and softmaxes run one program per row, accumulating BLOCK-wide vectors elementwise
  across the row and reducing the vector once at the end, so the summation tree depends only on
  the row length;
- `_sink_attention_kernel` runs one program per (token, block of 16 heads) over that token's keys in
  blocks of ATTENTION_KEYS with an online softmax that starts from the sink (max = sink, total = 1).
  A program sees one token only, so its `tl.dot`s (scores, then probabilities times keys) involve no
  other token. Invalid keys are never read (their loads are masked to 0) and their probabilities are
  exactly 0, so they add exact zeros; a block with no valid key is skipped. So padding a key list
  with invalid entries, which is what batching sequences of different lengths does, leaves the
  result bit-identical. The model calls it paged: a token's keys are its window rows then its
  compressed entries, read in the cache pools through their slots (`_key_rows`) rather than
  gathered into a [T, K, D] copy first; the keys and their blocks are the same, so are the bits
  (the indexer reads its keys the same way).

A quantized weight (`kernels.quant.QuantizedWeight`: FP8 or MXFP4 bytes and E8M0 scales) is read
as raw bytes and decoded inside `_tile_dot`, slice by slice: the integer arithmetic of `_e4m3`,
`_e2m1` and `_e8m0` gives each code's and scale's exact fp32 value, their product is exact (a
power of two times a value of at most 4 significant bits; only overflow rounds, to inf, as on
the host), and its cast to x's dtype rounds to nearest even as the host's `.to(dtype)` does
(only bf16 subnormals round at all). So the B operand of each `tl.dot` holds the values
`QuantizedWeight.decode()` would have stored there, masked elements +0.0 as before; the K loop,
its BLOCK_K and the dot are the same code, so a quantized weight gives the bits of its decoded
values, and everything above holds for it unchanged.

fp32 matmuls use `input_precision="ieee"` (no TF32), so their results stay close to the fp32
reference; transcendental functions (exp, log, rsqrt) use Triton's default, possibly
approximate, versions: deterministic per element, so invariance is unaffected.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.kernels import composite, fast, triton_fused
from deepinfer.kernels.quant import QuantizedWeight

BLOCK_K = 64  # K slice of the matmuls' dots: one for every tile shape (the interpreter's bits depend on it)
K_CHUNK = 512  # K slice of a chunked matmul (a multiple of BLOCK_K)
SPLIT_WIDTH = 4096  # weights with fewer columns have long K chunked (`k_splits`)
SPLIT_ROWS = 64  # products of at most this many rows run each K chunk in its own program ...
NARROW_WIDTH = 256  # ... as do products with weights this narrow, whatever their rows
ROW_BLOCK = 1024  # vector width of the row-wise kernels (norms, softmax)
KV_BLOCK = 64  # keys per indexer program
ATTENTION_HEADS = 16  # heads per attention program (each key block is read once for all of them)
ATTENTION_KEYS = 32  # keys per attention block (with 16 heads and head_dim 512 the operands fit shared memory)
PERSISTENT_BAND = 8  # row tiles the persistent matmul sweeps together over the weight's column tiles
EXPERT_ROWS = 8  # slots an expert gets on average up to which `expert_tiles` picks its decode shape


@triton.jit
def _weight_rows(w_ptr, s_ptr, matrix, rows, N, K, FORMAT: tl.constexpr, TILE_N: tl.constexpr,
                 TILE_K: tl.constexpr):
    """Pointers to element 0 of rows `rows` (int64) of matrix `matrix` in a contiguous stack of [N, K]
    weights, and to the rows of their scales ([ceil(N / TILE_N), ceil(K / TILE_K)] per matrix)."""
    if FORMAT == "mxfp4":
        w_rows = w_ptr + (matrix * N + rows)[None, :] * (K // 2)
    else:
        w_rows = w_ptr + (matrix * N + rows)[None, :] * K
    s_rows = s_ptr + (matrix * tl.cdiv(N, TILE_N) + rows // TILE_N)[None, :] * tl.cdiv(K, TILE_K)
    return w_rows, s_rows


@triton.jit
def _e4m3(byte):
    """fp32 values of E4M3 bytes: signed zeros, subnormals m * 2^-9, NaN for 0x7F and 0xFF.

    The byte's seven magnitude bits, moved to the top of an fp32's exponent and mantissa fields,
    are the fp32 of value * 2^-120 (both formats' subnormals included, the fp32 ones for the E4M3
    subnormals), and the product with 2^120 is exact: five integer operations and one multiply a
    code, where decoding exponent and mantissa apart took twice that and an int-to-float conversion."""
    bits = byte.to(tl.int32)
    magnitude = tl.where((bits & 0x7F) == 0x7F, 0x7FC00000, (bits & 0x7F) << 20)
    return (magnitude | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120


@triton.jit
def _e2m1(packed, SHIFT: tl.constexpr):
    """fp32 values of the E2M1 codes in bits SHIFT .. SHIFT + 3 of `packed` (int32), as
    `quant.mxfp4_decode` gives them (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), but -0.0 for code 8 where it
    gives +0.0: a B element's zero sign never shows in a product, whose accumulator starts at +0.0.

    As in `_e4m3`, the three magnitude bits at the top of the fp32 fields are value * 2^-126 (0.5 the
    fp32 subnormal 2^-127, which the multiply keeps: Triton does not flush fp32 subnormals), and the sign
    bit goes to the sign."""
    magnitude = (packed << (22 - SHIFT)) & 0x01C00000
    sign = (packed << (28 - SHIFT)) & -0x80000000
    return (magnitude | sign).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _e8m0(byte):
    """fp32 values of E8M0 bytes: 2^(b - 127), byte 0 the subnormal 2^-127, byte 255 NaN."""
    bits = byte.to(tl.int32)
    value = tl.where(bits == 0, 0x00400000, bits << 23)
    return tl.where(bits == 255, 0x7FC00000, value).to(tl.float32, bitcast=True)


@triton.jit
def _b_tile(w_rows, s_rows, start, K, col_ok, FORMAT: tl.constexpr, TILE_K: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """The weight's [BLOCK_K, BLOCK_N] slice at columns start .. start + BLOCK_K (start a multiple of
    BLOCK_K; columns from K on masked); a quantized one decoded to fp32 as `QuantizedWeight.decode` does
    (code value times scale), masked elements +0.0.

    A quantized slice is read as its bytes (MXFP4: BLOCK_K / 2 of them per column, both nibbles used)
    and, when scale tiles and slices nest (TILE_K divides BLOCK_K or BLOCK_K divides TILE_K), one scale
    per tile broadcast over it, so the decode costs a few integer operations per element and no
    gathers. Each element is still one code value times its tile's scale, exactly."""
    ks = start + tl.arange(0, BLOCK_K)
    mask = (ks < K)[:, None] & col_ok[None, :]
    if FORMAT == "plain":
        b = tl.load(w_rows + ks[:, None], mask=mask, other=0.0)
    else:
        if FORMAT == "fp8":
            values = _e4m3(tl.load(w_rows + ks[:, None], mask=mask, other=0))
        else:  # mxfp4: column k is nibble k % 2 (the low one for even k) of byte k // 2
            half = start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + half[:, None], mask=(2 * half < K)[:, None] & col_ok[None, :], other=0)
            packed = packed.to(tl.int32)
            pairs = tl.join(_e2m1(packed, 0), _e2m1(packed, 4))  # [BLOCK_K / 2, BLOCK_N, 2]
            values = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BLOCK_K, BLOCK_N))
        if BLOCK_K % TILE_K == 0:
            groups = start // TILE_K + tl.arange(0, BLOCK_K // TILE_K)
            scale_ok = (groups * TILE_K < K)[:, None] & col_ok[None, :]
            scale = _e8m0(tl.load(s_rows + groups[:, None], mask=scale_ok, other=0))
            tiles = tl.reshape(values, (BLOCK_K // TILE_K, TILE_K, BLOCK_N)) * scale[:, None, :]
            scaled = tl.reshape(tiles, (BLOCK_K, BLOCK_N))
        elif TILE_K % BLOCK_K == 0:  # the slice lies inside one scale tile
            scaled = values * _e8m0(tl.load(s_rows + start // TILE_K, mask=col_ok[None, :], other=0))
        else:  # tiles that do not nest with slices: each element's scale read for it
            scaled = values * _e8m0(tl.load(s_rows + (ks // TILE_K)[:, None], mask=mask, other=0))
        b = tl.where(mask, scaled, 0.0)
    return b


@triton.jit
def _tile_dot(x_rows, w_rows, s_rows, row_ok, col_ok, k_first, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, FORMAT: tl.constexpr, TILE_K: tl.constexpr):
    """One output tile in fp32: rows x_rows[:, k] times weight rows w_rows[k, :] for k in k_first .. K
    (k_first a multiple of BLOCK_K; pointers to each row's element 0, see `_weight_rows`), with `tl.dot`
    over BLOCK_K slices in increasing k. Both matmul kernels use it, so a row's bits are the same
    whichever computes it; a quantized weight's slice is cast to x's dtype, so the dot sees the values
    a decoded weight would hold."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(k_first, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = _b_tile(w_rows, s_rows, start, K, col_ok, FORMAT, TILE_K, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FORMAT: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr, SPLITS: tl.constexpr, K_CHUNK: tl.constexpr,
    SEPARATE: tl.constexpr,
):
    """out[m, g, :] = x[m, g, :] @ w[g].T for row tile program_id(0), column tile 1, and group (and,
    with SEPARATE chunks, K chunk) 2.

    x: [M, G, K] with row stride stride_xm; w: [G * N, K] contiguous (its bytes and scales s for a
    quantized FORMAT, see `_b_operands`); out: [M, G, N] with row stride stride_om. With SPLITS > 1 the
    product is the sum, in chunk order, of the folds over K chunks of K_CHUNK: added here, or with
    SEPARATE written as the fp32 partials [SPLITS, M, G, N], chunk program_id(2) % SPLITS, for
    `_sum_splits_kernel` to add.
    """
    group = tl.program_id(2) // SPLITS if SEPARATE else tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + group * K
    w_rows, s_rows = _weight_rows(w_ptr, s_ptr, 0, (group * N + cols).to(tl.int64), N, K, FORMAT, TILE_N, TILE_K)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + group * N + cols[None, :]
    if SPLITS == 1:
        acc = _tile_dot(x_rows, w_rows, s_rows, row_ok, col_ok, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, FORMAT, TILE_K)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    elif SEPARATE:
        split = tl.program_id(2) % SPLITS
        first = split * K_CHUNK
        acc = _tile_dot(x_rows, w_rows, s_rows, row_ok, col_ok, first, tl.minimum(K, first + K_CHUNK),
                        BLOCK_M, BLOCK_N, BLOCK_K, FORMAT, TILE_K)
        out += split.to(tl.int64) * M * stride_om
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])
    else:
        acc = _tile_dot(x_rows, w_rows, s_rows, row_ok, col_ok, 0, tl.minimum(K, K_CHUNK),
                        BLOCK_M, BLOCK_N, BLOCK_K, FORMAT, TILE_K)
        for first in range(K_CHUNK, K, K_CHUNK):  # as `_sum_splits_kernel` adds the partials
            acc += _tile_dot(x_rows, w_rows, s_rows, row_ok, col_ok, first, tl.minimum(K, first + K_CHUNK),
                             BLOCK_M, BLOCK_N, BLOCK_K, FORMAT, TILE_K)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _descriptor_dot(x_desc, w_desc, row, col, group, N, K, k_first, k_last,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_tile_dot` for a plain weight read through tensor descriptors of x [M, G * K] and w [G * N, K] (K
    a multiple of BLOCK_K when G > 1, so that a slice never reaches the next group's columns): the same
    BLOCK_K slices added by the same `tl.dot`s in the same k order, elements past M and K read as +0.0 as
    its masked loads read them, so each output element gets the same bits. (Columns past N come from
    the next group's weight or zeros; they are computed but never stored.)"""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(k_first, k_last, BLOCK_K):
        a = x_desc.load([row, group * K + start])
        b = w_desc.load([group * N + col, start])
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["M"])
def _persistent_matmul_kernel(
    x_desc, w_desc, out_ptr, M, N, K, G, stride_om, programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    K_CHUNK: tl.constexpr, BAND: tl.constexpr,
):
    """`_matmul_kernel` (without SEPARATE) for plain weights and many rows: `programs` programs, one per
    SM, each walking output tiles program_id(0), + programs, ... in bands of BAND row tiles (so a band's
    column tiles of the weight are read while they are still in L2), its operands brought in by the
    tensor memory accelerator. Each tile's arithmetic is `_matmul_kernel`'s (`_descriptor_dot`, chunks
    added in chunk order), so only the speed differs."""
    row_tiles, col_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = row_tiles * col_tiles
    for tile in tl.range(tl.program_id(0), per_group * G, programs):
        group, within = tile // per_group, tile % per_group
        first_row = within // (BAND * col_tiles) * BAND
        band_rows = tl.minimum(row_tiles - first_row, BAND)
        row_tile = first_row + within % (BAND * col_tiles) % band_rows
        col_tile = within % (BAND * col_tiles) // band_rows
        row, col = row_tile * BLOCK_M, col_tile * BLOCK_N
        if SPLITS == 1:
            acc = _descriptor_dot(x_desc, w_desc, row, col, group, N, K, 0, K, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = _descriptor_dot(x_desc, w_desc, row, col, group, N, K, 0, tl.minimum(K, K_CHUNK),
                                  BLOCK_M, BLOCK_N, BLOCK_K)
            for first in range(K_CHUNK, K, K_CHUNK):
                acc += _descriptor_dot(x_desc, w_desc, row, col, group, N, K, first, tl.minimum(K, first + K_CHUNK),
                                       BLOCK_M, BLOCK_N, BLOCK_K)
        rows, cols = row + tl.arange(0, BLOCK_M), col + tl.arange(0, BLOCK_N)
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + group * N + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = part[0, i] + part[1, i] + ... + part[SPLITS - 1, i], added in that order, cast to out."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < total
    acc = tl.load(part_ptr + offsets, mask=ok, other=0.0)
    for split in range(1, SPLITS):
        acc += tl.load(part_ptr + split * total + offsets, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class Tiles:
    """How the matmul kernels are launched: output tile shape, warps and pipeline depth. Speed only:
    the bits of every output element are the same under every `Tiles` (module docstring)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    persistent: bool = False  # one program per SM walking the tiles, operands read by TMA (plain weights)


def matmul_tiles(rows: int, width: int, dtype: torch.dtype) -> Tiles:
    """The launch shape for `rows` x [width, K] products (measured on the H200,
    benchmarks/results/gemm_tiles_h200.json): up to 64 rows the weight is streamed by as many programs
    as keep the chip busy (narrow column tiles, long K slices); larger products get larger tiles, and
    prefill-sized ones the persistent kernel, with 128 x 256 tiles where there are enough of them
    (wide weights, or many rows of a weight whose K is not chunked)."""
    if rows <= 64:
        return Tiles(64, 64 if width >= 16384 else 32 if width >= 8192 else 16, 4, 4)
    if rows <= 512 or dtype == torch.float32:
        return Tiles(64, 64, 4, 3)
    if width >= 16384 or (rows >= 4096 and width >= SPLIT_WIDTH):
        return Tiles(128, 256, 8, 3, persistent=True)
    return Tiles(128, 128, 8, 4, persistent=True)


def expert_tiles(slots: int, experts: int, width: int, dtype: torch.dtype) -> Tiles:
    """The launch shape for `slots` rows spread over `experts` [width, K] weights: up to EXPERT_ROWS slots
    an expert on average (decode batches), 64 x 64 tiles (the fastest 64-row shape measured on the H100 at
    V4.1-Flash's expert shapes for 1, 64 and 256 tokens, benchmarks/results/expert_kernel_sweep_v41-flash-5l_h100.json);
    more, `matmul_tiles`'s shapes. Never fewer than 64 rows (module docstring: 16- and 32-row tiles give
    other bits)."""
    if slots <= EXPERT_ROWS * experts:
        return Tiles(64, 64, 4, 3)
    return matmul_tiles(slots, width, dtype)


def k_splits(width: int, depth: int) -> int:
    """How many K chunks of K_CHUNK a product with `width` output columns and K = `depth` sums, in chunk
    order: from the weight's shape alone, so a row's bits never depend on the batch."""
    return triton.cdiv(depth, K_CHUNK) if width < SPLIT_WIDTH and depth >= 4 * K_CHUNK else 1


def _b_operands(weight: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The matmul kernels' weight and scale arguments and the constexprs that say how to read them: a
    plain weight as it is (its scale argument unused), a quantized one as raw bytes, decoded in the kernel."""
    if isinstance(weight, QuantizedWeight):
        data, scale = weight.data.view(torch.uint8).contiguous(), weight.scale.view(torch.uint8).contiguous()
        return data, scale, {"FORMAT": weight.fmt, "TILE_N": weight.tile[0], "TILE_K": weight.tile[1]}
    weight = weight.contiguous()
    return weight, weight, {"FORMAT": "plain", "TILE_N": 1, "TILE_K": 1}


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, groups: int) -> torch.Tensor:
    """x [M, G, K] (any float dtype), weight [G * N, K] -> [M, G, N] in weight's dtype."""
    rows, _, depth = x.shape
    x = x.to(weight.dtype).contiguous()
    width = weight.shape[0] // groups
    out = torch.empty(rows, groups, width, dtype=weight.dtype, device=x.device)
    if out.numel() == 0:
        return out
    tiles, splits = matmul_tiles(rows, width, weight.dtype), k_splits(width, depth)
    separate = splits > 1 and (rows <= SPLIT_ROWS or width <= NARROW_WIDTH)
    if tiles.persistent and not separate and _descriptor_ready(x, weight):
        _persistent_matmul(x, weight, out, tiles, splits)
        return out
    w, s, layout = _b_operands(weight)
    target = torch.empty(splits, rows, groups, width, dtype=torch.float32, device=x.device) if separate else out
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(width, tiles.block_n), groups * (splits if separate else 1))
    _matmul_kernel[grid](
        x, w, s, target, rows, width, depth, groups * depth, groups * width,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K, SPLITS=splits, K_CHUNK=K_CHUNK,
        SEPARATE=separate, **layout, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    if separate:
        _sum_splits_kernel[(triton.cdiv(out.numel(), ROW_BLOCK),)](target, out, out.numel(), SPLITS=splits,
                                                                   BLOCK=ROW_BLOCK)
    return out


def _descriptor_ready(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> bool:
    """Whether the persistent kernel can read x and a plain weight through tensor descriptors, which
    want 16-byte aligned bases and row strides (a quantized weight's decode needs `_b_tile`), and whose
    slices must not cross from one group's K into the next."""
    if isinstance(weight, QuantizedWeight) or (x.shape[1] > 1 and x.shape[2] % BLOCK_K):
        return False
    return all(t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0 for t in (x, weight))


def _persistent_matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tiles: Tiles,
                       splits: int) -> None:
    """`_persistent_matmul_kernel` over x [M, G, K] and weight [G * N, K] into out [M, G, N]."""
    rows, groups, depth = x.shape
    width = out.shape[-1]
    x_desc = TensorDescriptor.from_tensor(x.view(rows, groups * depth), [tiles.block_m, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(weight.contiguous(), [tiles.block_n, BLOCK_K])
    count = triton.cdiv(rows, tiles.block_m) * triton.cdiv(width, tiles.block_n) * groups
    programs = min(count, _multiprocessors(x.device))
    _persistent_matmul_kernel[(programs,)](
        x_desc, w_desc, out, rows, width, depth, groups, groups * width, programs,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K, SPLITS=splits, K_CHUNK=K_CHUNK,
        BAND=PERSISTENT_BAND, num_warps=tiles.warps, num_stages=tiles.stages,
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (the persistent kernel's program count); the interpreter's stand-in is 4."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _expert_matmul_kernel(
    x_ptr, rows_ptr, dest_ptr, offsets_ptr, experts_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FORMAT: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
):
    """out[dest[s], :] = x[rows[s], :] @ w[e].T for every slot s of expert e = experts[program_id(1)],
    column tile program_id(0) (without GATHER x's row is s, without SCATTER out's row is s). Expert e's
    slots are offsets[e] .. offsets[e + 1] (read on the device); the program walks them in row tiles,
    each computed by `_tile_dot` as `_matmul_kernel` computes its tiles, so a slot's bits are those of
    its row through `linear` with w[e].

    x: [*, K] with row stride stride_xm; rows, dest: int64 [S]; offsets: int64 [E + 1]; w: [E, N, K]
    contiguous (bytes and scales s for a quantized FORMAT); out: [S, N] contiguous.
    """
    expert = tl.load(experts_ptr + tl.program_id(1))
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows, s_rows = _weight_rows(w_ptr, s_ptr, expert.to(tl.int64), cols.to(tl.int64), N, K, FORMAT, TILE_N, TILE_K)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    for first in range(start, end, BLOCK_M):
        slots = first + tl.arange(0, BLOCK_M)
        slot_ok = slots < end
        src = slots
        if GATHER:
            src = tl.load(rows_ptr + slots, mask=slot_ok, other=0)
        dest = slots
        if SCATTER:
            dest = tl.load(dest_ptr + slots, mask=slot_ok, other=0)
        x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_xm
        acc = _tile_dot(x_rows, w_rows, s_rows, slot_ok, col_ok, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, FORMAT, TILE_K)
        out = out_ptr + dest.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None] & col_ok[None, :])


ROUTE_MAX_SLOTS = 1024  # slots `route_slots` sorts in one program (a decode step's); more take torch's sorts
ROUTE_TERMS = 4096  # comparisons a program holds at once


@triton.jit
def _route_kernel(experts_ptr, rows_ptr, order_ptr, source_ptr, offsets_ptr, active_ptr, S, E, per_row, listed,
                  BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, HAS_ROWS: tl.constexpr):
    """One program: slot s's place in the stable sort by expert is the number of slots with a smaller
    expert plus those before it with the same one; offsets[j] counts the slots of experts below j;
    the experts with slots are listed first, ascending, then the empty ones (the first `listed`)."""
    slot = tl.arange(0, BLOCK_S)
    slot_ok = slot < S
    expert = tl.load(experts_ptr + slot, mask=slot_ok, other=0)
    column = tl.arange(0, BLOCK_E)
    place = tl.zeros([BLOCK_S], dtype=tl.int32)
    below = tl.zeros([BLOCK_E], dtype=tl.int32)
    served = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, S, CHUNK):
        other = start + tl.arange(0, CHUNK)
        other_ok = other < S
        theirs = tl.load(experts_ptr + other, mask=other_ok, other=0)[None, :]
        ahead = (theirs < expert[:, None]) | ((theirs == expert[:, None]) & (other[None, :] < slot[:, None]))
        place += tl.sum((ahead & other_ok[None, :]).to(tl.int32), axis=1)
        below += tl.sum(((theirs < column[:, None]) & other_ok[None, :]).to(tl.int32), axis=1)
        served += tl.sum(((theirs == column[:, None]) & other_ok[None, :]).to(tl.int32), axis=1)
    if HAS_ROWS:
        source = tl.load(rows_ptr + slot, mask=slot_ok, other=0)
    else:
        source = (slot // per_row).to(tl.int64)
    tl.store(order_ptr + place, slot.to(tl.int64), mask=slot_ok)
    tl.store(source_ptr + place, source, mask=slot_ok)
    tl.store(offsets_ptr + column, below.to(tl.int64), mask=column <= E)
    busy = ((served > 0) & (column < E)).to(tl.int32)
    idle = ((served == 0) & (column < E)).to(tl.int32)
    rank = tl.where(busy != 0, tl.cumsum(busy, axis=0), tl.sum(busy, axis=0) + tl.cumsum(idle, axis=0)) - 1
    tl.store(active_ptr + rank, column.to(tl.int64), mask=(column < E) & (rank < listed))


def route_slots(experts: torch.Tensor, n_experts: int, rows: torch.Tensor | None = None, per_row: int = 1,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots experts [S] (int64) grouped by expert: `order` and `offsets` as `fast.sort_by_expert` gives
    them, `active_experts(offsets, S)`, and each sorted slot's source row: rows[order] (order // per_row
    when rows is None). One launch for 1 to ROUTE_MAX_SLOTS slots (integers: the same values as the
    torch chain, which runs otherwise)."""
    count = experts.shape[0]
    if count > ROUTE_MAX_SLOTS or count == 0:  # no slots (a rank the exchange sent none): no launch either
        order, offsets = fast.sort_by_expert(experts.unsqueeze(-1), n_experts)
        return order, offsets, active_experts(offsets, count), order // per_row if rows is None else rows[order]
    device = experts.device
    order, source = (torch.empty(count, dtype=torch.long, device=device) for _ in range(2))
    offsets = torch.empty(n_experts + 1, dtype=torch.long, device=device)
    active = torch.empty(min(n_experts, count), dtype=torch.long, device=device)
    block_s, block_e = triton.next_power_of_2(count), triton.next_power_of_2(n_experts + 1)
    chunk = max(1, ROUTE_TERMS // max(block_s, block_e))
    _route_kernel[(1,)](experts.contiguous(), experts if rows is None else rows.contiguous(), order, source, offsets,
                        active, count, n_experts, per_row, active.shape[0], BLOCK_S=block_s, BLOCK_E=block_e,
                        CHUNK=chunk, HAS_ROWS=rows is not None)
    return order, offsets, active, source


def active_experts(offsets: torch.Tensor, slots: int) -> torch.Tensor:
    """The experts with at least one of the `slots` slots first (ascending), then empty ones: the first
    min(E, slots) of them cover every slot. A fixed-shape compaction on the device (no host read), so
    the expert kernels launch one program column per expert that can have work, not per expert."""
    empty = (offsets[1:] == offsets[:-1]).to(torch.int8)
    return torch.sort(empty, stable=True).indices[:min(empty.shape[0], slots)]


def expert_matmul(
    x: torch.Tensor, rows: torch.Tensor | None, offsets: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
    experts: torch.Tensor | None = None, dest: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per expert e, x[rows[s]] @ weight[e].T for its slots s in offsets[e] .. offsets[e + 1], written to
    row dest[s] of the output: x [*, K], rows and dest int64 [S] (None: row s), offsets int64 [E + 1],
    weight [E, N, K] -> [S, N] in weight's dtype. `experts` (default: `active_experts`) lists the experts
    to run, each slot's expert among them; nothing is read back to the host."""
    x = x.to(weight.dtype).contiguous()
    width, depth = weight.shape[1:]
    count = x.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(count, width, dtype=weight.dtype, device=x.device)
    if out.numel() == 0:
        return out
    experts = active_experts(offsets, count) if experts is None else experts
    w, s, layout = _b_operands(weight)
    tiles = expert_tiles(count, weight.shape[0], width, weight.dtype)
    _expert_matmul_kernel[(triton.cdiv(width, tiles.block_n), experts.shape[0])](
        x, offsets if rows is None else rows, offsets if dest is None else dest, offsets, experts, w, s, out, width,
        depth, x.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K, **layout,
        GATHER=rows is not None, SCATTER=dest is not None, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return out


def expert_outputs(
    x: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
    limit: float, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.fast.expert_outputs` with the invariant matmul and SwiGLU, as two grouped launches over
    the slots sorted by expert on the device, the second writing each slot's row in place: the same
    bits, no host sync."""
    return _expert_outputs(x, route_slots(experts, w13.shape[0], rows), w13, w2, limit)


def _expert_outputs(x: torch.Tensor, routed: tuple, w13: torch.Tensor | QuantizedWeight,
                    w2: torch.Tensor | QuantizedWeight, limit: float) -> torch.Tensor:
    order, offsets, active, source = routed
    hidden = expert_matmul(x, source, offsets, w13, active)
    gate, up = hidden.chunk(2, dim=-1)
    act = triton_fused.clamped_swiglu(gate, up, limit)
    return expert_matmul(act, None, offsets, w2, active, dest=order)


def moe_experts(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight, limit: float, shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.fast.routed_experts` on the grouped kernels and the fused weighted combine (slot s of
    indices [T, k] reads token s // k: `fast.slot_rows`), which adds `shared`."""
    routed = route_slots(indices.reshape(-1), w13.shape[0], per_row=indices.shape[-1])
    slots = _expert_outputs(x, routed, w13, w2, limit)
    return triton_fused.weighted_combine(slots.view(*indices.shape, -1), weights, shared)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` in the weight's dtype: x [..., K], weight [N, K] -> [..., N]."""
    rows = x.reshape(-1, 1, x.shape[-1])
    return _grouped_matmul(rows, weight, 1).view(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, Din], weight [G * Dout, Din] -> [T, G, Dout]."""
    return _grouped_matmul(x, weight, groups)


@triton.jit
def _rms_norm_row(x_ptr, w_ptr, out_ptr, row, N, eps, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """The row at offset `row`. WEIGHTED: (w * (x * r)) cast to out; else x * r.to(out dtype)."""
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < N, other=0.0).to(tl.float32)
        squares += x * x
    inv_rms = tl.math.rsqrt(tl.sum(squares, axis=0) / N + eps)
    out_ty = out_ptr.dtype.element_ty
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < N, other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = w * (x * inv_rms)
        else:
            y = x * inv_rms.to(out_ty).to(tl.float32)  # an exact product: one rounding, as in x's dtype
        tl.store(out_ptr + row + cols, y.to(out_ty), mask=cols < N)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row (`_rms_norm_row`)."""
    _rms_norm_row(x_ptr, w_ptr, out_ptr, tl.program_id(0).to(tl.int64) * N, N, eps, WEIGHTED, BLOCK)


@triton.jit
def _collapsed_norm_kernel(pre_ptr, streams_ptr, x_ptr, w_ptr, out_ptr, H, eps, N: tl.constexpr,
                           LEVELS: tl.constexpr, COLLAPSE_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Program per token: the block input (`triton_fused._collapsed_columns`, written to x as the
    collapse kernel writes it), then `_rms_norm_row` over what it wrote: the bits of the two kernels
    one after the other."""
    token = tl.program_id(0).to(tl.int64)
    pre = tl.load(pre_ptr + token * N + tl.arange(0, N))
    for start in range(0, H, COLLAPSE_BLOCK):
        cols = start + tl.arange(0, COLLAPSE_BLOCK)
        ok = cols < H
        total = triton_fused._collapsed_columns(pre, streams_ptr, token, cols, ok, H, N, LEVELS, COLLAPSE_BLOCK)
        tl.store(x_ptr + token * H + cols, total.to(x_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()  # the row's columns were written by the program's other threads
    _rms_norm_row(x_ptr, w_ptr, out_ptr, token * H, H, eps, True, BLOCK)


def _launch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows == 0:
        return out
    w = x if weight is None else weight.contiguous()
    triton_fused._fused(_rms_norm_kernel, (rows,), x, w, out, width, eps, WEIGHTED=weight is not None,
                        BLOCK=ROW_BLOCK)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with an fp32 weight: fp32 math, cast to x's dtype once."""
    return _launch_rms_norm(x, weight, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm without weight; the fp32 inverse RMS is cast to the output's dtype (`dtype`, x's by
    default) before scaling. x is read in its own dtype and widened in registers, exactly as a cast first."""
    return _launch_rms_norm(x, None, eps, dtype)


def collapsed_norm(pre: torch.Tensor, streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`composite.collapsed_norm` with this module's `rms_norm` and `triton_fused.hyper_collapse`, in one
    launch (a power-of-two stream count; any other takes the two ops)."""
    tokens, n, width = streams.shape
    if n & (n - 1):
        return composite.collapsed_norm(pre, streams, weight, eps, hyper_collapse=triton_fused.hyper_collapse,
                                        rms_norm=rms_norm)
    x = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
    out = torch.empty_like(x)
    if out.numel():
        triton_fused._fused(_collapsed_norm_kernel, (tokens,), pre.float().contiguous(), streams.contiguous(), x,
                            weight.contiguous(), out, width, eps, N=n, LEVELS=n.bit_length() - 1,
                            COLLAPSE_BLOCK=triton_fused.BLOCK_H, BLOCK=ROW_BLOCK)
    return out


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row, fp32 out: max pass, sum-of-exp pass, then the output pass."""
    row = tl.program_id(0).to(tl.int64) * N
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, x)
    row_max = tl.max(top, axis=0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        total += tl.where(cols < N, tl.exp(x - row_max), 0.0)
    row_total = tl.sum(total, axis=0)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < N, other=0.0).to(tl.float32)
        if LOG:
            y = x - row_max - tl.log(row_total)
        else:
            y = tl.exp(x - row_max) / row_total
        tl.store(out_ptr + row + cols, y, mask=cols < N)


def _launch_softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    rows_last = x.movedim(dim, -1).contiguous()
    out = torch.empty(rows_last.shape, dtype=torch.float32, device=x.device)
    width = rows_last.shape[-1]
    rows = rows_last.numel() // width if width else 0
    if rows:
        _softmax_kernel[(rows,)](rows_last, out, width, LOG=log, BLOCK=ROW_BLOCK)
    return out.movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over `dim` in fp32 (any float input dtype)."""
    return _launch_softmax(x, dim, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Log-softmax over `dim` in fp32 (any float input dtype)."""
    return _launch_softmax(x, dim, log=True)


@triton.jit
def _key_rows(a_ptr, a_slots_ptr, a_valid_ptr, A, a_stride, b_ptr, b_slots_ptr, b_valid_ptr, B, b_stride, token,
              keys_idx, PAGED: tl.constexpr):
    """Row pointers and validity of a token's keys `keys_idx` in its list of A keys from `a` (key j: row
    a_slots[token, j], or without PAGED row token * A + j) followed by B keys from `b` (row
    b_slots[token, j - A]). Keys past the list are invalid; an invalid key's row is never read."""
    in_a = keys_idx < A
    in_b = (keys_idx >= A) & (keys_idx < A + B)
    if PAGED:
        a_row = tl.load(a_slots_ptr + token * A + keys_idx, mask=in_a, other=0)
    else:
        a_row = token * A + keys_idx
    b_row = tl.load(b_slots_ptr + token * B + (keys_idx - A), mask=in_b, other=0)
    ok = ((tl.load(a_valid_ptr + token * A + keys_idx, mask=in_a, other=0) != 0)
          | (tl.load(b_valid_ptr + token * B + (keys_idx - A), mask=in_b, other=0) != 0))
    rows = tl.where(in_a, a_ptr + a_row.to(tl.int64) * a_stride, b_ptr + b_row.to(tl.int64) * b_stride)
    return rows, ok


@triton.jit
def _sink_attention_kernel(
    q_ptr, a_ptr, a_slots_ptr, a_valid_ptr, A, a_stride, b_ptr, b_slots_ptr, b_valid_ptr, B, b_stride,
    sinks_ptr, out_ptr, H, D, scale, PAGED: tl.constexpr, HEADS: tl.constexpr, KEY_BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr, LOW_PRECISION_SCORES: tl.constexpr,
):
    """One program per (token, block of HEADS heads): an online softmax over the token's keys
    (`_key_rows`), from the sink, every key block read once for all the block's heads. Scores are one
    `tl.dot` of the heads' queries with the block's keys (bf16 operands when both are bf16, fp32 IEEE
    otherwise), probabilities times keys one fp32 IEEE `tl.dot`; statistics and accumulator fp32."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    head_ok = heads < H
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    q = tl.load(q_ptr + (token * H + heads)[:, None] * D + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :],
                other=0.0)
    if not LOW_PRECISION_SCORES:
        q = q.to(tl.float32)
    top = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)  # running max, starts at the sink
    total = tl.full((HEADS,), 1.0, dtype=tl.float32)  # the sink's exp(sink - top) = 1
    acc = tl.zeros((HEADS, BLOCK_D), dtype=tl.float32)
    for start in range(0, A + B, KEY_BLOCK):
        rows, ok = _key_rows(a_ptr, a_slots_ptr, a_valid_ptr, A, a_stride, b_ptr, b_slots_ptr, b_valid_ptr, B,
                             b_stride, token, start + tl.arange(0, KEY_BLOCK), PAGED)
        if tl.max(ok.to(tl.int32), axis=0) > 0:  # a block with no valid key is an exact no-op
            keys = tl.load(rows[:, None] + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0)
            dots = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision="ieee")  # [HEADS, KEY_BLOCK]
            scores = tl.where(ok[None, :], dots * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            correction = tl.exp(top - new_top)
            probs = tl.where(ok[None, :], tl.exp(scores - new_top[:, None]), 0.0)
            total = total * correction + tl.sum(probs, axis=1)
            acc = acc * correction[:, None] + tl.dot(probs, keys.to(tl.float32), input_precision="ieee")
            top = new_top
    out = out_ptr + (token * H + heads)[:, None] * D + dims[None, :]
    tl.store(out, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


def _launch_sink_attention(q: torch.Tensor, a: torch.Tensor, a_slots: torch.Tensor | None, a_valid: torch.Tensor,
                           b: torch.Tensor | None, b_slots: torch.Tensor | None, b_valid: torch.Tensor | None,
                           sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """`_sink_attention_kernel` over each token's keys: rows a_slots[t] of `a` (without slots, a is the
    gathered [T, K, D] keys), then rows b_slots[t] of `b` (when given). Unused pointer arguments get
    a tensor that is never read."""
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    paged = a_slots is not None
    a_valid = a_valid.to(torch.bool).contiguous().view(torch.uint8)
    a_slots = a_slots.contiguous() if paged else a_valid
    if b is None:
        b, b_slots, b_valid = a, a_slots, a_valid
        b_keys = 0
    else:
        b_keys, b_slots, b_valid = b_slots.shape[1], b_slots.contiguous(), b_valid.to(torch.bool).contiguous().view(torch.uint8)
    block_d = max(triton.next_power_of_2(dim), 16)
    _sink_attention_kernel[(tokens, triton.cdiv(heads, ATTENTION_HEADS))](
        q.contiguous(), a, a_slots, a_valid, a_valid.shape[1], a.stride(-2), b, b_slots, b_valid, b_keys, b.stride(-2),
        sinks.float().contiguous(), out, heads, dim, scale, PAGED=paged, HEADS=ATTENTION_HEADS,
        KEY_BLOCK=ATTENTION_KEYS, BLOCK_D=block_d, LOW_PRECISION_SCORES=q.dtype == a.dtype == torch.bfloat16,
        num_warps=4 if block_d <= 128 else 8,
    )
    return out


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV attention with a per-head sink, keys reduced in ATTENTION_KEYS blocks in order.

    q [T, H, D], kv [T, K, D], valid [T, K] bool, sinks [H] fp32 -> [T, H, D] in q's dtype.
    Softmax statistics and the accumulator are fp32; invalid keys are never read.
    """
    return _launch_sink_attention(q, kv.contiguous(), None, valid, None, None, None, sinks, scale)


def _row_major(cache: torch.Tensor) -> torch.Tensor:
    """A cache pool slice [rows, width] whose rows may be strided but whose columns are contiguous."""
    return cache if cache.stride(-1) == 1 else cache.contiguous()


def paged_sink_attention(
    q: torch.Tensor, window: torch.Tensor, window_slots: torch.Tensor, window_valid: torch.Tensor,
    entries: torch.Tensor | None, entry_slots: torch.Tensor | None, entry_valid: torch.Tensor | None,
    sinks: torch.Tensor, scale: float,
) -> torch.Tensor:
    """`composite.paged_sink_attention` reading the keys in the caches through their slots (nothing
    gathered): the same keys in the same blocks, so the bits of `sink_attention` on the gathered keys."""
    if entries is not None and entries.dtype != window.dtype:  # one kernel reads both through one pointer type
        return composite.paged_sink_attention(q, window, window_slots, window_valid, entries, entry_slots,
                                              entry_valid, sinks, scale, sink_attention=sink_attention)
    return _launch_sink_attention(q, _row_major(window), window_slots, window_valid,
                                  None if entries is None else _row_major(entries), entry_slots, entry_valid,
                                  sinks, scale)


@triton.jit
def _indexer_kernel(q_ptr, keys_ptr, slots_ptr, w_ptr, valid_ptr, out_ptr, H, S, D, key_stride, PAGED: tl.constexpr,
                    scale, weight_scale, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (token, block of keys): heads accumulated in order (a head's weight widened to fp32
    and times weight_scale), -inf where valid[token, s] is false. Key s of a token is row slots[token, s]
    of `keys` (row token * S + s without PAGED)."""
    token = tl.program_id(0).to(tl.int64)
    slots = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    slot_ok, dim_ok = slots < S, dims < D
    if PAGED:
        rows = tl.load(slots_ptr + token * S + slots, mask=slot_ok, other=0).to(tl.int64)
    else:
        rows = token * S + slots
    key_ptrs = keys_ptr + rows[:, None] * key_stride + dims[None, :]
    keys = tl.load(key_ptrs, mask=slot_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for head in range(H):
        q = tl.load(q_ptr + (token * H + head) * D + dims, mask=dim_ok, other=0.0).to(tl.float32)
        weight = tl.load(w_ptr + token * H + head).to(tl.float32) * weight_scale
        acc += tl.maximum(tl.sum(keys * q[None, :], axis=1), 0.0) * scale * weight
    valid = tl.load(valid_ptr + token * S + slots, mask=slot_ok, other=0) != 0
    tl.store(out_ptr + token * S + slots, tl.where(valid, acc, float("-inf")), mask=slot_ok)


def _launch_indexer(q: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor | None, width: int,
                    head_weights: torch.Tensor, valid: torch.Tensor, scale: float, weight_scale: float) -> torch.Tensor:
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, width, dtype=torch.float32, device=q.device)
    if out.numel():
        _indexer_kernel[(tokens, triton.cdiv(width, KV_BLOCK))](
            q.contiguous(), keys, keys if slots is None else slots.contiguous(), head_weights.contiguous(),
            valid.contiguous().view(torch.int8), out, heads, width, dim, keys.stride(-2), slots is not None, scale,
            weight_scale, BLOCK_S=KV_BLOCK, BLOCK_D=triton.next_power_of_2(dim),
        )
    return out


def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, valid: torch.Tensor, scale: float, *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """Lightning-indexer scores sum_h w[t,h] * relu(q[t,h] . k[t,s]) * scale, heads summed in order.

    q [T, H, D], keys [T, S, D], head_weights [T, H] (w: in fp32, times weight_scale), valid [T, S]
    -> [T, S] fp32 (-inf where invalid).
    """
    return _launch_indexer(q, keys.contiguous(), None, keys.shape[1], head_weights, valid, scale, weight_scale)


def paged_indexer_scores(
    q: torch.Tensor, entries: torch.Tensor, entry_slots: torch.Tensor, column: int, head_weights: torch.Tensor,
    valid: torch.Tensor, scale: float, *, weight_scale: float = 1.0,
) -> torch.Tensor:
    """`composite.paged_indexer_scores` reading each index key in the entries pool through its slot."""
    keys = _row_major(entries)[:, column:column + q.shape[-1]]
    return _launch_indexer(q, keys, entry_slots, entry_slots.shape[1], head_weights, valid, scale, weight_scale)


@triton.jit
def _window_pool_kernel(kv_ptr, gate_ptr, bias_ptr, out_ptr, slots_ptr, valid_ptr, S, D, row_stride, bias_stride,
                        PAGED: tl.constexpr, OVERLAP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (window, block of features): max pass, then exp-weighted sum over slots in order.
    Plain: slot s of window w is row w * S + s of kv and gate (row_stride apart), bias row s. PAGED: it
    is row slots[w, s] of the state pool, read only where valid[w, s] (else kv 0, gate -inf); with
    OVERLAP the second half of the slots reads columns D.. of kv, gate and bias row s - S / 2. Without
    HAS_BIAS the bias is 0.0."""
    window = tl.program_id(0).to(tl.int64)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = dims < D
    top = tl.full((BLOCK_D,), float("-inf"), dtype=tl.float32)
    for slot in range(S):
        row, bias_row, shift, read = _pool_slot(slots_ptr, valid_ptr, window, slot, S, dims, PAGED, OVERLAP)
        at = row * row_stride + shift * D + dims
        logit = tl.load(gate_ptr + at, mask=ok & read, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, logit + _pool_bias(bias_ptr, bias_row * bias_stride + shift * D + dims, ok, HAS_BIAS))
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for slot in range(S):
        row, bias_row, shift, read = _pool_slot(slots_ptr, valid_ptr, window, slot, S, dims, PAGED, OVERLAP)
        at = row * row_stride + shift * D + dims
        logit = tl.load(gate_ptr + at, mask=ok & read, other=float("-inf")).to(tl.float32)
        weight = tl.exp(logit + _pool_bias(bias_ptr, bias_row * bias_stride + shift * D + dims, ok, HAS_BIAS) - top)
        total += weight
        acc += weight * tl.load(kv_ptr + at, mask=ok & read, other=0.0).to(tl.float32)
    tl.store(out_ptr + window * D + dims, acc / total, mask=ok)


@triton.jit
def _pool_bias(bias_ptr, at, ok, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        return tl.load(bias_ptr + at, mask=ok, other=0.0)
    return tl.zeros(at.shape, tl.float32)


@triton.jit
def _pool_slot(slots_ptr, valid_ptr, window, slot, S, dims, PAGED: tl.constexpr, OVERLAP: tl.constexpr):
    """(row, bias row, 1 where it reads the second series' columns, whether to read, as a mask like
    `dims`) of slot `slot` of `window` (see _window_pool_kernel)."""
    if PAGED:
        row = tl.load(slots_ptr + window * S + slot)
        read = (tl.zeros_like(dims) + tl.load(valid_ptr + window * S + slot)) != 0
    else:
        row = window * S + slot
        read = dims >= 0
    bias_row = slot
    shift = slot * 0
    if OVERLAP:
        second = slot >= S // 2
        bias_row = tl.where(second, slot - S // 2, slot)
        shift = tl.where(second, 1, 0)
    return row, bias_row, shift, read


def window_pool(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Compressor pooling: per window, a softmax over slots of (gate + bias) weights the kv rows.

    kv, gate: [N, S, D]; bias: [S, D] fp32 -> [N, D] fp32. Slots with gate -inf get weight 0.
    """
    windows, slots, dim = kv.shape
    out = torch.empty(windows, dim, dtype=torch.float32, device=kv.device)
    if out.numel():
        block = min(triton.next_power_of_2(dim), 256)
        _window_pool_kernel[(windows, triton.cdiv(dim, block))](
            kv.contiguous(), gate.contiguous(), bias.float().contiguous(), out, out, out, slots, dim, dim, dim,
            PAGED=False, OVERLAP=False, HAS_BIAS=True, BLOCK_D=block,
        )
    return out


def paged_window_pool(state: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor | None,
                      dim: int, overlap: bool) -> torch.Tensor:
    """`composite.paged_window_pool` in one launch, reading the state rows through their slots: the bits
    of `window_pool` over the gathered, masked rows."""
    windows, count = slots.shape
    out = torch.empty(windows, dim, dtype=torch.float32, device=state.device)
    if out.numel():
        width = 2 * dim if overlap else dim
        if state.stride(-1) != 1:
            state = state.contiguous()
        block = min(triton.next_power_of_2(dim), 256)
        _window_pool_kernel[(windows, triton.cdiv(dim, block))](
            state, state[:, width:], out if bias is None else bias.float().contiguous(), out, slots.contiguous(),
            valid.contiguous().view(torch.int8), count, dim, state.stride(0), width,
            PAGED=True, OVERLAP=overlap, HAS_BIAS=bias is not None, BLOCK_D=block,
        )
    return out


OPS = {
    "linear": linear,
    "grouped_linear": grouped_linear,
    "rms_norm": rms_norm,
    "unweighted_rms_norm": unweighted_rms_norm,
    "collapsed_norm": collapsed_norm,
    "softmax": softmax,
    "log_softmax": log_softmax,
    "sink_attention": sink_attention,
    "paged_sink_attention": paged_sink_attention,
    "indexer_scores": indexer_scores,
    "paged_indexer_scores": paged_indexer_scores,
    "window_pool": window_pool,
    "paged_window_pool": paged_window_pool,
}
