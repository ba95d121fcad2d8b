"""Where the Triton kernel tests run: under the Triton interpreter on CPU by default (small shapes: it
is slow), or compiled on the GPU with TRITON_INTERPRET=0 on a CUDA machine. Test modules import it
before Triton or `kernels.triton_ops`, since the interpreter is chosen when Triton is imported; a
module is skipped where neither can run."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

import torch  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = (torch.float32, torch.bfloat16)
