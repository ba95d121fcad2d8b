"""V4.1 number formats (kernels/quant.py) against the V4.1 oracle, NeMo AutoModel 0.7.0.

The cache quantize-dequantize functions must equal NeMo's `quantize_cache` bit for bit (signed
zeros and NaN payloads included); the weight decoders must equal NeMo's checkpoint decoders and
the MXFP4 encoder NeMo's MXFP4 writer. NeMo has no FP8 weight writer, so the FP8 encoder is
checked by its own properties. NeMo is part of the dev install: tests that need it fail without it.
"""

from __future__ import annotations

import os
import types
from functools import partial

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deepinfer.kernels.quant import (
    fp8_block_decode,
    fp8_block_encode,
    fp8_ue8m0_qdq,
    mxfp4_decode,
    mxfp4_encode,
    mxfp4_qdq,
    nvfp4_qdq,
)

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

NAN, INF = float("nan"), float("inf")
E8M0, E4M3 = torch.float8_e8m0fnu, torch.float8_e4m3fn
QDQ = {"fp8": fp8_ue8m0_qdq, "mxfp4": mxfp4_qdq, "nvfp4": nvfp4_qdq}
# Magnitudes on or next to the formats' grid points and rounding midpoints.
GRID = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 224.0, 232.0, 448.0, 460.0)


@pytest.fixture(scope="module")
def nemo() -> types.SimpleNamespace:
    """NeMo's reference functions (imports fail the test, never skip it)."""
    from nemo_automodel.components.models.deepseek_v3.state_dict_adapter import dequantize_from_fp8
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import (
        DeepseekV41StateDictAdapter,
        dequantize_checkpoint_weight,
    )
    from nemo_automodel.components.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    return types.SimpleNamespace(
        qdq=lambda x, fmt, group: quantize_cache(x, format=fmt, block_size=group),
        decode_v41=lambda w, s: dequantize_checkpoint_weight(w, s, dtype=torch.float32),
        decode_v3=lambda w, s, block: dequantize_from_fp8(w, s, dtype=torch.float32, BLOCK_SIZE=block),
        decode_mxfp4=lambda p, s: dequantize_mxfp4(p, s, torch.float32),
        encode_mxfp4=quantize_mxfp4,
        load_targets=DeepseekV41StateDictAdapter._quantized_load_targets,
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers, so -0.0 differs from 0.0 and NaN payloads count."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor, any_nan: torch.Tensor | None = None) -> None:
    """Bitwise equality, except that where `any_nan` is set both must be NaN, payload free.

    IEEE 754 leaves open which payload a product of two NaNs carries, and CPUs pick by operand
    order and vector lane, so where both factors are NaN only NaN-ness is a property.
    """
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if any_nan is None:
        any_nan = torch.zeros(ours.shape, dtype=torch.bool)
    assert torch.equal(bits(ours)[~any_nan], bits(theirs)[~any_nan])
    assert bool(ours[any_nan].isnan().all()) and bool(theirs[any_nan].isnan().all())


def sample(seed: int, shape: tuple[int, ...], center: int, spread: int, grid: bool, specials: float) -> torch.Tensor:
    """fp32 values around 2^center, spread over 2^+-spread per element.

    `grid` draws magnitudes from GRID times one power of two per row (exact ties and format
    maxima); `specials` is the share of zeros, -0.0, subnormals, +-inf and NaN mixed in.
    """
    g = torch.Generator().manual_seed(seed)
    if grid:
        picks = torch.tensor(GRID)[torch.randint(len(GRID), shape, generator=g)]
        signs = torch.randint(2, shape, generator=g) * 2 - 1
        row_exponent = torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=g) + center
        x = torch.ldexp(picks * signs, row_exponent.clamp(-140, 120))
    else:
        exponent = torch.randint(-spread, spread + 1, shape, generator=g) + center
        x = torch.ldexp(torch.randn(shape, generator=g), exponent.clamp(-150, 126))
    odd = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-140), INF, -INF, NAN, 3.0e38])
    chosen = odd[torch.randint(len(odd), shape, generator=g)]
    return torch.where(torch.rand(shape, generator=g) < specials, chosen, x)


