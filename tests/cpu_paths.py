"""Which CPU code path this process computes on, for tests whose expected bits depend on it.

The contract fixes bits per code path (kernels/invariant.py, benchmarks/results/cpu_isa_pairs.json):
fp32 follows MKL's (AVX2 under MKL_CBWR or without AVX-512, else AVX-512), bf16 also oneDNN's kernel.
Where oneDNN's bf16 kernels are not batch-invariant (e.g. capped to AVX512_CORE) the engine refuses
bf16 (tests/test_cpu_isa.py checks the refusal), so bf16 invariance tests skip with its reason.
"""

from __future__ import annotations

import os
from pathlib import Path

from kernels import cpu_isa


def bf16_refusal() -> str | None:
    """Why a batch-invariant bf16 engine refuses to run in this process, or None when it runs."""
    state = cpu_isa.onednn_state()
    return None if state["allow_variant_bf16"] else cpu_isa.isa_problem(state)


def mkl_path() -> str:
    """MKL's code path: `avx2` (forced, or a CPU without AVX-512) or `avx512`, plus MKL_CBWR if set."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    forced = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "").upper()
    path = "avx2" if forced == "AVX2" or " avx512f" not in flags else "avx512"
    cbwr = os.environ.get("MKL_CBWR")
    return f"{path}, MKL_CBWR={cbwr}" if cbwr else path


def code_path(dtype: str) -> str:
    """The code path a dtype's bits depend on in this process."""
    if dtype == "float32":
        return f"mkl {mkl_path()}"
    return f"mkl {mkl_path()}; onednn {cpu_isa.onednn_state()['bf16_matmul'] or 'none'}"
