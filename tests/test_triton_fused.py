"""The fused small ops of `kernels.triton_fused`: the bits of the op chains they replace, and rows that
do not depend on the batch.

Under the Triton interpreter (CPU, the default) every comparison is bitwise except where a result
goes through exp (sigmoid, SiLU): the interpreter's exp is NumPy's, not CUDA's, so those are compared
within a few ulps there. The sampler's Gumbel draw, which goes through log, is compared with its chain
run on NumPy's log there (on torch's on the GPU), so its draws are compared exactly either way. Compiled on the GPU (TRITON_INTERPRET=0) everything is compared bit for bit,
against torch's own CUDA ops.
"""

from __future__ import annotations

import pytest
from triton_target import DEVICE, DTYPES, INTERPRETED  # first: it picks the interpreter or the GPU

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_triton_kernels import _assert_same_bits, _interpreter_patches, _randn  # noqa: F401  (fixture)

from deepinfer.kernels import composite, fast, invariant, paging, quant, sampling, triton_fused

FEW = settings(max_examples=8, deadline=None)
N = 4  # hc_mult of every V4 and V4.1 configuration
SPECIALS = st.sampled_from([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, 2688.0, 1e-40, 3e38])


def _assert_transcendental(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise when compiled; within a few ulps under the interpreter (its exp is NumPy's)."""
    if not INTERPRETED:
        _assert_same_bits(out, ref)
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-2 if out.dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, equal_nan=True)


def _assert_bits_nan_aside(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise, except that a NaN's sign and payload are the device's (quant's docstring)."""
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    _assert_same_bits(torch.where(nan, 0.0, out.float()).to(out.dtype), torch.where(nan, 0.0, ref.float()).to(ref.dtype))


def _rope(tokens: int, half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = _randn(tokens, half, seed=seed) * 3
    return angles.cos() * 1.25, angles.sin() * 1.25


# rotary -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3, 40), (7, 16), (2, 2, 12), (33, 4, 64)])
def test_rotary_is_the_op_chain_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    half = 4 if shape[-1] != 12 else 6  # (2, 2, 12): every channel rotated, none copied
    x = _randn(*shape, seed=1, dtype=dtype)
    cos, sin = _rope(shape[0], half, seed=2)
    _assert_same_bits(triton_fused.rotary(x, cos, sin), fast.rotary(x, cos, sin))
    _assert_same_bits(triton_fused.rotary(x, cos, -sin), fast.rotary(x, cos, -sin))
    # the inverse rotation negates sin inside the op: the bits of passing -sin, in both tables
    _assert_same_bits(triton_fused.rotary(x, cos, sin, inverse=True), fast.rotary(x, cos, -sin))
    _assert_same_bits(fast.rotary(x, cos, sin, inverse=True), fast.rotary(x, cos, -sin))
    assert not torch.equal(fast.rotary(x, cos, sin, inverse=True), fast.rotary(x, cos, sin))


def test_rotary_takes_strided_inputs() -> None:
    x = _randn(2, 6, 40, seed=3).transpose(0, 1)[0]  # [2, 40] rows, stride 240
    cos, sin = _rope(8, 4, seed=4)
    expected = fast.rotary(x, cos[::4].contiguous(), sin[::4].contiguous())
    _assert_same_bits(triton_fused.rotary(x, cos[::4], sin[::4]), expected)


def test_rotary_table_is_the_op_chain() -> None:
    positions = torch.tensor([0, 1, 7, 4095, 65537, 300_000, 12], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=DEVICE) / 64))
    for scale in (1.0, 1.2079):
        fused = triton_fused.rotary_table(positions, inv_freq, scale)
        reference = composite.rotary_table(positions, inv_freq, scale, cos_sin=lambda a: (a.cos(), a.sin()))
        for out, ref in zip(fused, reference):
            _assert_transcendental(out, ref)
    assert [t.shape for t in triton_fused.rotary_table(positions[:0], inv_freq, 1.0)] == [(0, 32), (0, 32)]


# sums over one dimension ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 64, 300])
def test_ordered_sum_is_the_tree_of_adds_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    """Every dimension of a 3-d tensor (rows of n terms, and n terms strided by the columns after
    them), magnitudes from 1e-4 to 1e4 so that the order of the adds shows in the bits."""
    x = _randn(3, n, 5, seed=n, dtype=dtype) * torch.exp(_randn(3, n, 5, seed=n + 1) * 4).to(dtype)
    for dim in (0, 1, 2, -1):
        _assert_same_bits(triton_fused.ordered_sum(x, dim), invariant.ordered_sum(x, dim))


def test_ordered_sum_over_a_flash_width_row() -> None:
    """V4.1-Flash's hidden size, 5120 = 5 * 2^10: a tree of 8192 leaves with odd carries near the top."""
    x = _randn(2, 5120, seed=21) * torch.exp(_randn(2, 5120, seed=22) * 4)
    _assert_same_bits(triton_fused.ordered_sum(x, -1), invariant.ordered_sum(x, -1))
    _assert_same_bits(triton_fused.ordered_sum(x[:, :4099], -1), invariant.ordered_sum(x[:, :4099], -1))


@FEW
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), n=st.integers(2, 70), at=st.integers(0, 3),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), specials=st.lists(SPECIALS, max_size=6))
def test_ordered_sum_follows_the_tree_on_any_values(shape: list[int], n: int, at: int, dtype: torch.dtype,
                                                    seed: int, specials: list[float]) -> None:
    """Any shape and summed dimension, with infinities, NaNs, signed zeros and subnormals among the
    terms: the tree's bits (a NaN's sign and payload aside)."""
    dim = at % (len(shape) + 1)
    shape.insert(dim, n)
    x = _randn(*shape, seed=seed).flatten()
    picks = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))[:len(specials)]
    x[picks.to(x.device)] = torch.tensor(specials, device=x.device)[:picks.numel()]
    x = x.view(shape).to(dtype)
    _assert_bits_nan_aside(triton_fused.ordered_sum(x, dim), invariant.ordered_sum(x, dim))


