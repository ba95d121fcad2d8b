"""The kernels dispatch: `kernels.bind` gives one read-only table of implementations per
(numerics mode, device type)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels import fast, invariant


def test_modes_pick_their_implementations():
    assert kernels.bind("fast", "cpu").linear is fast.linear
    ops = kernels.bind("batch_invariant", "cpu")
    assert ops.linear is invariant.linear and ops.log is invariant.log
    assert kernels.bind("fast", "cpu").sink_attention is fast.sink_attention
    assert ops.sink_attention is invariant.sink_attention
    assert kernels.bind("batch_invariant", "cpu") is ops  # bound once


def test_composites_use_the_tables_own_primitives():
    for mode, module in (("fast", fast), ("batch_invariant", invariant)):
        ops = kernels.bind(mode, "cpu")
        assert ops.moe_experts.keywords["matmul"] is module.linear
        assert ops.expert_outputs.keywords["matmul"] is module.linear
        assert ops.hyper_collapse.keywords["ordered_sum"] is module.ordered_sum
        assert ops.hyper_coefficients.keywords == {"sigmoid": module.sigmoid, "sinkhorn": module.sinkhorn}
        assert ops.hyper_expand.keywords["mix_streams"] is module.mix_streams
        assert ops.rotary_table.keywords["cos_sin"] is module.cos_sin


def test_cuda_fast_table_reads_nothing_on_the_host():
    """On CUDA the fast table's matmuls and experts are `kernels/fast_cuda.py`'s (grouped GEMMs, and the
    Triton kernels for stored weights), so fast steps are captured in CUDA graphs; its cache formats are
    the invariant table's one-launch kernels (quant's bits); the rest is PyTorch's."""
    fast_cuda = pytest.importorskip("deepinfer.kernels.fast_cuda")
    triton_fused = pytest.importorskip("deepinfer.kernels.triton_fused")
    cuda = kernels.bind("fast", "cuda")
    for name, op in fast_cuda.OPS.items():
        assert getattr(cuda, name) is op
    for name in ("fp8_ue8m0_qdq", "mxfp4_qdq", "nvfp4_qdq"):
        assert getattr(cuda, name) is triton_fused.OPS[name] is getattr(kernels.bind("batch_invariant", "cuda"), name)
    assert cuda.sink_attention is fast.sink_attention and cuda.weighted_combine is fast.weighted_combine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_fast_experts_compute_the_per_expert_loop_without_host_reads(monkeypatch, dtype):
    """`fast.grouped_expert_outputs` (one grouped GEMM per matrix over the slots sorted on the device) gives
    what the per-expert loop gives, some experts empty, slots through `rows`, and never reads a tensor
    back to the host (a read is what keeps a step out of a CUDA graph)."""
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter, tokens, top_k = 6, 32, 24, 9, 2
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 4).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 4).to(dtype)
    indices = torch.stack([torch.randperm(4, generator=gen)[:top_k] for _ in range(tokens)])  # experts 4, 5 idle
    rows = fast.slot_rows(indices)
    loop = fast.expert_outputs(x, indices.reshape(-1), w13, w2, 7.0, fast.linear, fast.clamped_swiglu, rows=rows)
    for name in ("tolist", "item", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *args, name=name: pytest.fail(f"Tensor.{name} read the host"))
    grouped = fast.grouped_expert_outputs(x, indices.reshape(-1), w13, w2, 7.0, fast.clamped_swiglu, rows=rows)
    monkeypatch.undo()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=tol, atol=tol)
    none = fast.grouped_expert_outputs(x, indices.reshape(-1)[:0], w13, w2, 7.0, fast.clamped_swiglu)
    assert none.shape == (0, hidden) and none.dtype == dtype  # a rank the exchange sent nothing


def test_cuda_batch_invariant_table_takes_the_triton_kernels():
    triton_ops = pytest.importorskip("deepinfer.kernels.triton_ops")
    from deepinfer.kernels import triton_fused

    cuda = kernels.bind("batch_invariant", "cuda")
    for name, op in {**triton_ops.OPS, **triton_fused.OPS}.items():
        assert getattr(cuda, name) is op
    assert cuda.moe_experts is triton_ops.moe_experts  # grouped over experts on the device
    assert cuda.expert_outputs is triton_ops.expert_outputs and cuda.weighted_combine is triton_fused.weighted_combine
    assert cuda.hyper_expand is triton_fused.hyper_expand  # fused, not the composite
    assert cuda.topk_indices is invariant.topk_indices  # not covered by Triton: PyTorch invariant


def test_every_op_is_bound_and_ops_are_read_only():
    ops = kernels.bind("batch_invariant", "cpu")
    assert all(callable(getattr(ops, name)) for name in kernels.OPS)
    with pytest.raises(AttributeError, match="Ops are read-only"):
        ops.linear = fast.linear


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown numerics mode 'exact'"):
        kernels.bind("exact", "cpu")
    with pytest.raises(AttributeError, match="no attribute 'matmul'"):
        kernels.bind("fast", "cpu").matmul  # noqa: B018


def test_row_tiles_bind_a_table_whose_matmuls_cut_batches_into_them():
    tiles = invariant.RowTiles({torch.float32: (2, invariant.ROW_TILE)})
    ops = kernels.bind("batch_invariant", "cpu", tiles)
    assert ops.row_tiles is tiles and ops.linear.keywords == {"row_tiles": tiles}
    assert ops.moe_experts.keywords["matmul"] is ops.linear and ops.grouped_linear.keywords == {"row_tiles": tiles}
    assert kernels.bind("batch_invariant", "cpu").row_tiles is invariant.CANONICAL
    with pytest.raises(ValueError) as refused:
        kernels.bind("fast", "cpu", tiles)
    assert str(refused.value) == "row tiles are a batch-invariant CPU setting, not one of fast on cpu"
