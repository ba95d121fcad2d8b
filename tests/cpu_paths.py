"""Which CPU code path this process computes on, for tests whose expected bits depend on it.

The contract fixes bits per code path (kernels/invariant.py, kernels/selftest.py): fp32 follows
oneDNN's fp32 inner-product kernel (the matmuls), MKL's code path as MKL reports it (the batched
attention products) and the instruction set of PyTorch's own kernels (norms, softmax, exp), bf16
also oneDNN's bf16 matmul kernel. Where oneDNN's bf16 kernels are not
batch-invariant (AMX) the engine refuses bf16 (tests/test_cpu_isa.py checks the refusal), so bf16
invariance tests skip with its reason.
"""

from __future__ import annotations

import torch

from deepinfer.kernels import cpu_isa


def bf16_refusal() -> str | None:
    """Why a batch-invariant bf16 engine refuses to run in this process, or None when it runs."""
    state = cpu_isa.onednn_state()
    return None if state["allow_variant_bf16"] else cpu_isa.isa_problem(state)


def code_path(dtype: str) -> str:
    """The code path a dtype's bits depend on in this process."""
    onednn = cpu_isa.onednn_state()
    path = (f"onednn {onednn['fp32_matmul'] or 'none'}; mkl {cpu_isa.mkl_path()}; "
            f"aten {torch.backends.cpu.get_cpu_capability()}")
    if dtype == "float32":
        return path
    return f"{path}; bf16 {onednn['bf16_matmul'] or 'none'}"