def test_ordered_sum_of_one_term_or_of_no_rows() -> None:
    x = _randn(4, 1, 3, seed=23)
    _assert_same_bits(triton_fused.ordered_sum(x, 1), invariant.ordered_sum(x, 1))
    assert triton_fused.ordered_sum(_randn(0, 7, seed=0), -1).shape == (0,)


# the MoE router ----------------------------------------------------------------------------------------

def _gate_reference(logits, bias, chosen, top_k, scale=1.5):
    return composite.moe_gate(logits, "sqrtsoftplus", bias, chosen, top_k, scale, softplus=invariant.softplus,
                              softmax=invariant.softmax, sigmoid=invariant.sigmoid,
                              topk_indices=invariant.topk_indices, ordered_sum=invariant.ordered_sum)


def _fused_gate(logits, bias, chosen, top_k, scale=1.5, score_func="sqrtsoftplus"):
    def composed(*args):
        raise AssertionError("the fused router fell back to the op chain")
    return triton_fused.moe_gate(logits, score_func, bias, chosen, top_k, scale, composed=composed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, top_k", [(384, 6), (16, 2), (32, 4), (7, 3), (5, 1)])
def test_moe_gate_is_the_op_chain_bit_for_bit(dtype: torch.dtype, experts: int, top_k: int) -> None:
    """Logits above softplus' threshold (softplus(x) = x: no exp or log1p, so the interpreter's bits are
    the GPU's too) with repeated values (ties go to the lowest expert), a NaN row and a hash layer's
    chosen experts: the chain's experts and weights bit for bit."""
    generator = torch.Generator().manual_seed(experts)
    logits = (20.5 + torch.randint(0, 40, (9, experts), generator=generator) * 0.25).to(dtype).to(DEVICE)
    logits[3, experts // 2] = float("nan")
    bias = (torch.randint(-4, 4, (experts,), generator=generator) * 0.125).to(DEVICE)
    for got, want in zip(_fused_gate(logits, bias, None, top_k), _gate_reference(logits, bias, None, top_k)):
        assert got.dtype == want.dtype
        _assert_bits_nan_aside(got, want) if got.is_floating_point() else torch.testing.assert_close(got, want)
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(9)]).to(DEVICE)
    for got, want in zip(_fused_gate(logits, None, chosen, top_k), _gate_reference(logits, None, chosen, top_k)):
        _assert_bits_nan_aside(got, want) if got.is_floating_point() else torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_gate_over_any_logits_is_the_op_chain(dtype: torch.dtype) -> None:
    """Logits through softplus' exp and log1p (the interpreter's are NumPy's: weights within a few ulps
    there, bitwise compiled), spread so that the picks do not hang on a last bit."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.stack([torch.randperm(384, generator=generator) * 0.05 - 10 for _ in range(6)]).to(dtype).to(DEVICE)
    bias = (torch.randn(384, generator=generator) * 1e-3).to(DEVICE)
    indices, weights = _fused_gate(logits, bias, None, 6)
    want_indices, want_weights = _gate_reference(logits, bias, None, 6)
    torch.testing.assert_close(indices, want_indices)
    _assert_transcendental(weights, want_weights)


def test_moe_gate_hands_other_routers_to_the_op_chain() -> None:
    logits = _randn(3, 8, seed=24)
    calls = []
    triton_fused.moe_gate(logits, "sigmoid", None, None, 2, 1.0, composed=lambda *args: calls.append(args))
    triton_fused.moe_gate(logits.double(), "sqrtsoftplus", None, None, 2, 1.0, composed=lambda *args: calls.append(args))
    assert [args[1] for args in calls] == ["sigmoid", "sqrtsoftplus"]
    indices, weights = _fused_gate(logits[:0], torch.zeros(8, device=DEVICE), None, 2)
    assert indices.shape == weights.shape == (0, 2)


# V4.1's Engram gating ------------------------------------------------------------------------------

def _engram_inputs(tokens: int, width: int, seed: int, dtype: torch.dtype):
    streams = _randn(tokens, N, width, seed=seed, dtype=dtype)
    kv = _randn(tokens, (N + 1) * width, seed=seed + 1, dtype=dtype)
    return streams, kv, _randn(N, width, seed=seed + 2), _randn(N, width, seed=seed + 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 64, 300, 5120])
def test_engram_mix_is_the_op_chain(dtype: torch.dtype, width: int) -> None:
    """Every stream's gate and sum, including a dot product below the clamp's floor and a NaN stream, at
    widths up to V4.1-Flash's: bitwise compiled; under the interpreter within a few ulps (its rsqrt and
    exp are NumPy's, and the host's division by H is exact where CUDA multiplies by 1/H). A token's rows
    are the same alone as in the batch."""
    streams, kv, q_weight, k_weight = _engram_inputs(3, width, seed=width, dtype=dtype)
    q_weight[1] = 0.0  # stream 1's dot product is 0: the gate is sigmoid(sqrt(floor))
    streams[2, 3, width // 2] = float("nan")
    fused = triton_fused.engram_mix(streams, kv, q_weight, k_weight, 1e-6, 1e-6)
    chain = composite.engram_mix(streams, kv, q_weight, k_weight, 1e-6, 1e-6, ordered_sum=invariant.ordered_sum,
                                 sigmoid=torch.sigmoid)
    _assert_transcendental(fused, chain)
    assert fused[2, 3].isnan().all() and not fused[2, :3].isnan().any()
    _assert_same_bits(fused[1:2], triton_fused.engram_mix(streams[1:2], kv[1:2], q_weight, k_weight, 1e-6, 1e-6))


# hyper-connections -----------------------------------------------------------------------------------

def _site(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mixes = _randn(tokens, (2 + N) * N, seed=seed) * 3
    return mixes, _randn((2 + N) * N, seed=seed + 1), _randn(3, seed=seed + 2).abs() + 0.5


def _composite_coefficients(mixes, base, scale):
    return composite.hyper_coefficients(mixes, base, scale, N, 20, 1e-6, sigmoid=torch.sigmoid,
                                    sinkhorn=triton_fused.sinkhorn)


@pytest.mark.parametrize("tokens", [1, 6])
def test_hyper_coefficients_are_the_op_chain(tokens: int) -> None:
    mixes, base, scale = _site(tokens, seed=5)
    fused = triton_fused.hyper_coefficients(mixes, base, scale, N, 20, 1e-6)
    for out, ref in zip(fused, _composite_coefficients(mixes, base, scale)):
        _assert_transcendental(out, ref)
    _assert_same_bits(fused[2], _composite_coefficients(mixes, base, scale)[2])  # Sinkhorn: the same tile code


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [4, 3])  # 3: not a power of two, so the op chain runs
def test_hyper_collapse_is_the_ordered_sum_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    streams = _randn(5, n, 300, seed=6, dtype=dtype)
    pre = _randn(5, n, seed=7).sigmoid()
    _assert_same_bits(triton_fused.hyper_collapse(pre, streams),
                      composite.hyper_collapse(pre, streams, ordered_sum=invariant.ordered_sum))


def _mixed_by_hand(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """mix_streams as its docstring defines it: comb rounded to the streams' dtype, products summed
    over source streams in order in fp32, rounded once."""
    weights = comb.to(streams.dtype).float()
    rows = streams.float()
    out = []
    for target in range(comb.shape[-1]):
        acc = weights[:, 0, target, None] * rows[:, 0]
        for source in range(1, comb.shape[1]):
            acc = acc + weights[:, source, target, None] * rows[:, source]
        out.append(acc)
    return torch.stack(out, dim=1).to(streams.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mix_streams_sums_the_source_streams_in_order(dtype: torch.dtype) -> None:
    streams, comb = _randn(4, N, 300, seed=8, dtype=dtype), _randn(4, N, N, seed=9).softmax(-1)
    mixed = triton_fused.mix_streams(comb, streams)
    _assert_same_bits(mixed, _mixed_by_hand(comb, streams))
    torch.testing.assert_close(mixed.float(), invariant.mix_streams(comb, streams).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hyper_expand_is_the_op_chain_bit_for_bit(dtype: torch.dtype) -> None:
    streams, block_out = _randn(5, N, 300, seed=10, dtype=dtype), _randn(5, 300, seed=11, dtype=dtype)
    post, comb = _randn(5, N, seed=12).sigmoid() * 2, _randn(5, N, N, seed=13).softmax(-1)
    reference = composite.hyper_expand(post, comb, block_out, streams, mix_streams=triton_fused.mix_streams)
    _assert_same_bits(triton_fused.hyper_expand(post, comb, block_out, streams), reference)


def test_hyper_expand_with_a_block_output_of_another_dtype_runs_the_op_chain() -> None:
    streams, block_out = _randn(3, N, 64, seed=14), _randn(3, 64, seed=15, dtype=torch.bfloat16)
    post, comb = _randn(3, N, seed=16), _randn(3, N, N, seed=17)
    _assert_same_bits(triton_fused.hyper_expand(post, comb, block_out, streams),
                      composite.hyper_expand(post, comb, block_out, streams, mix_streams=triton_fused.mix_streams))


# SwiGLU and the MoE combine ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu_is_the_op_chain(dtype: torch.dtype) -> None:
    hidden = _randn(7, 2 * 300, seed=18, dtype=dtype) * 6
    hidden[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0])
    hidden[1, 300:304] = torch.tensor([float("nan"), float("inf"), -float("inf"), -7.5])
    gate, up = hidden.chunk(2, dim=-1)  # strided halves, as the experts hand them over
    _assert_transcendental(triton_fused.clamped_swiglu(gate, up, 7.0), invariant.clamped_swiglu(gate, up, 7.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_combine_is_the_rank_ordered_sum_bit_for_bit(dtype: torch.dtype) -> None:
    slots, weights = _randn(6, 5, 300, seed=19, dtype=dtype), _randn(6, 5, seed=20).abs()
    reference = fast.combine_ranks(slots * weights.unsqueeze(-1).to(dtype))
    _assert_same_bits(triton_fused.weighted_combine(slots, weights), reference)
    shared = _randn(6, 300, seed=21, dtype=dtype)
    _assert_same_bits(triton_fused.weighted_combine(slots, weights, shared), reference + shared)
    other = shared.to(torch.bfloat16 if dtype == torch.float32 else torch.float32)  # added after, by the op chain
    _assert_same_bits(triton_fused.weighted_combine(slots, weights, other), reference + other)


# row invariance ----------------------------------------------------------------------------------------

batch_rows = st.integers(2, 24).flatmap(lambda m: st.tuples(st.just(m), st.integers(0, m - 1)))


@FEW
@given(batch=batch_rows, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_fused_rows_do_not_depend_on_the_batch(batch: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    rows, at = batch
    one = slice(at, at + 1)
    x, (cos, sin) = _randn(rows, 3, 24, seed=seed, dtype=dtype), _rope(rows, 4, seed=seed + 1)
    _assert_same_bits(triton_fused.rotary(x, cos, sin)[one], triton_fused.rotary(x[one], cos[one], sin[one]))
    positions, inv_freq = torch.arange(rows, device=DEVICE) * 37 + seed % 1000, _randn(5, seed=seed).abs()
    for table, alone in zip(triton_fused.rotary_table(positions, inv_freq, 1.5),
                            triton_fused.rotary_table(positions[one], inv_freq, 1.5)):
        _assert_same_bits(table[one], alone)
    mixes, base, scale = _site(rows, seed=seed + 2)
    whole, alone = (triton_fused.hyper_coefficients(m, base, scale, N, 7, 1e-6) for m in (mixes, mixes[one]))
    for row, single in zip(whole, alone):
        _assert_same_bits(row[one], single)
    streams, block_out = _randn(rows, N, 40, seed=seed + 3, dtype=dtype), _randn(rows, 40, seed=seed + 4, dtype=dtype)
    pre, post, comb = whole
    _assert_same_bits(triton_fused.hyper_collapse(pre, streams)[one], triton_fused.hyper_collapse(pre[one], streams[one]))
    _assert_same_bits(triton_fused.ordered_sum(streams, 1)[one], triton_fused.ordered_sum(streams[one], 1))
    _assert_same_bits(triton_fused.ordered_sum(streams, -1)[one], triton_fused.ordered_sum(streams[one], -1))
    logits, bias = _randn(rows, 24, seed=seed + 8, dtype=dtype) * 4, _randn(24, seed=seed + 9)
    for whole, alone in zip(_fused_gate(logits, bias, None, 4), _fused_gate(logits[one], bias, None, 4)):
        assert torch.equal(whole[one], alone)
    _assert_same_bits(triton_fused.hyper_expand(post, comb, block_out, streams)[one],
                      triton_fused.hyper_expand(post[one], comb[one], block_out[one], streams[one]))
    gate, up = _randn(rows, 2, 40, seed=seed + 5, dtype=dtype).unbind(1)
    _assert_same_bits(triton_fused.clamped_swiglu(gate, up, 3.0)[one], triton_fused.clamped_swiglu(gate[one], up[one], 3.0))
    slots, weights = _randn(rows, 3, 40, seed=seed + 6, dtype=dtype), _randn(rows, 3, seed=seed + 7)
    _assert_same_bits(triton_fused.weighted_combine(slots, weights)[one],
                      triton_fused.weighted_combine(slots[one], weights[one]))


def test_empty_inputs_launch_nothing() -> None:
    empty = _randn(0, N, 16, seed=0)
    assert triton_fused.hyper_collapse(_randn(0, N, seed=0), empty).shape == (0, 16)
    assert triton_fused.rotary(_randn(0, 8, seed=0), _randn(0, 2, seed=0), _randn(0, 2, seed=0)).shape == (0, 8)
    assert [t.shape for t in triton_fused.hyper_coefficients(_randn(0, 24, seed=0), *_site(1, 0)[1:], N, 3, 1e-6)] == [
        (0, N), (0, N), (0, N, N)]
    combined = triton_fused.weighted_combine(_randn(0, 2, 8, seed=0, dtype=torch.bfloat16), _randn(0, 2, seed=0))
    assert combined.shape == (0, 8) and combined.dtype == torch.bfloat16


# cache quantize-dequantize --------------------------------------------------------------------------

def _cache_values(rows: int, width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Activations spanning the formats' cases: magnitudes from 1e-9 to 1e4 (group scales at the
    floors and far above them), exact zeros of both signs, and values on the E2M1 midpoints and
    halfway between E4M3 numbers of their group's scale (ties)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * 10.0 ** torch.randint(-9, 5, (rows, 1), generator=generator)
    pick = torch.rand(rows, width, generator=generator)
    x = torch.where(pick < 0.05, torch.zeros(()), x)
    x = torch.where((pick >= 0.05) & (pick < 0.08), -torch.zeros(()), x)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0625, 0.1171875, 17.0, 0.013671875 / 2])
    spots = torch.randint(0, len(ties), (rows, width), generator=generator)
    x = torch.where((pick >= 0.08) & (pick < 0.3), ties[spots] * torch.sign(torch.randn(rows, width, generator=generator)),
                    x)
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [16, 40, 128, 300])
def test_cache_qdq_is_the_reference_bit_for_bit(fmt: str, dtype: torch.dtype, width: int) -> None:
    """Whole groups and a short last one (zero-padded by the reference), several channel blocks."""
    x = _cache_values(6, width, seed=width, dtype=dtype)
    reference = getattr(quant, f"{fmt}_qdq")
    _assert_same_bits(getattr(triton_fused, f"{fmt}_qdq")(x), reference(x))
    strided = _cache_values(3, 2 * width, seed=width + 1, dtype=dtype)[:, ::2]
    _assert_same_bits(getattr(triton_fused, f"{fmt}_qdq")(strided), reference(strided))


@FEW
@given(fmt=st.sampled_from(["fp8_ue8m0", "mxfp4", "nvfp4"]),
       values=st.lists(st.one_of(st.floats(-1e5, 1e5, width=32), SPECIALS), min_size=1, max_size=70))
def test_cache_qdq_follows_the_reference_on_any_values(fmt: str, values: list[float]) -> None:
    """Infinities, NaNs, fp32 subnormals and values past every saturation: the reference's bits (a
    NaN's sign and payload aside)."""
    x = torch.tensor([values], dtype=torch.float32).to(DEVICE)
    _assert_bits_nan_aside(getattr(triton_fused, f"{fmt}_qdq")(x), getattr(quant, f"{fmt}_qdq")(x))