def values(shapes: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[torch.Tensor]:
    return st.builds(
        sample,
        seed=st.integers(0, 2**31),
        shape=shapes,
        center=st.integers(-135, 120),
        spread=st.integers(0, 12),
        grid=st.booleans(),
        specials=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    )


inputs = values(st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 70)))


@pytest.mark.parametrize("fmt", QDQ)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=30, deadline=None)
@given(x=inputs, group=st.sampled_from([1, 3, 8, 16, 32, 64]))
def test_qdq_equals_nemo(nemo, fmt, dtype, x, group):
    x = x.to(dtype)
    assert_same_bits(QDQ[fmt](x, group), nemo.qdq(x, fmt, group))


def edge_rows() -> torch.Tensor:
    """One group of 16 per row: zeros, subnormals, the 1e-4 floor, format maxima, ties, specials."""
    rows = [
        [0.0] * 16,
        [-0.0, 0.0] * 8,
        [2.0**-149, -(2.0**-149), 2.0**-130, 0.0] * 4,
        [1e-4, -1e-5, 9.9e-5, 2.0**-24] * 4,
        [448.0, -448.0, 224.0, 0.5, 464.0, 1.0, -2.0**-9, 3.0] * 2,
        [448.0 * 2**100, -(2.0**-20), 1.0, 3.0e38, -3.0e38, 6.0, 2688.0, 2700.0] * 2,
        [6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -6.0, -5.0, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25],
        [6.0 * 2**-20, 2.0**-21, 3 * 2.0**-22, 0.25 * 2**-20] * 4,
        [1.0, -1.0, 0.0, -0.0, INF, 2.0, -0.5, 3.0] * 2,
        [1.0, -1.0, 0.0, -0.0, -INF, 2.0, -0.5, 3.0] * 2,
        [1.0, -1.0, 0.0, -0.0, NAN, 2.0, -0.5, 3.0] * 2,
        [INF, -INF, NAN, 1.0] * 4,
    ]
    return torch.tensor(rows)


@pytest.mark.parametrize("fmt", QDQ)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [16, 32, 5])
def test_qdq_edge_cases_equal_nemo(nemo, fmt, dtype, group):
    x = edge_rows().to(dtype)
    assert_same_bits(QDQ[fmt](x, group), nemo.qdq(x, fmt, group))


def test_qdq_known_values():
    """Values worked out by hand, independently of NeMo."""
    # amax 6 -> scale 1: midpoints go to the even code (1.25 -> 1, 1.75 -> 2, 0.25 -> 0, 5 -> 4).
    x = torch.tensor([6.0, 1.25, 1.75, 0.25, 5.0, -2.5, 0.7, -0.0])
    assert mxfp4_qdq(x, 8).tolist() == [6.0, 1.0, 2.0, 0.0, 4.0, -2.0, 0.5, -0.0]
    # amax 2688 -> E4M3 scale 448; 0.75 * 448 = 336 is a tie between 0.5 and 1 -> 1.
    assert nvfp4_qdq(torch.tensor([2688.0, 336.0, -100.0, 1e9]), 4).tolist() == [2688.0, 448.0, -0.0, 2688.0]
    # amax 96 -> scale 2^-2 (96 / 448 <= 0.25): 96 * 4 = 384 is E4M3, 3.3 * 4 = 13.2 -> 13, and
    # -2^-12 * 4 is half the smallest E4M3 number, a tie that goes to zero.
    assert fp8_ue8m0_qdq(torch.tensor([96.0, 3.3, -(2.0**-12), 0.0]), 4).tolist() == [96.0, 3.25, -0.0, 0.0]
    # Below the 1e-4 floor the scale stays at 2^-22: 2^-31 is the smallest nonzero result.
    assert fp8_ue8m0_qdq(torch.tensor([2.0**-31, 2.0**-33, 0.0, 0.0]), 4).tolist() == [2.0**-31, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("fmt", QDQ)
@settings(max_examples=30, deadline=None)
@given(x=inputs, group=st.sampled_from([1, 8, 16, 32]))
def test_qdq_rows_are_independent(fmt, x, group):
    batch = x.flatten(0, -2)
    together = QDQ[fmt](batch, group)
    for i in range(batch.shape[0]):
        assert_same_bits(together[i : i + 1], QDQ[fmt](batch[i : i + 1].clone(), group))


def random_fp8(g: torch.Generator, shape: tuple[int, ...], with_nan: bool = True) -> torch.Tensor:
    codes = torch.randint(256, shape, generator=g, dtype=torch.uint8)
    if not with_nan:
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    return codes.view(torch.float8_e4m3fn)


def random_e8m0(g: torch.Generator, shape: tuple[int, ...], low: int = 0, high: int = 255) -> torch.Tensor:
    return torch.randint(low, high + 1, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 100), cols=st.integers(1, 100))
