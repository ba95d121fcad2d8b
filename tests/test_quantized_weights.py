"""Weights kept quantized (`kernels.quant.QuantizedWeight`): every numerics table takes them where
`linear`, `grouped_linear` and `moe_experts` take a weight, with the bits of the decoded weight.

The Triton kernels decode the B tiles themselves; they run under the Triton interpreter on CPU by
default (small shapes: it is slow), and compiled on the GPU with TRITON_INTERPRET=0 on a CUDA machine.
"""

from __future__ import annotations

import pytest
from triton_target import DEVICE, DTYPES, INTERPRETED  # first: it picks the interpreter or the GPU

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_triton_kernels import _interpreter_patches  # noqa: F401  (bf16 dot and casts, libdevice exp)

from deepinfer import kernels
from deepinfer.kernels import fast, triton_fused, triton_ops
from deepinfer.kernels.quant import QuantizedWeight

LAYOUTS = {"fp8 32x32": ("fp8", (32, 32)), "fp8 128x128": ("fp8", (128, 128)), "fp8 1x32": ("fp8", (1, 32)),
           "fp8 16x48": ("fp8", (16, 48)), "mxfp4": ("mxfp4", (1, 32))}  # 48: tiles that do not nest with K slices
E8M0 = torch.float8_e8m0fnu
LIMIT = 7.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, nan: torch.Tensor | None = None) -> None:
    """Bitwise equal, except that where `nan` is set both must be NaN (payloads are not specified)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.zeros(a.shape, dtype=torch.bool, device=a.device) if nan is None else nan
    assert torch.equal(_bits(a)[~nan], _bits(b)[~nan])
    assert bool(a[nan].isnan().all()) and bool(b[nan].isnan().all())


def _quantized(fmt: str, tile: tuple[int, int], shape: tuple[int, ...], dtype: torch.dtype, seed: int,
               nan: bool = False, extreme: bool = True) -> QuantizedWeight:
    """Random codes (every E4M3 byte but the NaNs unless `nan`: subnormals, signed zeros, 448; any E2M1
    pair) and E8M0 scales, mostly near 1; with `extreme`, 30% anywhere in 0..254 and the first and last
    tile at 2^-127 and 2^127."""
    gen = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    stored = (*lead, rows, cols // 2 if fmt == "mxfp4" else cols)
    data = torch.randint(0, 256, stored, generator=gen, dtype=torch.uint8)
    if fmt == "fp8":
        data = (data if nan else torch.where(data & 0x7F == 0x7F, data ^ 1, data)).view(torch.float8_e4m3fn)
    tiles = (*lead, -(-rows // tile[0]), -(-cols // tile[1]))
    scale = torch.randint(120, 135, tiles, generator=gen)
    if extreme:
        anywhere = torch.rand(tiles, generator=gen) < 0.3
        scale = torch.where(anywhere, torch.randint(0, 255, tiles, generator=gen), scale)
        scale.view(-1)[0], scale.view(-1)[-1] = 0, 254
    weight = QuantizedWeight(data, scale.to(torch.uint8).view(E8M0), fmt, tile, dtype)
    return weight.to(DEVICE)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# Triton linear --------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered in (matmul|multiply):RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_linear_decodes_as_the_host_does(layout: str, dtype: torch.dtype) -> None:
    """Ragged N and K (neither a multiple of 32 nor of the 64-wide column tiles), every code, scales from
    2^-127 to 2^127: the bits of `decode()`. Identity rows of x read single weights back, so values
    that vanish in a sum (subnormals) count too; large scales make inf, and NaN where inf meets inf or 0."""
    fmt, tile = LAYOUTS[layout]
    weight = _quantized(fmt, tile, (136, 150), dtype, seed=len(layout))
    x = torch.cat([_randn(5, 150, seed=1), torch.eye(150, device=DEVICE)])
    out, decoded = triton_ops.linear(x, weight), weight.decode()
    _assert_same_bits(out, triton_ops.linear(x, decoded))
    subnormal = (out != 0) & (out.abs() < torch.finfo(dtype).tiny)
    assert subnormal.any() and decoded.isinf().any() and out.isnan().any()  # the extremes were reached
    _assert_same_bits(triton_ops.linear(x[3:4], weight), out[3:4])


@pytest.mark.parametrize("layout", ["fp8 32x32", "mxfp4"])
def test_triton_linear_nan_codes_and_scales_make_their_columns_nan(layout: str) -> None:
    """E4M3 codes 0x7F/0xFF and E8M0 byte 255 are NaN: every output of a weight row holding one is NaN
    (the payload is not specified), even where the scale multiplies codes of one sign with positive
    inputs (an inf scale would give +inf); the other outputs keep the decoded weight's bits."""
    fmt, tile = LAYOUTS[layout]
    weight = _quantized(fmt, tile, (40, 70), torch.float32, seed=3, nan=fmt == "fp8", extreme=False)
    weight.scale.view(torch.uint8)[1, 1] = 255  # rows 32..39 (fp8) or row 1 (mxfp4), columns 32..63
    if fmt == "fp8":
        weight.data.view(torch.uint8)[32:, 32:64] = 0x38  # 1.0
    else:
        weight.data[1, 16:32] = 0x22  # 1.0, 1.0
    x = _randn(3, 70, seed=4).abs()
    nan_rows = weight.decode().isnan().any(dim=1)
    assert int(nan_rows.sum()) == 1 if fmt == "mxfp4" else nan_rows[32:].all() and not nan_rows.all()
    out = triton_ops.linear(x, weight)
    assert torch.equal(out.isnan(), nan_rows.expand_as(out))
    _assert_same_bits(out, triton_ops.linear(x, weight.decode()), nan=nan_rows.expand_as(out))