def test_cache_qdq_refuses_another_group_size() -> None:
    with pytest.raises(ValueError, match="mxfp4_qdq: the fused kernel groups 32 channels, got 16"):
        triton_fused.mxfp4_qdq(_randn(2, 64, seed=0), 16)


# the sampler's argmax and Gumbel draw ------------------------------------------------------------------

def _device_log(x: torch.Tensor) -> torch.Tensor:
    """The log the kernel's libdevice call is: torch's on the GPU, NumPy's fp32 one under the interpreter."""
    if not INTERPRETED:
        return torch.log(x)
    import numpy as np

    return torch.from_numpy(np.log(x.cpu().numpy())).to(x.device)


def _logits(rows: int, vocab: int, seed: int, specials: list[float] = ()) -> torch.Tensor:
    """fp32 rows with ties (every value on a coarse grid) and, at seeded places, `specials`."""
    x = (_randn(rows, vocab, seed=seed) * 4).round()
    picks = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))[:len(specials)]
    x.view(-1)[picks.to(x.device)] = torch.tensor(list(specials), device=x.device, dtype=torch.float32)[:picks.numel()]
    return x


@pytest.mark.parametrize("vocab", [1, 7, 2048, 5003])
def test_first_argmax_is_the_op_chain(vocab: int) -> None:
    """Ties to the lowest index within and across the kernel's blocks, rows all -inf, a row with +inf,
    NaN rows (0), strided rows."""
    x = _logits(6, vocab, seed=vocab)
    x[1] = float("-inf")
    x[2, vocab // 2] = float("inf")
    x[3, vocab - 1] = float("nan")
    x[4, -1] = x[4].max() + 1  # the last column, past every block before it
    assert torch.equal(triton_fused.first_argmax(x), sampling.first_argmax(x))
    wide = torch.cat([x, x], dim=1)[:, :vocab]  # rows strided by 2 * vocab
    assert torch.equal(triton_fused.first_argmax(wide), sampling.first_argmax(x))
    assert triton_fused.first_argmax(x[:0]).shape == (0,)


@FEW
@given(rows=st.integers(1, 5), vocab=st.integers(1, 4500), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.sampled_from([float("inf"), float("-inf"), float("nan"), -0.0, 88.0]), max_size=5),
       seeds=st.lists(st.integers(0, 2**64 - 1), min_size=5, max_size=5),
       positions=st.lists(st.integers(0, 2**40), min_size=5, max_size=5),
       temperatures=st.lists(st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.9]), min_size=5, max_size=5))