@example(seed=196, rows=32, cols=71)  # a NaN weight in a NaN-scaled tile
def test_fp8_block_decode_equals_nemo(nemo, seed, rows, cols):
    g = torch.Generator().manual_seed(seed)
    weight = random_fp8(g, (rows, cols))
    scale = random_e8m0(g, (-(-rows // 32), -(-cols // 32)))
    ours = fp8_block_decode(weight, scale, 32)
    tile_nan = scale.float().isnan().repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
    nan_times_nan = weight.float().isnan() & tile_nan
    assert_same_bits(ours, nemo.decode_v41(weight, scale), nan_times_nan)
    assert_same_bits(fp8_block_decode(weight, scale.view(torch.uint8), 32), ours)


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
def test_fp8_block_decode_v4_tiles_equal_nemo(nemo, scale_dtype):
    """V4's 128x128 tiles, with E8M0 scales (Flash) or float32 ones (FP8-expert checkpoints)."""
    g = torch.Generator().manual_seed(1)
    weight = random_fp8(g, (300, 200))
    scale = random_e8m0(g, (3, 2), 60, 190)
    if scale_dtype == torch.float32:
        scale = scale.float() * torch.rand(3, 2, generator=g)
    assert_same_bits(fp8_block_decode(weight, scale, 128), nemo.decode_v3(weight, scale, 128))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 40), groups=st.integers(1, 4))
def test_mxfp4_decode_equals_nemo(nemo, seed, rows, groups):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 128, (rows, 16 * groups), generator=g, dtype=torch.int8)
    scale = random_e8m0(g, (rows, groups))
    ours = mxfp4_decode(packed, scale)
    assert_same_bits(ours, nemo.decode_v41(packed, scale))
    assert_same_bits(mxfp4_decode(packed.view(torch.uint8), scale.view(torch.uint8)), ours)
    experts = torch.randint(-128, 128, (3, rows, 16 * groups), generator=g, dtype=torch.int8)
    expert_scales = random_e8m0(g, (3, rows, groups))
    assert_same_bits(mxfp4_decode(experts, expert_scales), nemo.decode_mxfp4(experts, expert_scales))


def test_mxfp4_nibble_order():
    """The even column sits in the low nibble; code 8 is +0.0; the scale multiplies."""
    packed = torch.tensor([[0x21, 0xF8, 0x7A] + [0] * 13], dtype=torch.uint8)
    one = torch.tensor([[127]], dtype=torch.uint8)
    want = torch.tensor([0.5, 1.0, 0.0, -6.0, -1.0, 6.0])
    assert_same_bits(mxfp4_decode(packed, one)[0, :6], want)
    assert mxfp4_decode(packed, one + 3)[0, :6].tolist() == [4.0, 8.0, 0.0, -48.0, -8.0, 48.0]