def test_triton_grouped_linear_takes_a_quantized_weight() -> None:
    weight = _quantized("fp8", (32, 32), (2 * 64, 40), torch.bfloat16, seed=5, extreme=False)
    x = _randn(3, 2, 40, seed=6)
    _assert_same_bits(triton_ops.grouped_linear(x, weight, 2), triton_ops.grouped_linear(x, weight.decode(), 2))


@pytest.mark.parametrize("layout", ["fp8 1x32", "fp8 128x128", "fp8 16x48", "mxfp4"])
def test_triton_split_linear_decodes_each_chunk_where_it_starts(layout: str) -> None:
    """A few columns over a long K run as K chunks (`triton_ops.k_splits`): each chunk reads its bytes,
    nibbles and scales from its own first column on, so the product keeps the decoded weight's bits."""
    fmt, tile = LAYOUTS[layout]
    depth = triton_ops.K_CHUNK * 4 + 64
    assert triton_ops.k_splits(24, depth) > 1
    weight = _quantized(fmt, tile, (24, depth), torch.float32, seed=12, extreme=False)
    x = _randn(3, depth, seed=13)
    _assert_same_bits(triton_ops.linear(x, weight), triton_ops.linear(x, weight.decode()))


# Triton experts -----------------------------------------------------------------------------------------

EXPERTS, TOP_K, HIDDEN, INTER = 4, 2, 64, 48


def _experts(dtype: torch.dtype, seed: int) -> tuple[QuantizedWeight, QuantizedWeight]:
    """MXFP4 w13 [E, 2I, H] (each expert's w1 and w3 concatenated) and w2 [E, H, I], scales near 1."""
    w13 = [QuantizedWeight.cat([_quantized("mxfp4", (1, 32), (INTER, HIDDEN), dtype, seed + 3 * e + part,
                                           extreme=False) for part in (0, 1)]) for e in range(EXPERTS)]
    w2 = [_quantized("mxfp4", (1, 32), (HIDDEN, INTER), dtype, seed + 3 * e + 2, extreme=False) for e in range(EXPERTS)]
    return QuantizedWeight.stack(w13), QuantizedWeight.stack(w2)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return indices.to(DEVICE), torch.rand(tokens, TOP_K, generator=gen).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_experts_take_quantized_stacks_and_rows_stay_invariant(dtype: torch.dtype) -> None:
    w13, w2 = _experts(dtype, seed=10)
    x = (_randn(5, HIDDEN, seed=11) * 4).to(dtype)
    indices, weights = _routing(5, seed=12)
    grouped = triton_ops.moe_experts(x, indices, weights, w13, w2, LIMIT)
    _assert_same_bits(grouped, triton_ops.moe_experts(x, indices, weights, w13.decode(), w2.decode(), LIMIT))
    loop = fast.routed_experts(x, indices, weights, w13, w2, LIMIT, matmul=triton_ops.linear,
                               swiglu=triton_fused.clamped_swiglu)
    _assert_same_bits(grouped, loop)
    _assert_same_bits(triton_ops.moe_experts(x[2:3], indices[2:3], weights[2:3], w13, w2, LIMIT), grouped[2:3])