def test_gumbel_argmax_is_the_op_chain(rows: int, vocab: int, seed: int, specials: list[float], seeds: list[int],
                                       positions: list[int], temperatures: list[float]) -> None:
    """The draw of logits plus each row's noise for (seed, position), and of logits divided by each
    row's temperature first (greedy at 0): the uniforms' integer hash over the whole 64-bit seed range
    and large positions, the division's and the log's bits (the device's), ties and the specials the
    chain sees (-inf where a mask or filter removed a token, NaN rows)."""
    x = _logits(rows, vocab, seed, specials)
    low, high, position = (torch.tensor(v[:rows], device=x.device) for v in
                           ([s & sampling.MASK32 for s in seeds], [s >> 32 for s in seeds], positions))
    temperature = torch.tensor(temperatures[:rows], device=x.device)
    for t in (None, temperature):
        expected = sampling.gumbel_argmax(x, low, high, position, t, log=_device_log)
        assert torch.equal(triton_fused.gumbel_argmax(x, low, high, position, t), expected)
        # a row's draw is its own: alone or among others
        alone = triton_fused.gumbel_argmax(x[-1:], low[-1:], high[-1:], position[-1:], None if t is None else t[-1:])
        assert torch.equal(alone, expected[-1:])


@pytest.mark.parametrize("vocab", [300, 4099])
def test_gumbel_argmax_follows_every_bit_of_the_noise(vocab: int) -> None:
    """Logits that cancel each row's noise exactly (-gumbel): every value sums to 0, all tie, and the
    draw is token 0. A noise value off by one bit upwards anywhere in the row wins the draw instead.
    With a temperature, the rounding of each division picks the token."""
    low = torch.tensor([1, 2**32 - 1, 77, 0], device=DEVICE)
    high = torch.tensor([0, 5, 2**31, 2**32 - 1], device=DEVICE)
    position = torch.tensor([0, 3, 2**33, 12345], device=DEVICE)
    u = sampling.uniforms(sampling.noise_keys(low, high, position), vocab)
    gumbel = -_device_log(-_device_log(u))
    assert sampling.gumbel_argmax(-gumbel, low, high, position, log=_device_log).tolist() == [0] * 4
    assert triton_fused.gumbel_argmax(-gumbel, low, high, position).tolist() == [0] * 4
    # divided by a temperature first: logits of -gumbel * t leave residuals of an ulp or so after the
    # division, so the draw is the token whose division rounded highest (the last row is greedy)
    temperature = torch.tensor([0.7, 0.3, 1.9, 0.0], device=DEVICE)
    x = -gumbel * temperature.unsqueeze(1)
    expected = sampling.gumbel_argmax(x, low, high, position, temperature, log=_device_log)
    assert (expected[:3] != 0).all() and expected[3] == sampling.first_argmax(x[3:]).item()
    assert torch.equal(triton_fused.gumbel_argmax(x, low, high, position, temperature), expected)


