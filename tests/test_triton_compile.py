"""The matmul kernels compile for Hopper (sm_90) in every weight format, scale tile and split, without a GPU.

The interpreter runs kernels as Python and never sees what only the compiler does (a branch that
cannot be generated for some constexpr combination is invisible to it), so this compiles
`kernels.triton_ops`' matmul kernels to PTX in a fresh process with the interpreter off, and checks
that the bf16 ones use Hopper's wgmma. Triton's bundled ptxas does the work: no CUDA device needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = [("plain", 1, 1), ("fp8", 32, 32), ("fp8", 128, 128), ("fp8", 16, 48), ("mxfp4", 1, 32)]

COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_ops

def compile_kernel(fn, signature, constexprs):
    names = fn.arg_names  # every parameter, in order
    source = ASTSource(fn=fn, signature={name: signature.get(name, "constexpr") for name in names},
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

results = []
for fmt, tile_n, tile_k in json.loads(sys.argv[1]):
    weight = "*bf16" if fmt == "plain" else "*u8"
    layout = {"FORMAT": fmt, "TILE_N": tile_n, "TILE_K": tile_k, "BLOCK_K": triton_ops.BLOCK_K}
    for splits in (1, 4):
        signature = {"x_ptr": "*bf16", "w_ptr": weight, "s_ptr": weight, "out_ptr": "*fp32" if splits > 1 else "*bf16",
                     "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"}
        ptx = compile_kernel(triton_ops._matmul_kernel, signature,
                             {"BLOCK_M": 64, "BLOCK_N": 16, **layout, "SPLITS": splits, "K_CHUNK": triton_ops.K_CHUNK})
        results.append([fmt, tile_k, "matmul", splits, "wgmma" in ptx])
    signature = {"x_ptr": "*bf16", "rows_ptr": "*i64", "offsets_ptr": "*i64", "experts_ptr": "*i64", "w_ptr": weight,
                 "s_ptr": weight, "out_ptr": "*bf16", "N": "i32", "K": "i32", "stride_xm": "i32"}
    ptx = compile_kernel(triton_ops._expert_matmul_kernel, signature, {"BLOCK_M": 64, "BLOCK_N": 64, **layout})
    results.append([fmt, tile_k, "experts", 1, "wgmma" in ptx])
print(json.dumps(results))
"""


def test_matmul_kernels_compile_for_hopper_in_every_format():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(LAYOUTS)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(LAYOUTS) * 3
    assert all(uses_wgmma for *_, uses_wgmma in results), [r for r in results if not r[-1]]
