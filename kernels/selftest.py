"""The start self-test: the running CPU's batch-invariant primitives checked before an engine serves.

The CPU discipline (kernels/invariant.py) leaves a few choices to the libraries under PyTorch: that
a call of one fixed shape computes each row the same way at any position in its tile and at any
thread count, and that PyTorch's own row-wise kernels (norms, softmax, pointwise loops) reduce a row
by its length alone. Those choices differ between CPUs and library code paths (MKL takes another path
on AMD than on Intel, oneDNN picks kernels by instruction set), so they are measured here, on the
machine, at start: `check_cpu_invariance(ops, dtype)` runs every primitive the engine calls on a
small batch of seeded inputs, then on parts of that batch (rows alone, runs that start mid-tile, at
one thread and at the engine's thread count), and refuses in one line, naming the first primitive
whose rows differ, the CPU and the library path, unless DEEPINFER_ALLOW_VARIANT_CPU=1 waives it (the
waiver is recorded, like every result). Before it, `proven_row_tiles` finds which row tiles of
`ROW_TILES` give every row the bits of ROW_TILE calls here; the table under test cuts batches into
those, so the self-test covers what engines serve. Both together cost a few tenths of a second per
dtype and thread count, once per process (`results()` is what manifests record).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from deepinfer import kernels
from deepinfer.kernels import cpu_isa, invariant
from deepinfer.kernels.invariant import K_BLOCK, ROW_TILE, ROW_TILES, RowTiles

WAIVER_VARIABLE = "DEEPINFER_ALLOW_VARIANT_CPU"
ROWS = 2 * ROW_TILE + 5  # three tiles, the last one partial
PARTS = (slice(0, 1), slice(ROWS - 1, ROWS), slice(3, 4), slice(ROW_TILE - 2, ROW_TILE + 3), slice(1, ROWS - 2))

# weights the row tiles are proven on: K past one block (a partial last one), a small weight, a
# router-like one of 6 columns and a wide one (oneDNN splits work over N there)
TILE_PROBE_WEIGHTS = ((96, K_BLOCK + 52), (80, 96), (6, 96), (1024, K_BLOCK))

_results: dict[str, dict] = {}
_proven: dict[str, tuple[int, ...]] = {}
_row_tiles: dict[tuple, RowTiles] = {}


class CpuInvarianceError(RuntimeError):
    """A batch-invariant primitive's rows depend on the batch or the thread count on this CPU."""


def waived() -> bool:
    """Whether DEEPINFER_ALLOW_VARIANT_CPU=1 turns the self-test's refusal into a recorded statement."""
    return os.environ.get(WAIVER_VARIABLE) == "1"