# paged slots --------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(sequences=st.integers(1, 5), table_width=st.integers(1, 9), block_size=st.sampled_from([1, 2, 16, 64]),
       rows=st.integers(0, 40), width=st.integers(1, 150), offset=st.integers(-200, 50),
       parts=st.sets(st.sampled_from(["first", "keep", "limit"])), seed=st.integers(0, 2**31 - 1))
def test_paged_slots_are_the_chains_integers(sequences: int, table_width: int, block_size: int, rows: int, width: int,
                                             offset: int, parts: set, seed: int) -> None:
    """Every address of a step (window reads and writes, entries, a compressor's state) is one call: the
    same slots and masks as `paging.paged_slots`'s chain, rows below 0 and past the table included."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 1000, (sequences, table_width), generator=g)
    seq = torch.randint(0, sequences, (rows,), generator=g)
    first = torch.randint(-300, table_width * block_size + 300, (rows,), generator=g) if "first" in parts else None
    keep = torch.rand(rows, generator=g) < 0.6 if "keep" in parts else None
    limit = torch.randint(-5, table_width * block_size + 5, (rows,), generator=g) if "limit" in parts else None
    args = (block_size, seq.to(DEVICE), None if first is None else first.to(DEVICE), offset, width,
            None if keep is None else keep.to(DEVICE), 7 * block_size, None if limit is None else limit.to(DEVICE))
    slots, valid = triton_fused.paged_slots(table.to(DEVICE), *args)
    ref_slots, ref_valid = paging.paged_slots(table.to(DEVICE), *args)
    assert slots.dtype == ref_slots.dtype == torch.int64 and valid.dtype == ref_valid.dtype == torch.bool
    assert torch.equal(slots, ref_slots) and torch.equal(valid, ref_valid)


def test_paged_slots_of_the_reference_chain_are_block_times_size_plus_offset() -> None:
    """The chain itself, on a worked case: table rows [5, 9] and [3, 4] of blocks of 4 rows."""
    table = torch.tensor([[5, 9], [3, 4]])
    slots, valid = paging.paged_slots(table, 4, torch.tensor([0, 1]), torch.tensor([3, -2]), 0, 3,
                                      keep=torch.tensor([True, False]), null_slot=0, limit=torch.tensor([5, 9]))
    assert slots.tolist() == [[23, 36, 37], [0, 0, 0]]  # row 0: rows 3, 4, 5 -> 5*4+3, 9*4+0, 9*4+1
    assert valid.tolist() == [[True, True, False], [False, False, True]]


@settings(max_examples=25, deadline=None)
@example(tokens=2500, ratio=2, real_share=0.9, capacity_share=0.6, seed=3)  # three blocks, counts carried
@given(tokens=st.integers(1, 2600), ratio=st.sampled_from([1, 2, 4, 128]), real_share=st.floats(0, 1),
       capacity_share=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_closing_tokens_are_the_stable_sorts_compaction(tokens: int, ratio: int, real_share: float,
                                                        capacity_share: float, seed: int) -> None:
    """A compressor's closing windows in one program (more tokens than one block: the carried counts)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4 * ratio + 9, (tokens,), generator=g)
    real = torch.rand(tokens, generator=g) < real_share
    capacity = round(capacity_share * tokens)
    out = triton_fused.closing_tokens(positions.to(DEVICE), real.to(DEVICE), ratio, capacity)
    ref = paging.closing_tokens(positions.to(DEVICE), real.to(DEVICE), ratio, capacity)
    for got, expected in zip(out, ref):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


