"""The grouped Triton experts (`kernels.triton_ops.moe_experts`): the same bits as the per-expert
loop over the invariant Triton matmul and fused SwiGLU, with no host sync, and a token's output
independent of the batch. Compiled kernels only (the per-expert loop under the interpreter is covered in
tests/test_triton_kernels.py's matmul tests)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from cuda_syncs import synchronisations  # noqa: E402
from kernels import fast, triton_fused, triton_ops  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 16, 4, 256, 128


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return indices.cuda(), torch.rand(tokens, TOP_K, generator=gen).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_grouped_experts_match_the_per_expert_loop_bitwise(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / 16).to("cuda", dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / 16).to("cuda", dtype)
    indices, weights = _routing(tokens, tokens)
    loop = fast.routed_experts(x, indices, weights, w13, w2, 7.0, matmul=triton_ops.linear,
                               swiglu=triton_fused.clamped_swiglu)
    outputs = []
    assert synchronisations(lambda: outputs.append(triton_ops.moe_experts(x, indices, weights, w13, w2, 7.0))) == []
    [grouped] = outputs
    assert torch.equal(grouped, loop)
    alone = torch.cat([triton_ops.moe_experts(x[i:i + 1], indices[i:i + 1], weights[i:i + 1], w13, w2, 7.0)
                       for i in range(tokens)])
    assert torch.equal(alone, grouped)