@settings(max_examples=40, deadline=None)
@given(weight=values(st.tuples(st.integers(1, 3), st.integers(1, 5), st.sampled_from([32, 64, 96]))))
def test_mxfp4_encode_equals_nemo(nemo, weight):
    packed, scale = mxfp4_encode(weight)
    want_packed, want_scale = nemo.encode_mxfp4(weight)
    assert_same_bits(packed, want_packed)
    assert_same_bits(scale, want_scale)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 20), groups=st.integers(1, 3))
def test_mxfp4_round_trip(seed, rows, groups):
    """Decoded weights (finite scales) encode back to the same values."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 128, (rows, 16 * groups), generator=g, dtype=torch.int8)
    decoded = mxfp4_decode(packed, random_e8m0(g, (rows, groups), 1, 252))
    assert_same_bits(mxfp4_decode(*mxfp4_encode(decoded)), decoded)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 70), cols=st.integers(1, 70), block=st.sampled_from([8, 32]))
def test_fp8_block_round_trip(seed, rows, cols, block):
    """Decoded weights with any scale byte whose values stay finite encode back to the same values."""
    g = torch.Generator().manual_seed(seed)
    weight = random_fp8(g, (rows, cols), with_nan=False)
    decoded = fp8_block_decode(weight, random_e8m0(g, (-(-rows // block), -(-cols // block)), 0, 246), block)
    assert_same_bits(fp8_block_decode(*fp8_block_encode(decoded, block), block), decoded)


@settings(max_examples=30, deadline=None)
@given(x=inputs)
def test_fp8_block_encode_scale_is_the_smallest_that_fits(nemo, x):
    weight = x.flatten(0, -2)
    values, scale = fp8_block_encode(weight, 32)
    padded = torch.nn.functional.pad(weight.double(), (0, -weight.shape[1] % 32, 0, -weight.shape[0] % 32))
    amax = padded.unflatten(1, (-1, 32)).unflatten(0, (-1, 32)).abs().amax(dim=(1, 3))
    fits = amax / scale.double() <= 448
    tighter = (amax / (scale.double() / 2) > 448) | (scale.view(torch.uint8) == 0)
    judged = torch.isfinite(amax) & (amax > 0)
    assert bool((fits & tighter)[judged].all())
    assert bool((scale.view(torch.uint8)[~judged] == 118).all())
    # The bytes decode the same way under NeMo's V4.1 loader.
    assert_same_bits(nemo.decode_v41(values, scale), fp8_block_decode(values, scale, 32))


def test_encoders_write_nemos_checkpoint_layout(nemo):
    """Shapes and dtypes of NeMo's quantized load targets for a dense FP8 and an expert matrix."""
    dense, expert = torch.randn(70, 100), torch.randn(48, 64)
    want_fp8 = nemo.load_targets("layers.0.attn.wq_a.weight", dense)
    want_fp4 = nemo.load_targets("layers.0.ffn.experts.3.w1.weight", expert)
    for ours, (_, want) in zip((*fp8_block_encode(dense), *mxfp4_encode(expert)), want_fp8 + want_fp4):
        assert (ours.dtype, ours.shape) == (want.dtype, want.shape)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fp8_block_decode(torch.zeros(64, 40, dtype=E4M3), torch.zeros(2, 1, dtype=E8M0)),
         "fp8_block_decode: scale shape [2, 1] does not match [2, 2] (weight [64, 40] in 32x32 tiles)"),
        (lambda: fp8_block_decode(torch.zeros(64, 40, dtype=E4M3), torch.zeros(2, 2, dtype=torch.float16)),
         "fp8_block_decode: scale dtype must be float8_e8m0fnu, uint8 or float32, got float16"),
        (lambda: fp8_block_decode(torch.zeros(64, 40), torch.zeros(2, 2, dtype=E8M0)),
         "fp8_block_decode: weight dtype must be float8_e4m3fn, got float32"),
        (lambda: fp8_block_decode(torch.zeros(2, 64, 40, dtype=E4M3), torch.zeros(2, 2, dtype=E8M0)),
         "fp8_block_decode: weight must be 2-D, got shape [2, 64, 40]"),
        (lambda: fp8_block_decode(torch.zeros(64, 40, dtype=E4M3), torch.zeros(2, 2, dtype=E8M0), 0),
         "fp8_block_decode: block must be positive, got 0"),
        (lambda: mxfp4_decode(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 1, dtype=E8M0)),
         "mxfp4_decode: scale shape [4, 1] does not match [4, 2] (one per 32 columns of packed [4, 32])"),
        (lambda: mxfp4_decode(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 2)),
         "mxfp4_decode: scale dtype must be float8_e8m0fnu or uint8, got float32"),
        (lambda: mxfp4_decode(torch.zeros(4, 32, dtype=torch.int16), torch.zeros(4, 2, dtype=E8M0)),
         "mxfp4_decode: packed dtype must be int8 or uint8, got int16"),
        (lambda: mxfp4_encode(torch.zeros(4, 48)),
         "mxfp4_encode: last dimension must be a multiple of 32, got shape [4, 48]"),
        (lambda: mxfp4_encode(torch.zeros(4, 32, dtype=torch.int32)),
         "mxfp4_encode: weight must be floating point, got int32"),
        (lambda: fp8_block_encode(torch.zeros(64)),
         "fp8_block_encode: weight must be 2-D, got shape [64]"),
        (lambda: nvfp4_qdq(torch.zeros(4, 16), 0),
         "nvfp4_qdq: group_size must be positive, got 0"),
    ],
)
def test_bad_input_raises_a_one_line_value_error(call, message):
    with pytest.raises(ValueError) as caught:
        call()
    assert str(caught.value) == message


