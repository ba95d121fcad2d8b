"""`numerics="batch_invariant"`: the same primitives with a fixed reduction order per row.

A row's result depends only on that row's data, never on how many rows share the call, what
they hold, how much padding the batch needed, or the thread count. On CPU the rule is that **no
library call has a shape that depends on the batch**: the libraries under PyTorch (MKL, oneDNN) pick
kernels, blockings and thread splits from a call's shape, and what they pick differs between CPUs
(MKL runs other code on AMD than on Intel) and library code paths, so the discipline leaves them no
batch-dependent choice to make:

- matmuls (`linear`) pad the rows to whole tiles and make one library call per tile; fp32 ones
  also cut K into blocks of `K_BLOCK` columns, one call each, whose results we add in order. A row's
  bits are those of a call of `ROW_TILE` rows ([ROW_TILE, K_BLOCK] x [K_BLOCK, N]), the same for a
  lone decode row as for a 2,048-token prefill. Cutting every batch into ROW_TILE rows costs a lone
  row 24 rows of work and a prefill many small calls, so batches are cut into other tiles of
  `ROW_TILES` too (`cut_rows`), each only where it was proven, at start and again on each weight,
  to give every row the bits of ROW_TILE calls (`RowTiles`, fp32 only); a tile that fails is not used, so the bits are
  the same either way. fp32 calls go to oneDNN's inner product
  (its JIT kernels are chosen by instruction set, not vendor, and it takes the column-major weight
  `matmul_layout` stores without copying it), except on small weights (`MKL_WEIGHT`), whose calls are
  mostly fixed cost, where MKL's sgemm is used if its ROW_TILE calls are proven on the weight's shape
  at its first call (`library_for`: three places in the tile, one thread, the current count and every
  core; the choice is per shape, never per batch or thread count); bf16 ones to F.linear, which
  PyTorch sends to oneDNN too (fp32 accumulation, one rounding at the end, so K stays whole);
- attention and indexer scores cut every token's keys into blocks of KV_BLOCK (the last padded with
  invalid keys) and compute each (token, block) pair's [H, D] x [D, KV_BLOCK] product, and attention
  each block's value product, through `batched_matmul`, whose library calls hold exactly
  MATRIX_BATCH matrices; probabilities are summed and applied block by block in block order. Keys
  beyond a token's own list have probability 0 and add exact zeros; stream mixing (`mix_streams`)
  is written out as elementwise products summed over the source streams in order;
- top-k breaks ties to the lowest index;
- transcendental pointwise functions (exp, sigmoid, silu, softplus, cos, sin) go through
  `pointwise`: PyTorch's CPU loops run full SIMD vectors and finish a buffer's tail with the
  scalar function, whose last bit can differ, so where an element lands in the buffer (which
  depends on the batch) would otherwise decide its bits. Padded pieces make every element take
  the vector path;
- sums the model spells out (hyper-connection collapse, MoE weight normalisation, window
  pooling) go through `ordered_sum`, a fixed tree of elementwise adds.

What is still left to the libraries, and so measured on every machine before an engine serves
(`kernels/selftest.py`), is that one call shape computes a row the same way wherever the row sits
in its tile and at any thread count, that calls of the other proven row tiles compute it as a
ROW_TILE call does, and that PyTorch's own row-wise kernels (norms, softmax,
Sinkhorn's sums, rotary, the pointwise loops) reduce a row by its length alone. Measured on an AMD
EPYC Zen 5 (AVX-512 with bf16, no AMX; MKL 2024.2's non-Intel path, oneDNN 3.12, 1 to 16 threads),
an AMD EPYC Zen 4 (the same, 2 threads), an AMD EPYC Zen 3 (AVX2 only, 2 threads) and an Intel Xeon with AMX (torch 2.11: MKL 2024.2's
AVX-512 path, oneDNN 3.10, 1 to 16 threads), each under the library paths of harness/cpu_paths.py
(benchmarks/results/cpu_invariance_paths*.json). What the fixed shapes replaced: calls of
up to 256 rows with one row paired with a copy of itself, which were invariant on Intel's AVX-512
path but not on MKL's AVX2 path (it picks sgemm kernels by row count) nor on AMD CPUs (every fp32
matmul of 3, 5, 13, ... rows differed from the same rows of a larger call).
ROW_TILE was chosen by measurement (benchmarks/results/cpu_invariance_cost.json): as the only tile,
smaller ones cost prefill and larger ones decode, and oneDNN 3.10's AVX2 gemm on a Xeon varied rows
inside a 32-row tile (so 32 is a tile the self-test has to prove, never the one defining the bits).

oneDNN's AMX bf16 kernels (CPUs with amx_bf16) make a row's bits depend on the batch, so importing
this module caps oneDNN at AVX-512 BF16 (`ONEDNN_MAX_CPU_ISA`, unless already set: kernels/cpu_isa.py).
oneDNN reads the variable at the process's first matmul, fp32 ones included, and ignores it
afterwards; `check_cpu_isa` finds out from oneDNN's verbose output which ISA and kernels it actually
uses and refuses batch-invariant bf16 when that is AMX. The cap is process-wide (fast mode runs
without AMX too); manifests record the cap, what was in effect, the CPU and MKL's code path, and
certificates state them.

Ops whose CPU kernels already reduce each row on its own, in order (norms, softmax over a row,
rotary, Sinkhorn's sums over hc_mult elements) are shared with `kernels.fast`; on CUDA the Triton
kernels of `kernels/triton_ops.py` replace the reductions.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.kernels.cpu_isa import check_cpu_isa, cpu_threads, mkl_isa_kernels  # noqa: F401  (importing it caps oneDNN below AMX)
from deepinfer.kernels.fast import (  # noqa: F401  (re-exported: already row-invariant)
    log_softmax,
    rms_norm,
    rotary,
    sinkhorn,
    softmax,
    unweighted_rms_norm,
    weighted_combine,
)
from deepinfer.kernels.fast import scalar
from deepinfer.kernels.quant import QuantizedWeight, accepts_quantized

# the row tile whose calls define a row's bits: a multiple of 8 and 24 (oneDNN 3.10's AVX2 fp32 gemm
# on a Xeon gave rows of a 32-row tile other bits at other places in it; 16, 24, 48, 64 and 96 did not)
ROW_TILE = 24
# the tiles a batch's rows may be cut into instead, each only where the start self-test and each
# weight's first call prove its calls give every row ROW_TILE's bits (RowTiles): a lone decode row then costs a 1-row
# call (no padding) where oneDNN's AVX-512 code runs it and a 2-row one under its AVX2 code (which
# sends one row to another kernel, so the proof rejects tile 1 there), 32 decode rows one call and a
# 2,048-token prefill 256-row ones (benchmarks/results/cpu_invariance_cost*.json has the cost)
ROW_TILES = (1, 2, 4, 8, 16, ROW_TILE, 32, 64, 128, 256)
# a call's fixed cost, in rows of its own work: CALL_COST_ROWS plus CALL_COST_MACS multiply-adds' worth
# (oneDNN fp32, 2 threads, AMD EPYC Zen 4: ~23 us a call plus ~18 rows' streaming of its weight, at
# ~1e-5 us a multiply-add), so a small weight's few rows are padded to one tile rather than cut in two
CALL_COST_ROWS = 12
CALL_COST_MACS = 2_000_000
# fp32 weights of at most MKL_WEIGHT elements are multiplied by MKL where its calls are proven on them
# (`library_for`): there a call's fixed cost is most of its time, and oneDNN's is MKL's several times
# over (inside an engine's decode step on a 2-core AMD EPYC Zen 4: ~50 us a call against ~20 us). Where
# MKL runs an instruction set's kernels (Intel CPUs) it takes every fp32 weight it is proven on: on a
# 2-core Xeon its 1- to 4-row calls cost 1.5-4.7x less than oneDNN's at every weight size measured (512 x
# 512 to 8192 x 512: 16 against 46 us, 436 against 688 us), and 24-row ones about the same
MKL_WEIGHT = 32768
K_BLOCK = 512  # fp32 reduction width per matmul call (2048 let oneDNN split K over 8+ threads on a Xeon)
KV_BLOCK = 64  # keys per attention / indexer score matrix
MATRIX_BATCH = 16  # matrices per batched matmul call
POINTWISE_ALIGN = 64  # a multiple of two SIMD vectors on every x86 ISA PyTorch targets
POINTWISE_PIECE = 16384  # below PyTorch's parallel grain, so one thread runs each piece from its start
CACHED_ZEROS = 16384  # largest block of zeros `padded` keeps for reuse (elements; 256 blocks at most)


def padded(x: torch.Tensor, count: int, dim: int = 0) -> torch.Tensor:
    """x followed by `count` zeros (False for bool) along `dim`: F.pad's result, as one cat with a
    cached block of zeros where that block is small and on the CPU (F.pad costs about twice a cat on
    decode-sized tensors; a device block made first inside a CUDA graph's capture would hold no zeros
    until the graph is replayed)."""
    shape = list(x.shape)
    shape[dim] = count
    cached = x.device.type == "cpu" and math.prod(shape) <= CACHED_ZEROS
    zeros = _zeros(tuple(shape), x.dtype) if cached else x.new_zeros(shape)
    return torch.cat([x, zeros], dim=dim)


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):  # shared with calls outside inference mode too
        return torch.zeros(shape, dtype=dtype)


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
        flat = padded(flat, pad)
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
    if weight.dtype != torch.float32 or _column_major(weight) or weight.device.type != "cpu":
        return weight
    return weight.mT.contiguous().mT


def _column_major(weight: torch.Tensor) -> bool:
    return weight.stride(-2) == 1 and weight.stride(-1) >= weight.shape[-2]


class RowTiles:
    """How `linear` multiplies by a weight: the library (`library_for`) and the row tiles it may cut a
    batch into. Per weight dtype, the candidate tiles the start self-test proved on its probe weights
    (`kernels.selftest.proven_row_tiles`); per weight shape and thread count, those of them proven
    again on the weight itself at its first call (`proven_tiles`), since the kernel a library runs
    depends on the call's shape (on a Xeon, oneDNN's AVX2 code passed the probes with tiles that
    changed a tiny model's bits). ROW_TILE alone where nothing was proven; whatever the cut, a row's
    bits are those of ROW_TILE calls of the weight's library: that is what each proof checks."""

    def __init__(self, candidates: dict[torch.dtype, tuple[int, ...]] | None = None) -> None:
        self.candidates = dict(candidates or {})
        self.by_shape: dict[tuple[torch.dtype, int, int, int], tuple[str, tuple[int, ...]]] = {}

    def plan(self, weight: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        """(library, tiles) for `weight` at the current thread count."""
        key = (weight.dtype, weight.shape[0], weight.shape[1], torch.get_num_threads())
        plan = self.by_shape.get(key)
        if plan is None:
            library, candidates = library_for(weight), self.candidates.get(weight.dtype, (ROW_TILE,))
            if candidates != (ROW_TILE,) and library == "mkl":
                candidates = ROW_TILES  # the probes prove oneDNN's tiles; an MKL weight proves its own
            tiles = candidates if candidates == (ROW_TILE,) else proven_tiles(weight, candidates, library)
            plan = self.by_shape[key] = (library, tiles)
        return plan


CANONICAL = RowTiles()
_libraries: dict[tuple[torch.dtype, int, int], str] = {}


def library_for(weight: torch.Tensor) -> str:
    """The library whose calls define `weight`'s bits on this machine, by weight shape: "mkl" for an
    fp32 weight MKL is preferred for (at most MKL_WEIGHT elements, or any size where MKL runs an
    instruction set's kernels: `mkl_isa_kernels`) and whose ROW_TILE calls MKL computes the same way at
    three places in the tile, at one thread, at the current count and at every core (`_mkl_proven`; on
    an AMD EPYC its generic code fails for a 6-column router weight), otherwise "onednn". Decided once
    per shape from the library path (a recorded factor) and the proof, so the bits do not depend on
    the batch or the thread count a process runs at."""
    key = (weight.dtype, weight.shape[0], weight.shape[1])
    if key not in _libraries:
        preferred = weight.dtype == torch.float32 and (weight.shape[0] * weight.shape[1] <= MKL_WEIGHT
                                                       or mkl_isa_kernels())
        _libraries[key] = "mkl" if not _ONEDNN_LINEAR or (preferred and _mkl_proven(weight)) else "onednn"
    return _libraries[key]


def _mkl_proven(weight: torch.Tensor) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * ROW_TILE + 3, weight.shape[1], generator=gen)
    with cpu_threads(1):
        canonical = _cut_linear(x, weight, (ROW_TILE,), "mkl")
        if not all(torch.equal(_cut_linear(x[start:], weight, (ROW_TILE,), "mkl"), canonical[start:])
                   for start in (1, ROW_TILE // 2 + 1)):
            return False
    for threads in {torch.get_num_threads(), os.cpu_count() or 1} - {1}:
        with cpu_threads(threads):
            if not torch.equal(_cut_linear(x, weight, (ROW_TILE,), "mkl"), canonical):
                return False
    return True


def proven_tiles(weight: torch.Tensor, candidates: tuple[int, ...], library: str = "onednn") -> tuple[int, ...]:
    """The tiles of `candidates` whose `library` calls give every row of `x @ weight.T` the bits of
    ROW_TILE calls on this machine (ROW_TILE itself always): seeded batches starting at three places
    in a tile, each ending in a padded partial one, at the current thread count and at one thread."""
    gen = torch.Generator().manual_seed(0)
    proven = []
    for tile in candidates:
        if tile != ROW_TILE:
            x = torch.randn(2 * tile + 3, weight.shape[1], generator=gen).to(weight.dtype)
            canonical = _cut_linear(x, weight, (ROW_TILE,), library)
            if not all(torch.equal(_cut_linear(x[start:], weight, (tile,), library), canonical[start:])
                       for start in (0, 1, tile // 2 + 1)):
                continue
            if torch.get_num_threads() > 1:
                with cpu_threads(1):
                    if not torch.equal(_cut_linear(x, weight, (tile,), library), canonical):
                        continue
        proven.append(tile)
    return tuple(proven)


def call_cost_rows(weight: torch.Tensor) -> int:
    """A library call's fixed cost against `weight` ([N, K]), in rows of that call's work."""
    return CALL_COST_ROWS + CALL_COST_MACS // (min(weight.shape[1], K_BLOCK) * max(weight.shape[0], 1))


@functools.lru_cache(maxsize=8192)
def cut_rows(n: int, tiles: tuple[int, ...], call_cost: int = CALL_COST_ROWS) -> tuple[int, ...]:
    """The tile sizes (largest first) `linear` cuts n rows into: whole tiles of the largest, the rest
    covered at the least estimated cost (each call costs its rows plus `call_cost`), padding the
    last one. n = 0 still makes one call of the smallest tile."""
    largest = max(tiles)
    return (largest,) * (n // largest) + _cover(n % largest if n else 1, tuple(sorted(tiles)), call_cost)


@functools.lru_cache(maxsize=8192)
def _cover(rows: int, tiles: tuple[int, ...], call_cost: int) -> tuple[int, ...]:
    best: list[tuple[int, tuple[int, ...]]] = [(0, ())]
    for covered in range(1, rows + 1):
        best.append(min((best[max(0, covered - tile)][0] + tile + call_cost,
                         tuple(sorted(best[max(0, covered - tile)][1] + (tile,), reverse=True)))
                        for tile in tiles))
    return best[rows][1]


@accepts_quantized
def linear(x: torch.Tensor, weight: torch.Tensor, *, row_tiles: RowTiles = CANONICAL) -> torch.Tensor:
    """`x @ weight.T`; a row's bits depend only on that row (see the module docstring): the rows are
    padded to whole tiles (`cut_rows`) and every library call is one tile against one K block, so the
    calls a weight makes have one shape per tile size, whatever the batch, and every tile size
    `row_tiles` allows for the weight was proven to give a row the bits of a ROW_TILE call.

    A weight that is not in `matmul_layout` is converted on every call: load weights through it.
    (Decode calls are small, so this avoids every torch op it can: each costs microseconds.)
    """
    weight = matmul_layout(weight)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != weight.dtype:
        rows = rows.to(weight.dtype)
    library, tiles = row_tiles.plan(weight)
    out = _cut_linear(rows, weight, tiles, library)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def _cut_linear(rows: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, ...], library: str) -> torch.Tensor:
    """rows [n, K] (in the weight's dtype) @ weight.T, one `_tile_linear` call per tile of the cut."""
    n = rows.shape[0]
    cut = cut_rows(n, tiles, call_cost_rows(weight))
    total = sum(cut)
    if total != n:
        rows = padded(rows, total - n)
    if len(cut) == 1:
        out = _tile_linear(rows, weight, library)
    else:
        starts = itertools.accumulate(cut, initial=0)
        out = torch.cat([_tile_linear(rows[start:start + tile], weight, library) for start, tile in zip(starts, cut)])
    return out[:n] if out.shape[0] != n else out


def _onednn_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One oneDNN inner product (its JIT kernels are chosen by instruction set, not by CPU vendor; on
    AMD CPUs, where MKL runs its generic code, it is several times faster on all but small weights).
    MKL only where `library_for` proved it: with one fixed call shape, MKL's generic code (AMD) still
    gave a row other bits at other places in its tile for a 6-column router weight, and so did its
    AVX2 code on an Intel Xeon for small weights (kernels/selftest.py found both)."""
    return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")


def _mkl_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One call of PyTorch's fp32 CPU matmul: MKL's sgemm (also where PyTorch has no oneDNN)."""
    return F.linear(rows, weight)


_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _tile_linear(rows: torch.Tensor, weight: torch.Tensor, library: str) -> torch.Tensor:
    if weight.dtype != torch.float32:
        return F.linear(rows, weight)
    call = _mkl_linear if library == "mkl" else _onednn_linear
    if rows.shape[1] <= K_BLOCK:
        return call(rows, weight)
    out = call(rows[:, :K_BLOCK], weight[:, :K_BLOCK])
    for start in range(K_BLOCK, rows.shape[1], K_BLOCK):
        out += call(rows[:, start:start + K_BLOCK], weight[:, start:start + K_BLOCK])
    return out


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, m, k] @ b [B, k, n] -> [B, m, n], as library calls of exactly MATRIX_BATCH matrices each
    (the last one filled up with zero matrices laid out like the others: MKL runs other kernels for
    transposed operands), so no call's shape or layout depends on B."""
    count = a.shape[0]
    full = count - count % MATRIX_BATCH
    outs = [torch.bmm(a[i:i + MATRIX_BATCH], b[i:i + MATRIX_BATCH]) for i in range(0, full, MATRIX_BATCH)]
    if full < count or count == 0:
        outs.append(torch.bmm(_filled_chunk(a[full:]), _filled_chunk(b[full:]))[:count - full])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _filled_chunk(matrices: torch.Tensor) -> torch.Tensor:
    """`matrices` followed by zero matrices up to MATRIX_BATCH, each laid out as the inputs' are
    (row-major, or transposed)."""
    rows, cols = matrices.shape[1:]
    if matrices.shape[0] and matrices.stride(1) == 1 and matrices.stride(2) != 1:
        chunk = matrices.new_zeros(MATRIX_BATCH, cols, rows).transpose(1, 2)
    else:
        chunk = matrices.new_zeros(MATRIX_BATCH, rows, cols)
    chunk[:matrices.shape[0]] = matrices
    return chunk


def mix_streams(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """comb^T @ streams per token: comb [T, n, n], streams [T, n, H] -> [T, n, H], written out with no
    library call as the CUDA kernel (kernels/triton_fused.py) defines it: in fp32, the sum over source
    streams i in order of comb[i, target] (rounded to the streams' dtype) times stream i."""
    weights = comb.to(streams.dtype).float().unsqueeze(-1).unbind(1)
    sources = streams.float().unsqueeze(2).unbind(1)
    mixed = weights[0] * sources[0]
    for weight, source in zip(weights[1:], sources[1:]):
        mixed += weight * source
    return mixed.to(streams.dtype)


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a fixed tree of elementwise adds (first half + second half, an odd last
    element carried to the next level): library reductions (CUDA's in particular) pick how to split
    a reduction from the whole tensor's shape; elementwise adds do not. log2(n) adds, not n - 1."""
    while x.shape[dim] > 1:
        n = x.shape[dim]
        first, second, *odd = x.split_with_sizes([n // 2, n // 2] + [1] * (n % 2), dim)
        paired = first + second
        x = torch.cat([paired, *odd], dim=dim) if odd else paired
    return x.squeeze(dim)


def window_pool(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Compressor pooling: per window, a softmax over slots of (gate + bias) weights the kv rows.

    kv, gate: [N, S, D]; bias: [S, D] fp32 -> [N, D] fp32. The softmax runs over a last dimension
    (row-local) and the slots are summed in order.
    """
    weights = softmax((gate.float() + bias).transpose(1, 2), dim=-1).transpose(1, 2)
    return ordered_sum(kv.float() * weights, dim=1)


@accepts_quantized
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int, *,
                   row_tiles: RowTiles = CANONICAL) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, Din], weight [G * Dout, Din] -> [T, G, Dout]."""
    per_group = weight.view(groups, -1, weight.shape[-1])
    if _column_major(weight) and weight.shape[0] != per_group.shape[1]:
        per_group = per_group.mT.contiguous().mT  # each group's own column-major matrix, as oneDNN reads it
    return torch.stack([linear(x[:, g], per_group[g], row_tiles=row_tiles) for g in range(groups)], dim=1)


def _key_blocks(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [T, K, D] (fp32) and valid [T, K] padded (with invalid zero keys) to whole KV_BLOCKs:
    keys [T * blocks, KV_BLOCK, D] and valid [T, blocks, 1, KV_BLOCK]."""
    tokens, width, dim = keys.shape
    blocks = max(1, -(-width // KV_BLOCK))
    pad = blocks * KV_BLOCK - width
    if pad:
        keys, valid = padded(keys, pad, dim=1), padded(valid, pad, dim=1)
    return keys.reshape(tokens * blocks, KV_BLOCK, dim), valid.view(tokens, blocks, 1, KV_BLOCK)


def _block_scores(q: torch.Tensor, key_blocks: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] . every key of its token's blocks -> [T, blocks, H, KV_BLOCK]: one [H, D] x
    [D, KV_BLOCK] product per (token, block) through `batched_matmul`, so no call's shape depends on
    how many keys the batch's tokens have."""
    tokens, heads, dim = q.shape
    blocks = key_blocks.shape[0] // tokens
    per_block = q.float().unsqueeze(1).expand(tokens, blocks, heads, dim).reshape(tokens * blocks, heads, dim)
    return batched_matmul(per_block, key_blocks.transpose(1, 2)).view(tokens, blocks, heads, KV_BLOCK)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV attention with a per-head sink; probabilities summed and applied in KV_BLOCK blocks.

    q [T, H, D], kv [T, K, D], valid [T, K], sinks [H] fp32 -> [T, H, D] in q's dtype, with fp32
    statistics and accumulator. Keys are cut into KV_BLOCK blocks (the last padded with invalid
    keys); a block's scores and its value product are one fixed-shape matrix product per token
    (`batched_matmul`); the max is exact in any order; exp runs on whole padded blocks; each block's
    sum and value product are added in block order after the sink's term. Keys past a token's own
    list (the batch's longer lists, and the padding) have probability 0 and are zeroed (they are
    whatever the cache row held), so they add exact zeros.
    """
    tokens, heads, dim = q.shape
    keys = kv.float().masked_fill(~valid.unsqueeze(-1), 0)  # a stale row may hold NaN, and 0 * NaN is NaN
    key_blocks, valid = _key_blocks(keys, valid)
    scores = (_block_scores(q, key_blocks) * scalar(scale)).masked_fill_(~valid, float("-inf"))
    sinks = sinks.float()
    top = torch.maximum(scores.amax(dim=(1, 3)), sinks)
    probs = pointwise(torch.exp, scores - top[:, None, :, None])
    block_sums = probs.sum(dim=-1)
    total = pointwise(torch.exp, sinks - top)
    for block in range(probs.shape[1]):
        total = total + block_sums[:, block]
    parts = batched_matmul(probs.view(-1, heads, KV_BLOCK), key_blocks).view(tokens, -1, heads, dim)
    acc = parts[:, 0]
    for block in range(1, parts.shape[1]):
        acc = acc + parts[:, block]
    return (acc / total.unsqueeze(-1)).to(q.dtype)


def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, valid: torch.Tensor, scale: float, *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """Lightning-indexer scores sum_h w[t,h] * relu(q[t,h] . k[t,s]) * scale, heads summed in order, where
    w = head_weights in fp32 times weight_scale."""
    tokens, width = valid.shape
    key_blocks, _ = _key_blocks(keys.float(), valid)
    head_weights = head_weights.float() * weight_scale
    weighted = torch.relu(_block_scores(q, key_blocks)) * scale * head_weights[:, None, :, None]
    heads = weighted.unbind(2)
    summed = heads[0]
    for head in heads[1:]:
        summed = summed + head
    return summed.reshape(tokens, -1)[:, :width].masked_fill(~valid, float("-inf"))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties to the lowest index (so the choice does not
    depend on how many trailing candidates the row was padded with)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
