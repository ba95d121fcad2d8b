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
from deepinfer.kernels import fast, triton_fused, triton_ops  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_share_of_the_experts_gives_each_slot_the_bits_of_all_of_them(dtype):
    """Expert parallelism's per-rank work (`expert_outputs` over the experts one rank holds, then the
    fused weighted combine at the token's rank) is `moe_experts` bit for bit."""
    tokens = 37
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / 16).to("cuda", dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / 16).to("cuda", dtype)
    indices, weights = _routing(tokens, 7)
    whole = triton_ops.moe_experts(x, indices, weights, w13, w2, 7.0)
    flat = indices.reshape(-1)
    slots = torch.empty(tokens * TOP_K, HIDDEN, dtype=dtype, device="cuda")
    for held in (torch.arange(0, EXPERTS, 2), torch.arange(1, EXPERTS, 2)):  # two ranks, interleaved experts
        held = held.cuda()
        mine = torch.isin(flat, held).nonzero().squeeze(1)
        local = torch.searchsorted(held, flat[mine])
        slots[mine] = triton_ops.expert_outputs(x[mine // TOP_K], local, w13[held], w2[held], 7.0)
    assert torch.equal(triton_fused.weighted_combine(slots.view(tokens, TOP_K, HIDDEN), weights), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_cuda_experts_sync_nothing_and_compute_the_experts(dtype):
    """The fast table's CUDA experts (`kernels/fast_cuda.py`: grouped GEMMs for bf16, the Triton kernel
    otherwise) read nothing back to the host, and compute the experts (close to the invariant kernel)."""
    from deepinfer.kernels import fast_cuda

    tokens = 70
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / 16).to("cuda", dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / 16).to("cuda", dtype)
    indices, weights = _routing(tokens, 9)
    outputs = []
    assert synchronisations(lambda: outputs.append(fast_cuda.moe_experts(x, indices, weights, w13, w2, 7.0))) == []
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(outputs[0].float(), triton_ops.moe_experts(x, indices, weights, w13, w2, 7.0).float(),
                               rtol=tol, atol=tol)