def test_torch_e4m3_cast_saturates():
    """NeMo's NVFP4 scale is a plain E4M3 cast of amax / 6, which saturates at 448 from PyTorch
    2.13 (2.11 gives NaN). nvfp4_qdq always saturates, so it equals NeMo only where the cast does."""
    assert torch.tensor([1e3, INF]).to(E4M3).float().tolist() == [448.0, 448.0]


def results(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu_without_host_syncs():
    """Finite inputs: the same bits on CUDA as on CPU (checked against NeMo above), no host syncs."""
    from cuda_syncs import synchronisations

    x = sample(7, (64, 512), 0, 20, grid=False, specials=0.0)
    x[::7] = sample(8, (10, 512), -3, 4, grid=True, specials=0.0)
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(-128, 128, (8, 64), generator=g, dtype=torch.int8)
    dtypes = (torch.float32, torch.bfloat16)
    cases = [(partial(qdq, group_size=32), (x.to(dtype),)) for qdq in QDQ.values() for dtype in dtypes]
    cases += [
        (fp8_block_decode, (random_fp8(g, (100, 70), with_nan=False), random_e8m0(g, (4, 3), 0, 254))),
        (mxfp4_decode, (packed, random_e8m0(g, (8, 4), 0, 254))),
        (fp8_block_encode, (x,)),
        (mxfp4_encode, (x,)),
    ]
    for fn, args in cases:
        on_cuda = [a.cuda() for a in args]
        for got, want in zip(results(fn(*on_cuda)), results(fn(*args)), strict=True):
            assert_same_bits(got.cpu(), want)
        assert synchronisations(lambda: fn(*on_cuda)) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_edge_cases_equal_nemo_on_cuda(nemo):
    """inf and NaN give device-dependent bits; on CUDA they must still be NeMo's."""
    x = edge_rows().cuda()
    for fmt, qdq in QDQ.items():
        assert_same_bits(qdq(x, 16), nemo.qdq(x, fmt, 16))
