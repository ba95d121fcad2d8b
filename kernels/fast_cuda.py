"""The `fast` table's kernels on CUDA: PyTorch's (cuBLAS) for plain weights, one grouped GEMM per
matrix for the routed experts, and for weights kept as stored (FP8, MXFP4) the Triton kernels that
decode B tiles in place (PyTorch has no kernel for them: decoding a whole weight before each product
would cost more than the product). None of them reads the host, so fast steps are captured in CUDA
graphs as batch-invariant ones are; none promises bits across batch shapes."""

from __future__ import annotations

import torch

from deepinfer.kernels import fast, triton_ops
from deepinfer.kernels.quant import QuantizedWeight


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return triton_ops.linear(x, weight)
    return fast.linear(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, groups: int) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return triton_ops.grouped_linear(x, weight, groups)
    return fast.grouped_linear(x, weight, groups)


def expert_outputs(
    x: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
    limit: float, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMMs for bf16 weights whose rows are whole 16-byte units (what the grouped GEMM's CUDA
    kernels take), the Triton grouped kernel for the others (stored, fp32 or oddly shaped)."""
    if isinstance(w13, QuantizedWeight) or w13.dtype != torch.bfloat16 or w2.shape[1] % 8 or w2.shape[2] % 8:
        return triton_ops.expert_outputs(x, experts, w13, w2, limit, rows=rows)
    return fast.grouped_expert_outputs(x, experts, w13, w2, limit, fast.clamped_swiglu, rows=rows)


def moe_experts(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight, limit: float, shared: torch.Tensor | None = None,
) -> torch.Tensor:
    slots = expert_outputs(x, indices.reshape(-1), w13, w2, limit, rows=fast.slot_rows(indices))
    return fast.weighted_combine(slots.view(*indices.shape, -1), weights, shared)


OPS = {"linear": linear, "grouped_linear": grouped_linear, "expert_outputs": expert_outputs,
       "moe_experts": moe_experts}
