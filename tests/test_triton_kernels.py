"""The Triton kernels of `kernels.triton_ops`: close to the PyTorch batch-invariant reference, and
bitwise invariant to the batch (a row computed alone equals the same row inside a larger batch).

Runs under the Triton interpreter on CPU by default (small shapes: it is slow); with
TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import inspect

import numpy as np

import pytest
from triton_target import DEVICE, DTYPES, INTERPRETED, triton  # first: it picks the interpreter or the GPU

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels import fast, invariant, triton_fused, triton_ops

ROWS = (1, 3, 17, 40)
FEW = settings(max_examples=10, deadline=None)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_patches():
    """Work around two gaps of Triton's interpreter while this module's tests run, and undo them after
    (test-only; compiled kernels are unaffected). Written against Triton 3.6 and checked against the
    Triton 3.9.0 of the dev environment:

    - `tl.dot` multiplies bfloat16 operands as their raw uint16 storage (still so in 3.9.0); widen them
      to fp32 first (exact: bf16 products fit fp32, which is how the tensor cores treat them too). And it
      is NumPy's matmul, whose BLAS (OpenBLAS) gives a row other bits in a call of other rows on AMD
      CPUs, so it runs as elementwise products summed over k in order instead (what a tile's
      accumulation does on the GPU, one k after another, whatever the tile's rows or layout);
    - with NumPy >= 2.4, `range(0, K, BLOCK)` over a runtime K failed in 3.6: its interpreter converted
      a 1-element array to int implicitly (triton-lang/triton#9171). 3.9.0 converts it itself; the
      replacement below gives the same int there, so it is kept for older Tritons;
    - libdevice's functions have no interpreter implementation (their calls return None): `exp`, `cos`,
      `sin`, `log`, `log1p` and `rsqrt`, the ones `kernels.triton_fused` uses, become NumPy's, so results
      under the interpreter are close to torch's sigmoid, SiLU, softplus, cos, sin, log and rsqrt rather
      than bitwise equal;
    - the interpreter casts fp32 to bf16 by truncating (and mangles fp32 subnormals); compiled kernels
      round to nearest even as PyTorch does, so those casts go through PyTorch.
    """
    if not INTERPRETED:
        yield
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    dot = interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def widen(self, operand):
        if operand.dtype.scalar == triton.language.bfloat16:
            return self.cast_impl(operand, triton.language.float32)
        return operand

    def patched_dot(self, a, b, d, *args):
        a, b = widen(self, a), widen(self, b)
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return dot(self, a, b, d, *args)
        left, right = a.data.astype(d.data.dtype), b.data.astype(d.data.dtype)
        product = left[..., :, :1] * right[..., :1, :]
        for k in range(1, left.shape[-1]):  # each output summed over k in order, whatever the tile
            product = product + left[..., :, k:k + 1] * right[..., k:k + 1, :]
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    cast = interpreter.InterpreterBuilder.cast_impl

    def rounded(self, src, dst_type):
        if src.dtype.scalar != triton.language.float32 or dst_type.scalar != triton.language.bfloat16:
            return cast(self, src, dst_type)
        values = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(values.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)

    from triton.language.extra import libdevice

    with pytest.MonkeyPatch.context() as patch:
        for name in ("exp", "cos", "sin", "log"):
            patch.setattr(libdevice, name, lambda x, _name=name, **_: getattr(triton.language, _name)(x))
        for name, fn in (("log1p", np.log1p), ("rsqrt", lambda v: 1 / np.sqrt(v))):
            patch.setattr(libdevice, name, lambda x, _fn=fn, **_: triton.language.core.tensor(
                interpreter.TensorHandle(_fn(x.handle.data), x.handle.dtype.scalar), x.type))
        patch.setattr(interpreter, "_patch_lang_tensor", patched_tensor)
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", patched_dot)
        patch.setattr(interpreter.InterpreterBuilder, "cast_impl", rounded)
        yield


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    assert torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def _assert_close(out: torch.Tensor, ref: torch.Tensor, scale: float = 1.0) -> None:
    """fp32: ~1e-5 relative to `scale`; bf16 outputs: a couple of bf16 ulps."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.device == ref.device
    tol = 2e-2 if out.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


batch_rows = st.integers(2, 80).flatmap(lambda m: st.tuples(st.just(m), st.integers(0, m - 1)))
seeds = st.integers(0, 2**31 - 1)
dtypes = st.sampled_from(DTYPES)


# linear / grouped_linear ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "out_dim", "in_dim"), [(1, 96, 64), (3, 40, 70), (17, 33, 96), (40, 96, 40)])
def test_linear_matches_reference(dtype: torch.dtype, rows: int, out_dim: int, in_dim: int) -> None:
    x, weight = _randn(rows, in_dim, seed=0), _randn(out_dim, in_dim, seed=1, dtype=dtype)
    _assert_close(triton_ops.linear(x, weight), invariant.linear(x, weight), scale=in_dim**0.5)


def test_linear_leading_dims_and_non_contiguous_input() -> None:
    x, weight = _randn(2, 40, 3, seed=2).transpose(1, 2), _randn(24, 40, seed=3)
    out = triton_ops.linear(x, weight)
    assert out.shape == (2, 3, 24)
    _assert_close(out, invariant.linear(x, weight), scale=40**0.5)


def test_linear_empty_input() -> None:
    out = triton_ops.linear(_randn(0, 16, seed=0), _randn(8, 16, seed=1, dtype=torch.bfloat16))
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16 and out.device.type == DEVICE


@FEW
@given(batch=batch_rows, dtype=dtypes, seed=seeds)
def test_linear_row_does_not_depend_on_batch(batch: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    rows, at = batch
    x, weight = _randn(rows, 70, seed=seed), _randn(72, 70, seed=seed + 1, dtype=dtype)
    _assert_same_bits(triton_ops.linear(x, weight)[at:at + 1], triton_ops.linear(x[at:at + 1], weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_grouped_linear_matches_reference(dtype: torch.dtype, rows: int) -> None:
    x, weight = _randn(rows, 3, 40, seed=4, dtype=dtype), _randn(3 * 24, 40, seed=5, dtype=dtype)
    _assert_close(triton_ops.grouped_linear(x, weight, 3), invariant.grouped_linear(x, weight, 3), scale=40**0.5)


@FEW
@given(batch=batch_rows, dtype=dtypes, seed=seeds)
def test_grouped_linear_row_does_not_depend_on_batch(batch: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    rows, at = batch
    x, weight = _randn(rows, 2, 36, seed=seed, dtype=dtype), _randn(2 * 20, 36, seed=seed + 1, dtype=dtype)
    alone = triton_ops.grouped_linear(x[at:at + 1], weight, 2)
    _assert_same_bits(triton_ops.grouped_linear(x, weight, 2)[at:at + 1], alone)


SKINNY_K = triton_ops.K_CHUNK * 4 + 37  # long enough to be split, with a ragged last chunk


def test_a_narrow_long_weight_is_chunked_by_its_shape_alone() -> None:
    assert triton_ops.k_splits(24, SKINNY_K) == 5 and triton_ops.k_splits(24, 2047) == 1
    assert triton_ops.k_splits(triton_ops.SPLIT_WIDTH - 1, SKINNY_K) == 5
    assert triton_ops.k_splits(triton_ops.SPLIT_WIDTH, SKINNY_K) == 1


@FEW
@given(batch=batch_rows, dtype=dtypes, seed=seeds)
def test_split_linear_matches_reference_and_rows_do_not_depend_on_batch(
        batch: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    """The hyper-connection projections' shape (few columns, long K): the K chunks' folds are added in
    chunk order by `_sum_splits_kernel`, so a row's bits are the same alone and in any batch (across
    tile shapes too)."""
    rows, at = batch
    x, weight = _randn(rows, SKINNY_K, seed=seed), _randn(24, SKINNY_K, seed=seed + 1, dtype=dtype)
    out = triton_ops.linear(x, weight)
    _assert_close(out, invariant.linear(x, weight), scale=SKINNY_K**0.5)
    _assert_same_bits(out[at:at + 1], triton_ops.linear(x[at:at + 1], weight))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_summed_in_separate_programs_or_inside_one_give_the_same_bits(dtype: torch.dtype) -> None:
    rows = triton_ops.SPLIT_ROWS + 6
    width = triton_ops.NARROW_WIDTH + 4  # wider than NARROW_WIDTH: past SPLIT_ROWS rows its chunks add in-program
    x, weight = _randn(rows, 2, SKINNY_K, seed=12), _randn(2 * width, SKINNY_K, seed=13, dtype=dtype)
    inside = triton_ops.grouped_linear(x, weight, 2)  # more than SPLIT_ROWS rows: chunks added in the programs
    _assert_same_bits(inside[:5], triton_ops.grouped_linear(x[:5], weight, 2))  # by _sum_splits_kernel
    _assert_same_bits(triton_ops.linear(x[:, 1], weight[width:]), inside[:, 1])


@given(counts=st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_active_experts_come_first_and_cover_every_slot(counts: list[int]) -> None:
    offsets = torch.tensor([0] + counts, device=DEVICE).cumsum(0)
    slots = sum(counts)
    listed = triton_ops.active_experts(offsets, slots).tolist()
    busy = [e for e, n in enumerate(counts) if n]
    assert len(listed) == min(len(counts), slots) and listed[:len(busy)] == busy


@given(slots=st.integers(0, 70), experts=st.integers(1, 40), per_row=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
       with_rows=st.booleans())
def test_route_slots_give_the_sorts_values(slots: int, experts: int, per_row: int, seed: int, with_rows: bool) -> None:
    """The one-program routing is the torch chain's sort by expert, offsets, active list and sources,
    with repeated experts, unused ones and no slots at all."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (slots,), generator=generator).to(DEVICE)
    rows = torch.randint(0, 1000, (slots,), generator=generator).to(DEVICE) if with_rows else None
    order, offsets = fast.sort_by_expert(ids.unsqueeze(-1), experts)
    got = triton_ops.route_slots(ids, experts, rows, per_row)
    want = (order, offsets, triton_ops.active_experts(offsets, slots), order // per_row if rows is None else rows[order])
    for out, ref in zip(got, want, strict=True):
        assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_route_slots_past_one_program_or_of_no_slots_take_the_torch_chain() -> None:
    ids = torch.randint(0, 384, (triton_ops.ROUTE_MAX_SLOTS + 1,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    order, offsets, active, source = triton_ops.route_slots(ids, 384, per_row=6)
    assert torch.equal(order, torch.sort(ids, stable=True).indices) and torch.equal(source, order // 6)
    assert offsets[-1] == ids.shape[0] and active.shape == (384,)
    order, offsets, active, source = triton_ops.route_slots(ids[:0], 384, rows=ids[:0])
    assert order.shape == active.shape == source.shape == (0,) and offsets.shape == (385,) and not offsets.any()


def _all_tiles(dtype: torch.dtype) -> list[triton_ops.Tiles]:
    """Every launch shape `matmul_tiles` and `expert_tiles` can pick for weights of `dtype`."""
    picks = {triton_ops.matmul_tiles(rows, width, dtype) for rows in (1, 64, 65, 512, 513, 4096)
             for width in (100, 4096, 8192, 16384, 65536)}
    picks.add(triton_ops.expert_tiles(1, 1, 100, dtype))
    return sorted(picks, key=lambda tiles: tuple(vars(tiles).values()))


def test_every_launch_shape_has_at_least_64_rows() -> None:
    """Hopper computes 16- and 32-row tiles with mma.sync and 64-row ones with wgmma, and the two gave a
    bf16 expert product other bits on the H100 at K = 5120 (benchmarks/results/
    expert_kernel_sweep_v41-flash-5l_h100.json): a dispatcher that picked both would make a row's bits
    depend on the batch. (The interpreter cannot show it: its dot adds k in order whatever the tile.)"""
    for dtype in (torch.float32, torch.bfloat16):
        picks = _all_tiles(dtype) + [triton_ops.expert_tiles(slots, experts, 4608, dtype)
                                     for slots in (1, 6, 384, 1536, 3072, 3073, 12288) for experts in (6, 48, 384)]
        assert min(tiles.block_m for tiles in picks) >= 64


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_launch_shape_gives_the_same_bits(monkeypatch, dtype: torch.dtype) -> None:
    """The launch shape is chosen from the row count for speed; the bits of a product must not depend on it
    (plain, grouped, split and per-expert products)."""
    x, weight = _randn(70, 96, seed=7, dtype=dtype), _randn(80, 96, seed=8, dtype=dtype)
    skinny_x, skinny = _randn(5, SKINNY_K, seed=9), _randn(24, SKINNY_K, seed=10, dtype=dtype)
    experts = _randn(3, 40, 96, seed=11, dtype=dtype)
    order = torch.tensor([5, 0, 69, 3, 4, 1, 2, *range(50, 64)], device=DEVICE)
    offsets = torch.tensor([0, 3, 3, 21], device=DEVICE)

    def products() -> list[torch.Tensor]:
        return [triton_ops.linear(x, weight), triton_ops.grouped_linear(x.view(70, 2, 48), weight.view(160, 48), 2),
                triton_ops.linear(skinny_x, skinny), triton_ops.expert_matmul(x, order, offsets, experts)]

    reference = products()
    for tiles in _all_tiles(dtype):
        monkeypatch.setattr(triton_ops, "matmul_tiles", lambda *args, tiles=tiles: tiles)
        monkeypatch.setattr(triton_ops, "expert_tiles", lambda *args, tiles=tiles: tiles)
        for out, expected in zip(products(), reference):
            _assert_same_bits(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_persistent_kernel_gives_the_pointer_kernels_bits(monkeypatch, dtype: torch.dtype) -> None:
    """Prefill-sized products of plain weights run `_persistent_matmul_kernel` (tensor-descriptor reads,
    tiles walked by one program per SM; 4 under the interpreter, so programs walk several tiles): ragged
    rows, columns and K, groups, and K chunks added in the program all give `_matmul_kernel`'s bits.
    Inputs a descriptor cannot read (an unaligned base, a group's K not a multiple of BLOCK_K) fall back."""
    rows, width = triton_ops.SPLIT_ROWS + 6, triton_ops.NARROW_WIDTH + 4
    x, weight = _randn(rows, 96, seed=14, dtype=dtype), _randn(80, 96, seed=15, dtype=dtype)
    grouped_x, grouped = _randn(rows, 2, 128, seed=16, dtype=dtype), _randn(2 * 40, 128, seed=17, dtype=dtype)
    depth = SKINNY_K + 3  # chunked, ragged last chunk and slice, rows a multiple of 16 bytes as descriptors want
    long_x, long = _randn(rows, depth, seed=18, dtype=dtype), _randn(width, depth, seed=19, dtype=dtype)
    unaligned_x = _randn(rows * 96 + 1, seed=20, dtype=dtype)[1:].view(rows, 96)
    ragged_groups = _randn(rows, 2, 48, seed=21, dtype=dtype)
    assert triton_ops.k_splits(width, depth) > 1 and not triton_ops._descriptor_ready(unaligned_x.view(rows, 1, 96), weight)
    assert not triton_ops._descriptor_ready(ragged_groups, grouped[:, :48])

    def products() -> list[torch.Tensor]:
        return [triton_ops.linear(x, weight), triton_ops.grouped_linear(grouped_x, grouped, 2),
                triton_ops.linear(long_x, long), triton_ops.linear(unaligned_x, weight),
                triton_ops.grouped_linear(ragged_groups, grouped[:, :48].contiguous(), 2)]

    monkeypatch.setattr(triton_ops, "matmul_tiles", lambda *args: triton_ops.Tiles(64, 32, 4, 3))
    reference = products()
    launches = []
    persistent_matmul = triton_ops._persistent_matmul
    monkeypatch.setattr(triton_ops, "_persistent_matmul", lambda *args: launches.append(persistent_matmul(*args)))
    monkeypatch.setattr(triton_ops, "matmul_tiles", lambda *args: triton_ops.Tiles(64, 32, 4, 3, persistent=True))
    for out, expected in zip(products(), reference):
        _assert_same_bits(out, expected)
    assert len(launches) == 3


# rms_norm / unweighted_rms_norm -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [64, 100, 1500])
def test_rms_norms_match_reference(dtype: torch.dtype, rows: int, width: int) -> None:
    x, weight = _randn(rows, width, seed=6, dtype=dtype), _randn(width, seed=7).abs()
    _assert_close(triton_ops.rms_norm(x, weight, 1e-6), invariant.rms_norm(x, weight, 1e-6), scale=4.0)
    _assert_close(triton_ops.unweighted_rms_norm(x, 1e-6), invariant.unweighted_rms_norm(x, 1e-6), scale=4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_unweighted_norm_in_fp32_of_a_narrower_input_is_the_norm_of_its_cast(dtype: torch.dtype) -> None:
    """The streams' norm before the hyper-connection coefficients: x read as it is, no copy of its cast."""
    x = _randn(5, 3 * 160, seed=10, dtype=dtype)
    for table in (triton_ops, invariant):
        _assert_same_bits(table.unweighted_rms_norm(x, 1e-6, torch.float32), table.unweighted_rms_norm(x.float(), 1e-6))
    assert triton_ops.unweighted_rms_norm(x, 1e-6, torch.float32).dtype == torch.float32


def test_rms_norms_leading_dims_non_contiguous_and_empty() -> None:
    x = _randn(3, 48, 4, seed=8).transpose(1, 2)  # [3, 4, 48], not contiguous
    weight = _randn(48, seed=9)
    _assert_close(triton_ops.rms_norm(x, weight, 1e-6), invariant.rms_norm(x, weight, 1e-6), scale=4.0)
    _assert_close(triton_ops.unweighted_rms_norm(x, 1e-6), invariant.unweighted_rms_norm(x, 1e-6), scale=4.0)
    assert triton_ops.rms_norm(x[:0], weight, 1e-6).shape == (0, 4, 48)
    assert triton_ops.unweighted_rms_norm(x[:0], 1e-6).shape == (0, 4, 48)


@FEW
@given(batch=batch_rows, dtype=dtypes, seed=seeds)
def test_rms_norm_rows_do_not_depend_on_batch(batch: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    rows, at = batch
    x, weight = _randn(rows, 1100, seed=seed, dtype=dtype), _randn(1100, seed=seed + 1)
    _assert_same_bits(triton_ops.rms_norm(x, weight, 1e-6)[at:at + 1], triton_ops.rms_norm(x[at:at + 1], weight, 1e-6))
    alone = triton_ops.unweighted_rms_norm(x[at:at + 1], 1e-6)
    _assert_same_bits(triton_ops.unweighted_rms_norm(x, 1e-6)[at:at + 1], alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("streams_width", [(4, 40), (4, 1100), (4, 5120), (2, 300), (3, 64)])
def test_collapsed_norm_is_the_collapse_then_the_norm(dtype: torch.dtype, streams_width: tuple[int, int]) -> None:
    """One launch with the bits of the collapse kernel and then the norm kernel (3 streams take the two
    ops), for every token, and a token's row is the same alone."""
    n, width = streams_width
    streams, pre = _randn(3, n, width, seed=width, dtype=dtype), _randn(3, n, seed=width + 1)
    weight = _randn(width, seed=width + 2).abs()
    fused = triton_ops.collapsed_norm(pre, streams, weight, 1e-6)
    _assert_same_bits(fused, triton_ops.rms_norm(triton_fused.hyper_collapse(pre, streams), weight, 1e-6))
    _assert_same_bits(fused[1:2], triton_ops.collapsed_norm(pre[1:2], streams[1:2], weight, 1e-6))
    assert triton_ops.collapsed_norm(pre[:0], streams[:0], weight, 1e-6).shape == (0, width)


# softmax / log_softmax --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [7, 100, 2100])
def test_softmaxes_match_reference(dtype: torch.dtype, rows: int, width: int) -> None:
    x = 4 * _randn(rows, width, seed=10, dtype=dtype)
    x[:, ::3] = float("-inf")  # filtered logits, as the sampler makes them
    _assert_close(triton_ops.softmax(x), invariant.softmax(x))
    _assert_close(triton_ops.log_softmax(x), invariant.log_softmax(x), scale=10.0)


def test_softmaxes_other_dim_one_dim_and_empty() -> None:
    x = _randn(5, 30, 2, seed=11)
    _assert_close(triton_ops.softmax(x, dim=1), invariant.softmax(x, dim=1))
    _assert_close(triton_ops.log_softmax(x, 0), invariant.log_softmax(x, 0), scale=10.0)
    _assert_close(triton_ops.log_softmax(x[0, :, 0]), invariant.log_softmax(x[0, :, 0]), scale=10.0)
    assert triton_ops.softmax(x[:0]).shape == (0, 30, 2)


@FEW
@given(batch=batch_rows, dtype=dtypes, seed=seeds)
def test_softmax_rows_do_not_depend_on_batch(batch: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    rows, at = batch
    x = 4 * _randn(rows, 1300, seed=seed, dtype=dtype)
    _assert_same_bits(triton_ops.softmax(x)[at:at + 1], triton_ops.softmax(x[at:at + 1]))
    _assert_same_bits(triton_ops.log_softmax(x)[at:at + 1], triton_ops.log_softmax(x[at:at + 1]))


# sink_attention ---------------------------------------------------------------------------------

def _attention_inputs(
    tokens: int, keys: int, seed: int, dtype: torch.dtype, heads: int = 2, dim: int = 48
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, kv = _randn(tokens, heads, dim, seed=seed, dtype=dtype), _randn(tokens, keys, dim, seed=seed + 1, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 2)
    valid = (torch.rand(tokens, keys, generator=generator) < 0.7).to(DEVICE)
    return 2 * q, kv, valid, _randn(heads, seed=seed + 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "keys", "dim"), [(1, 96, 64), (3, 5, 48), (17, 70, 24), (40, 64, 16)])
def test_sink_attention_matches_reference(dtype: torch.dtype, tokens: int, keys: int, dim: int) -> None:
    q, kv, valid, sinks = _attention_inputs(tokens, keys, seed=12, dtype=dtype, dim=dim)
    out = triton_ops.sink_attention(q, kv, valid, sinks, dim**-0.5)
    _assert_close(out, invariant.sink_attention(q, kv, valid, sinks, dim**-0.5))


def test_sink_attention_mixed_dtypes_and_non_contiguous() -> None:
    q, kv, valid, sinks = _attention_inputs(6, 80, seed=13, dtype=torch.float32)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)
    kv = kv.to(torch.bfloat16)
    _assert_close(triton_ops.sink_attention(q, kv, valid, sinks, 0.1), invariant.sink_attention(q, kv, valid, sinks, 0.1))


def test_sink_attention_fully_masked_query_is_zero_and_empty_batch() -> None:
    q, kv, valid, sinks = _attention_inputs(3, 70, seed=14, dtype=torch.bfloat16)
    valid[1] = False
    out = triton_ops.sink_attention(q, kv, valid, sinks, 0.1)
    assert not out.isnan().any() and torch.equal(out[1], torch.zeros_like(out[1]))
    empty = triton_ops.sink_attention(q[:0], kv[:0], valid[:0], sinks, 0.1)
    assert empty.shape == (0, 2, 48) and empty.dtype == torch.bfloat16


@FEW
@given(batch=st.integers(2, 40).flatmap(lambda t: st.tuples(st.just(t), st.integers(0, t - 1))), dtype=dtypes, seed=seeds)
def test_sink_attention_token_does_not_depend_on_batch(batch: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    tokens, at = batch
    q, kv, valid, sinks = _attention_inputs(tokens, 70, seed=seed, dtype=dtype)
    alone = triton_ops.sink_attention(q[at:at + 1], kv[at:at + 1], valid[at:at + 1], sinks, 0.1)
    _assert_same_bits(triton_ops.sink_attention(q, kv, valid, sinks, 0.1)[at:at + 1], alone)


@FEW
@given(keys=st.integers(1, 90), pad=st.integers(1, 150), dtype=dtypes, seed=seeds)
def test_sink_attention_invalid_padding_does_not_change_bits(keys: int, pad: int, dtype: torch.dtype, seed: int) -> None:
    q, kv, valid, sinks = _attention_inputs(2, keys, seed=seed, dtype=dtype)
    garbage = torch.full((2, pad, kv.shape[2]), float("nan"), dtype=dtype, device=DEVICE)  # never read
    padded_kv, padded_valid = torch.cat([kv, garbage], dim=1), torch.cat([valid, valid.new_zeros(2, pad)], dim=1)
    _assert_same_bits(
        triton_ops.sink_attention(q, padded_kv, padded_valid, sinks, 0.1), triton_ops.sink_attention(q, kv, valid, sinks, 0.1)
    )


# paged attention and indexer: keys read through their slots ---------------------------------------

def _paged_caches(tokens: int, window: int, entries: int, dim: int, index_dim: int, seed: int, dtype: torch.dtype):
    """A window pool [rows, dim] and an entries pool [rows, dim + index_dim] whose rows past the first
    few hold NaN (stale rows, read only as invalid keys), and per-token slots and validity into both."""
    generator = torch.Generator().manual_seed(seed)
    window_pool = _randn(40, dim, seed=seed, dtype=dtype)
    entry_pool = _randn(30, dim + index_dim, seed=seed + 1, dtype=dtype)
    window_pool[35:], entry_pool[25:] = float("nan"), float("nan")
    window_slots = torch.randint(0, 40, (tokens, window), generator=generator).to(DEVICE)
    entry_slots = torch.randint(0, 30, (tokens, entries), generator=generator).to(DEVICE)
    window_valid = (window_slots < 35) & (torch.rand(tokens, window, generator=generator) < 0.8).to(DEVICE)
    entry_valid = (entry_slots < 25) & (torch.rand(tokens, entries, generator=generator) < 0.8).to(DEVICE)
    return window_pool, window_slots, window_valid, entry_pool, entry_slots, entry_valid


@FEW
@given(tokens=st.integers(1, 12), window=st.integers(1, 80), entries=st.integers(0, 90), dtype=dtypes, seed=seeds)
def test_paged_attention_reads_the_keys_the_gathered_call_gets(tokens: int, window: int, entries: int,
                                                               dtype: torch.dtype, seed: int) -> None:
    """Bitwise the gathered call's result (and so row-invariant as it is), with and without entries."""
    window_pool, window_slots, window_valid, entry_pool, entry_slots, entry_valid = _paged_caches(
        tokens, window, entries, 32, 16, seed, dtype)
    q, sinks = 2 * _randn(tokens, 3, 32, seed=seed + 2, dtype=dtype), _randn(3, seed=seed + 3)
    if entries:
        keys = torch.cat([window_pool[window_slots], entry_pool[entry_slots, :32]], dim=1)
        valid = torch.cat([window_valid, entry_valid], dim=1)
        paged = triton_ops.paged_sink_attention(q, window_pool, window_slots, window_valid, entry_pool, entry_slots,
                                                entry_valid, sinks, 0.1)
    else:
        keys, valid = window_pool[window_slots], window_valid
        paged = triton_ops.paged_sink_attention(q, window_pool, window_slots, window_valid, None, None, None, sinks, 0.1)
    _assert_same_bits(paged, triton_ops.sink_attention(q, keys, valid, sinks, 0.1))
    assert not paged.isnan().any()


def test_paged_attention_over_pools_of_two_dtypes_gathers_them() -> None:
    window_pool, window_slots, window_valid, entry_pool, entry_slots, entry_valid = _paged_caches(
        3, 10, 7, 32, 16, seed=40, dtype=torch.float32)
    q, sinks = _randn(3, 2, 32, seed=41), _randn(2, seed=42)
    args = (q, window_pool, window_slots, window_valid, entry_pool.bfloat16(), entry_slots, entry_valid, sinks, 0.1)
    keys = torch.cat([window_pool[window_slots], entry_pool.bfloat16()[entry_slots, :32].float()], dim=1)
    _assert_same_bits(triton_ops.paged_sink_attention(*args),
                      triton_ops.sink_attention(q, keys, torch.cat([window_valid, entry_valid], dim=1), sinks, 0.1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_indexer_scores_read_the_keys_the_gathered_call_gets(dtype: torch.dtype) -> None:
    _, _, _, entry_pool, entry_slots, entry_valid = _paged_caches(5, 1, 70, 32, 16, seed=43, dtype=dtype)
    q, weights = _randn(5, 4, 16, seed=44, dtype=dtype), _randn(5, 4, seed=45)
    paged = triton_ops.paged_indexer_scores(q, entry_pool, entry_slots, 32, weights, entry_valid, 0.2)
    gathered = triton_ops.indexer_scores(q, entry_pool[entry_slots, 32:], weights, entry_valid, 0.2)
    _assert_same_bits(paged, gathered)


# indexer scores / window pooling / Sinkhorn ---------------------------------------------------

def _indexer_inputs(tokens: int, keys: int, seed: int, dtype: torch.dtype = torch.float32):
    q, k = _randn(tokens, 4, 24, seed=seed, dtype=dtype), _randn(tokens, keys, 24, seed=seed + 1, dtype=dtype)
    weights = _randn(tokens, 4, seed=seed + 2)
    valid = torch.rand(tokens, keys, generator=torch.Generator().manual_seed(seed)).to(DEVICE) < 0.8
    return q, k, weights, valid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "keys"), [(1, 5), (3, 64), (17, 130)])
def test_indexer_scores_match_reference(dtype: torch.dtype, tokens: int, keys: int) -> None:
    q, k, weights, valid = _indexer_inputs(tokens, keys, seed=tokens, dtype=dtype)
    out, ref = triton_ops.indexer_scores(q, k, weights, valid, 0.2), invariant.indexer_scores(q, k, weights, valid, 0.2)
    assert torch.equal(out.isinf(), ~valid)
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("table", [triton_ops, invariant])
def test_indexer_head_weights_are_widened_and_scaled_as_the_caller_would(table) -> None:
    """A projection's bf16 head weights and their scale go in as they are: the bits of widening and
    scaling them first (one fp32 product each)."""
    q, k, weights, valid = _indexer_inputs(3, 40, seed=9)
    weights = weights.bfloat16()
    scale = 24 ** -0.5 * 4 ** -0.5
    _assert_same_bits(table.indexer_scores(q, k, weights, valid, 0.2, weight_scale=scale),
                      table.indexer_scores(q, k, weights.float() * scale, valid, 0.2))


@FEW
@given(batch=st.integers(2, 30).flatmap(lambda t: st.tuples(st.just(t), st.integers(0, t - 1))), seed=seeds)
def test_indexer_scores_token_does_not_depend_on_batch(batch: tuple[int, int], seed: int) -> None:
    tokens, at = batch
    q, k, weights, valid = _indexer_inputs(tokens, 70, seed=seed)
    alone = triton_ops.indexer_scores(q[at:at + 1], k[at:at + 1], weights[at:at + 1], valid[at:at + 1], 0.2)
    _assert_same_bits(triton_ops.indexer_scores(q, k, weights, valid, 0.2)[at:at + 1], alone)


def _pool_inputs(windows: int, slots: int, dim: int, seed: int, dtype: torch.dtype = torch.float32):
    kv, gate = _randn(windows, slots, dim, seed=seed, dtype=dtype), _randn(windows, slots, dim, seed=seed + 1, dtype=dtype)
    gate[:, -1] = float("-inf")  # a slot outside the window gets weight 0
    return kv, gate, _randn(slots, dim, seed=seed + 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("windows", "slots", "dim"), [(1, 4, 16), (3, 8, 40), (5, 16, 300)])
def test_window_pool_matches_reference(dtype: torch.dtype, windows: int, slots: int, dim: int) -> None:
    kv, gate, bias = _pool_inputs(windows, slots, dim, seed=slots, dtype=dtype)
    _assert_close(triton_ops.window_pool(kv, gate, bias), invariant.window_pool(kv, gate, bias))


@FEW
@given(batch=st.integers(2, 12).flatmap(lambda t: st.tuples(st.just(t), st.integers(0, t - 1))), seed=seeds)
def test_window_pool_does_not_depend_on_batch(batch: tuple[int, int], seed: int) -> None:
    windows, at = batch
    kv, gate, bias = _pool_inputs(windows, 8, 40, seed=seed)
    alone = triton_ops.window_pool(kv[at:at + 1], gate[at:at + 1], bias)
    _assert_same_bits(triton_ops.window_pool(kv, gate, bias)[at:at + 1], alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("overlap", "with_bias"), [(True, True), (False, True), (False, False)])
def test_paged_window_pool_reads_state_rows_with_the_bits_of_pooling_them_gathered(
        dtype: torch.dtype, overlap: bool, with_bias: bool) -> None:
    """A compressor's pooling reads its state rows through their slots: the bits of `window_pool` over
    the rows gathered and masked (`composite.paged_window_pool`), for V4's overlapping series, its
    plain ones and V4.1's bias-free ones. Invalid slots hold NaN (stale rows) and weigh nothing; a
    window with no valid slot (unused capacity) pools to NaN in both."""
    from deepinfer.kernels import composite

    dim, ratio = 40, 4
    width = 2 * dim if overlap else dim
    count = 2 * ratio if overlap else ratio
    pool = _randn(30, 3 + 2 * width + 5, seed=11, dtype=dtype)  # other columns around this compressor's
    pool[20:] = float("nan")  # stale rows: what invalid slots point at
    valid = (torch.rand(6, count, generator=torch.Generator().manual_seed(13)) < 0.7).to(DEVICE)
    valid[:, 0], valid[4] = True, False
    slots = torch.where(valid, torch.randint(0, 20, (6, count), generator=torch.Generator().manual_seed(12)).to(DEVICE),
                        torch.randint(20, 30, (6, count), generator=torch.Generator().manual_seed(14)).to(DEVICE))
    state = pool[:, 3:3 + 2 * width]
    bias = _randn(ratio, width, seed=14) if with_bias else None
    out = triton_ops.paged_window_pool(state, slots, valid, bias, dim, overlap)
    ref = composite.paged_window_pool(state, slots, valid, bias, dim, overlap, window_pool=triton_ops.window_pool)
    assert out.shape == (6, dim) and out[4].isnan().all() and not out[:4].isnan().any()
    _assert_same_bits(torch.nan_to_num(out), torch.nan_to_num(ref))


@pytest.mark.parametrize("n", [1, 3, 4])
def test_sinkhorn_matches_reference(n: int) -> None:
    logits = _randn(7, n, n, seed=n)
    out = triton_fused.sinkhorn(logits, 20, 1e-6)
    _assert_close(out, invariant.sinkhorn(logits, 20, 1e-6))
    torch.testing.assert_close(out.sum(-2), torch.ones(7, n, device=DEVICE), rtol=1e-4, atol=1e-4)


@FEW
@given(batch=st.integers(2, 50).flatmap(lambda t: st.tuples(st.just(t), st.integers(0, t - 1))), seed=seeds)
def test_sinkhorn_does_not_depend_on_batch(batch: tuple[int, int], seed: int) -> None:
    tokens, at = batch
    logits = _randn(tokens, 4, 4, seed=seed)
    _assert_same_bits(triton_fused.sinkhorn(logits, 10, 1e-6)[at:at + 1], triton_fused.sinkhorn(logits[at:at + 1], 10, 1e-6))


def test_every_registered_op_keeps_the_reference_signature() -> None:
    """Each CUDA op takes what the op it replaces takes: the PyTorch primitive's parameters, a cache
    format's (with its defaults), a sampling chain's, or a composite's (less the primitives
    `kernels.bind` supplies as keywords); its keyword-only parameters are the reference's."""
    from deepinfer.kernels import composite, ngram, paging, quant, sampling

    for name, fn in {**triton_ops.OPS, **triton_fused.OPS}.items():
        reference = next(getattr(module, name) for module in (invariant, quant, sampling, paging, ngram, composite)
                         if hasattr(module, name))
        keywords = {p: spec.default for p, spec in inspect.signature(reference).parameters.items()
                    if spec.kind == spec.KEYWORD_ONLY}
        expected = [(p, spec.default) for p, spec in inspect.signature(reference).parameters.items()
                    if spec.kind != spec.KEYWORD_ONLY]
        got = [(p, spec.default) for p, spec in inspect.signature(fn).parameters.items()
               if spec.kind != spec.KEYWORD_ONLY]
        for p, spec in inspect.signature(fn).parameters.items():  # keywords: the reference's, with its defaults
            if spec.kind == spec.KEYWORD_ONLY:
                assert p in keywords and keywords[p] == spec.default, (name, p)
        assert [p for p, _ in got] == [p for p, _ in expected], name
        if name.endswith("_qdq"):
            assert got == expected, name