def _probes(ops, dtype: torch.dtype) -> list[tuple[str, Callable, tuple]]:
    """Each primitive (some more than once) with seeded inputs whose first dimension is the batch's
    rows (tokens): `linear` on a weight with K in blocks (a partial last one), a small weight and a
    router-like one of 6 columns."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt)

    hidden, heads, dim, keys = 96, 4, 64, 150
    wide = ops.matmul_layout(randn(96, K_BLOCK + 52))  # K past one K block, with a partial last block
    narrow = ops.matmul_layout(randn(80, hidden))
    router = ops.matmul_layout(randn(6, hidden))  # few columns (MKL's generic code varied there)
    lengths = torch.randint(1, keys, (ROWS,), generator=gen)
    valid = torch.arange(keys) < lengths[:, None]
    sinks, norm_weight = randn(heads, dt=torch.float32), randn(hidden, dt=torch.float32)
    angles = randn(ROWS, 16, dt=torch.float32)
    return [
        ("linear", lambda x: ops.linear(x, wide), (randn(ROWS, K_BLOCK + 52),)),
        ("linear", lambda x: ops.linear(x, narrow), (randn(ROWS, hidden),)),
        ("linear", lambda x: ops.linear(x, router), (randn(ROWS, hidden),)),
        ("sink_attention", lambda q, kv, v: ops.sink_attention(q, kv, v, sinks, 0.125),
         (randn(ROWS, heads, dim), randn(ROWS, keys, dim), valid)),
        ("indexer_scores", lambda q, k, w, v: ops.indexer_scores(q, k, w, v, 0.125),
         (randn(ROWS, heads, dim), randn(ROWS, keys, dim), randn(ROWS, heads, dt=torch.float32), valid)),
        ("mix_streams", ops.mix_streams, (randn(ROWS, 4, 4, dt=torch.float32), randn(ROWS, 4, hidden))),
        ("window_pool", lambda kv, gate: ops.window_pool(kv, gate, norm_weight.expand(4, hidden)),
         (randn(ROWS, 4, hidden), randn(ROWS, 4, hidden))),
        ("rms_norm", lambda x: ops.rms_norm(x, norm_weight, 1e-6), (randn(ROWS, hidden),)),
        ("softmax", ops.softmax, (randn(ROWS, 1000, dt=torch.float32),)),
        ("log_softmax", ops.log_softmax, (randn(ROWS, 1000, dt=torch.float32),)),
        ("sinkhorn", lambda x: ops.sinkhorn(x, 20, 1e-6), (randn(ROWS, 4, 4, dt=torch.float32),)),
        ("rotary", lambda x, a: ops.rotary(x, *ops.cos_sin(a)), (randn(ROWS, heads, dim), angles)),
        ("clamped_swiglu", lambda g, u: ops.clamped_swiglu(g, u, 7.0), (randn(ROWS, 300), randn(ROWS, 300))),
    ]


def variant_primitives(ops, dtype: torch.dtype) -> list[str]:
    """The primitives whose rows, on this CPU, differ between the whole probe batch at the current
    thread count and parts of it or the whole at one thread (an empty list: all invariant)."""
    threads = torch.get_num_threads()
    failed = []
    for name, fn, inputs in _probes(ops, dtype):
        whole = fn(*inputs)
        same = [torch.equal(fn(*(x[part] for x in inputs)), whole[part]) for part in PARTS]
        if threads > 1:
            with cpu_isa.cpu_threads(1):
                same.append(torch.equal(fn(*inputs), whole))
        if not all(same) and name not in failed:
            failed.append(name)
    return failed


def proven_row_tiles(dtypes: tuple[torch.dtype, ...]) -> RowTiles:
    """The row tiles `linear` may cut batches into on this machine: for fp32, those of ROW_TILES whose
    oneDNN calls give every row of each probe weight the bits of ROW_TILE calls at the current thread
    count (ROW_TILE itself always; its own invariance is what `check_cpu_invariance` tests), for other
    dtypes ROW_TILE alone (their rounding can hide what a proof looks for); each weight an engine
    multiplies by proves them again on its first call (`RowTiles`; a weight `invariant.library_for`
    puts on MKL proves every tile of ROW_TILES on itself instead). Measured once
    per process, dtype and thread count; one RowTiles per set of candidates, so tables bind once."""
    candidates = {}
    for dtype in dict.fromkeys(dtypes):
        key = f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
        if dtype != torch.float32:
            # only fp32 matmuls return their accumulator: bf16's rounding hides most differences in
            # summation order from a few hundred products (on the Xeon, oneDNN's AVX512_CORE bf16
            # kernels passed these proofs with tiles that then failed check_cpu_invariance)
            _proven[key] = (ROW_TILE,)
        if key not in _proven:
            gen = torch.Generator().manual_seed(1)
            tiles = set(ROW_TILES)
            for shape in TILE_PROBE_WEIGHTS:
                weight = invariant.matmul_layout(torch.randn(*shape, generator=gen).to(dtype))
                tiles &= set(invariant.proven_tiles(weight, tuple(sorted(tiles))))
            _proven[key] = tuple(sorted(tiles))
        candidates[dtype] = _proven[key]
    key = tuple(sorted((str(dtype), tiles) for dtype, tiles in candidates.items()))
    if key not in _row_tiles:
        _row_tiles[key] = RowTiles(candidates)
    return _row_tiles[key]


def library_path() -> str:
    """The CPU and the library code paths its bits depend on, in one line: PyTorch's own vectorised
    kernels (norms, softmax, exp; their instruction set changes bits too), MKL's and oneDNN's."""
    onednn = cpu_isa.probe_onednn()
    return (f"{cpu_isa.cpu_vendor() or 'unknown vendor'} {cpu_isa.cpu_model() or 'unknown CPU'}; "
            f"PyTorch kernels {torch.backends.cpu.get_cpu_capability()}; "
            f"MKL {cpu_isa.mkl_path()}; oneDNN {onednn['isa'] or 'ISA not reported'}, fp32 matmuls "
            f"{onednn['fp32_matmul'] or 'not oneDNN'}, bf16 matmuls {onednn['bf16_matmul'] or 'not oneDNN'}")


def check_cpu_invariance(ops, dtype: torch.dtype) -> dict:
    """Run the self-test for `ops` (a batch-invariant CPU table) and `dtype` at the current thread
    count, once per process and key; CpuInvarianceError (one line) when a primitive's rows depend on
    the batch, unless waived. Returns the record manifests keep."""
    key = f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
    if key not in _results or _results[key]["ops"] != id(ops):
        failed = variant_primitives(ops, dtype)
        _results[key] = {"ops": id(ops), "passed": not failed, "variant": failed, "waived": waived(),
                         "path": library_path(), "row_tiles": list(ops.row_tiles.candidates.get(dtype, (ROW_TILE,))),
                         "_row_tiles": ops.row_tiles, "_dtype": dtype, "_threads": torch.get_num_threads()}
    record = _results[key]
    if record["variant"] and not record["waived"]:
        raise CpuInvarianceError(
            f"batch-invariant {record['variant'][0]} ({key}) gives rows that depend on the batch on this CPU "
            f"({record['path']}); set {WAIVER_VARIABLE}=1 to run anyway (recorded in manifests)")
    return _public(record)


def _public(record: dict) -> dict:
    """A self-test record as manifests keep it, with the tiles each weight shape proved so far."""
    public = {k: v for k, v in record.items() if k != "ops" and not k.startswith("_")}
    public["row_tiles_by_shape"] = {f"{n}x{k}": {"library": library, "tiles": list(tiles)}
                                    for (dtype, n, k, threads), (library, tiles)
                                    in sorted(record["_row_tiles"].by_shape.items(), key=lambda item: item[0][1:])
                                    if dtype == record["_dtype"] and threads == record["_threads"]}
    return public


def checked_cpu_ops(dtype: torch.dtype) -> kernels.Ops:
    """The batch-invariant CPU table an engine of `dtype` serves with on this machine: oneDNN's ISA
    checked for bf16 (`check_cpu_isa`), the row tiles proven for `dtype` and fp32 (hyper-connection
    weights stay fp32), and the table self-tested. CpuIsaError / CpuInvarianceError in one line."""
    if dtype != torch.float32:
        cpu_isa.check_cpu_isa()  # oneDNN's AMX kernels would make bf16 rows depend on the batch
    ops = kernels.bind("batch_invariant", "cpu", proven_row_tiles((torch.float32, dtype)))
    check_cpu_invariance(ops, dtype)
    return ops


def results() -> dict[str, dict]:
    """Every self-test this process ran, by "dtype, N threads" (what manifests record)."""
    return {key: _public(record) for key, record in _results.items()}