@pytest.mark.skipif(INTERPRETED, reason="host synchronisations are a property of the compiled kernels")
def test_compiled_quantized_experts_do_not_sync_the_host() -> None:
    from cuda_syncs import synchronisations

    w13, w2 = _experts(torch.bfloat16, seed=20)
    x, (indices, weights) = _randn(70, HIDDEN, seed=21).bfloat16(), _routing(70, seed=22)
    assert synchronisations(lambda: triton_ops.moe_experts(x, indices, weights, w13, w2, LIMIT)) == []


# PyTorch tables ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", kernels.NUMERICS)
def test_pytorch_tables_give_the_decoded_weights_bits(numerics: str, dtype: torch.dtype) -> None:
    ops = kernels.bind(numerics, "cpu")
    weight = _quantized("fp8", (32, 32), (72, 600), dtype, seed=30).to("cpu")
    assert ops.matmul_layout(weight) is weight
    x = torch.randn(3, 600, generator=torch.Generator().manual_seed(31))
    _assert_same_bits(ops.linear(x, weight), ops.linear(x, ops.matmul_layout(weight.decode())))
    grouped = torch.randn(3, 2, 600, generator=torch.Generator().manual_seed(32))
    _assert_same_bits(ops.grouped_linear(grouped, weight, 2), ops.grouped_linear(grouped, weight.decode(), 2))
    w13, w2 = (w.to("cpu") for w in _experts(dtype, seed=33))
    x = (torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(34)) * 4).to(dtype)
    indices, weights = (t.cpu() for t in _routing(5, seed=35))
    _assert_same_bits(ops.moe_experts(x, indices, weights, w13, w2, LIMIT),
                      ops.moe_experts(x, indices, weights, w13.decode(), w2.decode(), LIMIT))


# QuantizedWeight --------------------------------------------------------------------------------------

def _fp8(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)