# the indexer's choice -----------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 300), k_share=st.floats(0.01, 1),
       masked_share=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_ascending_topk_is_the_chains_choice_in_its_order(rows: int, width: int, k_share: float, masked_share: float,
                                                          seed: int) -> None:
    """The indexer's top-k, valid entries first in ascending order: the kernel's reordering gives the
    chain's indices and flags, with ties (scores from a few values), -inf (masked entries, whole rows
    too) and NaN among the scores."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (rows, width), generator=g).float()
    scores[torch.rand(rows, width, generator=g) < masked_share] = float("-inf")
    scores[torch.rand(rows, width, generator=g) < 0.05] = float("nan")
    k = max(1, round(k_share * width))
    chosen, good = triton_fused.ascending_topk(scores.to(DEVICE), k)
    ref_chosen, ref_good = composite.ascending_topk(scores.to(DEVICE), k, topk_indices=invariant.topk_indices)
    assert torch.equal(chosen, ref_chosen) and torch.equal(good, ref_good)
    assert chosen.dtype == torch.int64 and good.dtype == torch.bool


# Engram's n-gram rows -----------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6), padding=st.integers(0, 5),
       orders=st.integers(2, 4), heads=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_engram_rows_are_the_chains_integers(lengths: list, padding: int, orders: int, heads: int, seed: int) -> None:
    """Engram's table rows of a step in one launch: the chain's, for rows of any length (empty ones and
    padding tokens included), placeholders (negative ids, whose products hash through negative values:
    torch's remainder takes the prime's sign) and 64-bit multipliers that overflow as they do in torch."""
    from deepinfer.kernels import ngram

    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0] + lengths).cumsum(0)
    tokens = int(starts[-1]) + padding
    compressed = torch.randint(-3, 500, (tokens,), generator=g)
    lookback = torch.randint(0, 500, (len(lengths), orders - 1), generator=g)
    multipliers = torch.randint(-2**62, 2**62, (orders,), generator=g) * 2 + 1
    primes = torch.tensor([7, 11, 13, 499, 503, 509, 521, 523, 541, 547, 557, 563, 569, 571, 577])[:(orders - 1) * heads]
    offsets = torch.randint(0, 10**6, primes.shape, generator=g)
    args = [t.to(DEVICE) for t in (compressed, starts, lookback, multipliers, primes, offsets)]
    rows = triton_fused.engram_rows(*args)
    expected = ngram.engram_rows(*args)
    assert rows.dtype == expected.dtype == torch.int64 and torch.equal(rows, expected)
