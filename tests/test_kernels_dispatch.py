"""The kernels dispatch: one table of implementations per (numerics mode, device type)."""

from __future__ import annotations

import pytest

import kernels
from kernels import fast, invariant


def test_modes_pick_their_implementations():
    with kernels.numerics("fast"):
        assert kernels.linear is fast.linear
    with kernels.numerics("batch_invariant"):
        assert kernels.linear is invariant.linear
        with kernels.numerics("fast"):
            assert kernels.sink_attention is fast.sink_attention
        assert kernels.sink_attention is invariant.sink_attention


def test_routed_experts_use_the_tables_own_matmul():
    for mode, module in (("fast", fast), ("batch_invariant", invariant)):
        assert kernels.table(mode, "cpu")["moe_experts"].keywords["matmul"] is module.linear
    assert kernels.table("fast", "cuda")["linear"] is fast.linear


def test_cuda_batch_invariant_table_takes_the_triton_kernels():
    triton_ops = pytest.importorskip("kernels.triton_ops")
    cuda = kernels.table("batch_invariant", "cuda")
    for name, op in triton_ops.OPS.items():
        assert cuda[name] is op
    assert cuda["moe_experts"].keywords["matmul"] is triton_ops.OPS["linear"]
    assert cuda["topk_indices"] is invariant.topk_indices  # not covered by Triton: PyTorch invariant


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown numerics mode 'exact'"):
        kernels.table("exact", "cpu")
    with pytest.raises(AttributeError, match="no attribute 'matmul'"):
        kernels.matmul  # noqa: B018