def _e8m0(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


def _packed(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows, cols // 2, dtype=torch.uint8)


def _fp8_weight(rows: int, cols: int = 64, tile: tuple[int, int] = (32, 32)) -> QuantizedWeight:
    return QuantizedWeight(_fp8(rows, cols), _e8m0(-(-rows // tile[0]), -(-cols // tile[1])), "fp8", tile,
                           torch.float32)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: QuantizedWeight(torch.zeros(64, 64), _e8m0(2, 2), "fp8", (32, 32), torch.float32),
         "QuantizedWeight: data dtype must be float8_e4m3fn, got float32"),
        (lambda: QuantizedWeight(_fp8(64, 64), torch.zeros(2, 2), "fp8", (32, 32), torch.float32),
         "QuantizedWeight: scale dtype must be float8_e8m0fnu or uint8, got float32"),
        (lambda: QuantizedWeight(_packed(64, 64).short(), _e8m0(64, 2), "mxfp4", (1, 32), torch.float32),
         "QuantizedWeight: data dtype must be int8 or uint8, got int16"),
        (lambda: QuantizedWeight(_fp8(64, 64), _e8m0(2, 2), "nvfp4", (32, 32), torch.float32),
         "QuantizedWeight: fmt must be fp8 or mxfp4, got 'nvfp4'"),
        (lambda: QuantizedWeight(_fp8(64, 64), _e8m0(2, 2), "fp8", (32, 32), torch.float16),
         "QuantizedWeight: dtype must be float32 or bfloat16, got float16"),
        (lambda: QuantizedWeight(_fp8(64, 64), _e8m0(2, 2), "fp8", [32, 32], torch.float32),
         "QuantizedWeight: tile must be a tuple of two positive ints, got [32, 32]"),
        (lambda: QuantizedWeight(_packed(64, 64), _e8m0(2, 2), "mxfp4", (32, 32), torch.float32),
         "QuantizedWeight: mxfp4 tile must be (1, 32), got (32, 32)"),
        (lambda: QuantizedWeight(_fp8(64, 70), _e8m0(2, 2), "fp8", (32, 32), torch.float32),
         "QuantizedWeight: scale shape [2, 2] does not match [2, 3] (weight [64, 70] in 32x32 tiles)"),
        (lambda: QuantizedWeight(_packed(4, 64), _e8m0(4, 1), "mxfp4", (1, 32), torch.float32),
         "QuantizedWeight: scale shape [4, 1] does not match [4, 2] (weight [4, 64] in 1x32 tiles)"),
        (lambda: QuantizedWeight(_fp8(1, 64)[0], _e8m0(2), "fp8", (32, 32), torch.float32),
         "QuantizedWeight: data must be [..., N, K], got shape [64]"),
        (lambda: _fp8_weight(64)[0],
         "QuantizedWeight: only a stack [E, N, K] can be indexed, got shape [64, 64]"),
        (lambda: QuantizedWeight.cat([_fp8_weight(40), _fp8_weight(64)]),
         "QuantizedWeight.cat: part 0 has 40 rows, not a multiple of 32"),
        (lambda: QuantizedWeight.cat([_fp8_weight(32), _fp8_weight(32, cols=96)]),
         "QuantizedWeight.cat: shapes differ beyond rows: [[32, 64], [32, 96]]"),
        (lambda: QuantizedWeight.stack([_fp8_weight(32), _fp8_weight(64)]),
         "QuantizedWeight.stack: shapes differ: [[32, 64], [64, 64]]"),
        (lambda: QuantizedWeight.stack([_fp8_weight(32), _fp8_weight(32, tile=(1, 32))]),
         "QuantizedWeight.stack: weights differ in format, tile, dtype or storage dtypes"),
        (lambda: QuantizedWeight.stack([]), "QuantizedWeight.stack: no weights"),
    ],
)
def test_bad_input_raises_a_one_line_value_error(call, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        call()
    assert str(caught.value) == message


layouts = st.sampled_from(list(LAYOUTS.values()))


@st.composite
def parts(draw, layout: tuple[str, tuple[int, int]]) -> list[tuple[int, int]]:
    """Row counts and seeds of 1 to 3 parts sharing K: whole tiles of rows but for the last part."""
    tile_rows = layout[1][0]
    count = draw(st.integers(1, 3))
    rows = [tile_rows * draw(st.integers(1, 2)) for _ in range(count - 1)] + [draw(st.integers(1, 40))]
    return [(n, draw(st.integers(0, 2**16))) for n in rows]


@settings(max_examples=25, deadline=None)
@given(layout=layouts, data=st.data(), cols=st.integers(1, 3).map(lambda n: 32 * n - 6), dtype=st.sampled_from(DTYPES))
def test_cat_and_stack_decode_as_their_parts(layout, data, cols: int, dtype: torch.dtype) -> None:
    """cat puts the parts' rows one after the other and stack their matrices, indexing takes one back:
    the decoded values, shapes and dtypes follow."""
    fmt, tile = layout
    pieces = [_quantized(fmt, tile, (rows, cols), dtype, seed).to("cpu") for rows, seed in data.draw(parts(layout))]
    joined = QuantizedWeight.cat(pieces)
    assert joined.shape == (sum(p.shape[0] for p in pieces), cols) and joined.dtype == dtype
    _assert_same_bits(joined.decode(), torch.cat([p.decode() for p in pieces]))
    stacked = QuantizedWeight.stack([joined, joined])
    assert stacked.shape == (2, *joined.shape)
    _assert_same_bits(stacked.decode(), torch.stack([joined.decode()] * 2))
    _assert_same_bits(stacked[1].decode(), joined.decode())
    _assert_same_bits(QuantizedWeight.stack([stacked, stacked]).decode()[1, 0], joined.decode())
