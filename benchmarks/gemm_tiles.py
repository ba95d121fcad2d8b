"""Which launch shapes of the invariant matmul give the same bits, and what each costs against cuBLAS
(CUDA only).

    python benchmarks/gemm_tiles.py --out results.json

`kernels.triton_ops.linear` picks its launch shape (`matmul_tiles`: tile, warps, stages, and whether
the persistent TMA kernel runs) from the row count; a row's bits must not depend on that pick. This
runs every candidate shape on V4-Flash's matmul shapes at ragged row counts and checks each output
element's bits against the shipped pick, then times the shipped pick and the prefill candidates next
to cuBLAS (`torch.nn.functional.linear`), rotating over enough weight copies that L2 holds none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from torch.nn import functional as F

from gpu_bench import timed_ms
from deepinfer.kernels import triton_ops
from deepinfer.kernels.triton_ops import Tiles

SHAPES = {  # name: (N, K), V4-Flash widths, bf16
    "wq_a 1024x4096": (1024, 4096),
    "wq_b 32768x1024": (32768, 1024),
    "wo_b 4096x8192": (4096, 8192),
    "expert w13 4096x4096": (4096, 4096),
    "head 129280x4096": (129280, 4096),
}
PREFILL_CANDIDATES = [Tiles(128, 128, 8, 3), Tiles(128, 256, 8, 3), Tiles(128, 128, 8, 3, True),
                      Tiles(128, 128, 8, 4, True), Tiles(128, 256, 8, 3, True), Tiles(128, 128, 4, 4, True),
                      Tiles(64, 128, 4, 4, True), Tiles(128, 64, 4, 4, True)]
NEUTRALITY_ROWS = (1, 5, 64, 333, 1100)
TIMED_ROWS = (1, 16, 2048, 8192)


def linear_as(tiles: Tiles | None):
    """`triton_ops.linear` launched as `tiles` (None: as shipped)."""
    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shipped = triton_ops.matmul_tiles
        if tiles is not None:
            triton_ops.matmul_tiles = lambda *args: tiles
        try:
            return triton_ops.linear(x, w)
        finally:
            triton_ops.matmul_tiles = shipped
    return run


def label(tiles: Tiles) -> str:
    kind = "persistent" if tiles.persistent else "pointer"
    return f"{kind} {tiles.block_m}x{tiles.block_n} w{tiles.warps} s{tiles.stages}"


def neutrality() -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in NEUTRALITY_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            shipped = linear_as(None)(x, w)
            for tiles in PREFILL_CANDIDATES + [triton_ops.matmul_tiles(1, n, w.dtype)]:
                other = linear_as(tiles)(x, w)
                rows.append({"shape": name, "M": m, "tiles": label(tiles),
                             "bitwise": bool(torch.equal(shipped.view(torch.int16), other.view(torch.int16)))})
        del w
    return rows


def timing() -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        weight_bytes = n * k * 2
        copies = max(2, min(8, int(240e6 // weight_bytes) + 1))
        for m in TIMED_ROWS:
            inputs = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                       torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
            row = {"shape": name, "M": m, "N": n, "K": k, "shipped": label(triton_ops.matmul_tiles(m, n, torch.bfloat16)),
                   "cublas_ms": round(timed_ms(F.linear, inputs), 4)}
            candidates = [None] + (PREFILL_CANDIDATES if m > 512 else [])
            for tiles in candidates:
                ms = timed_ms(linear_as(tiles), inputs)
                row["shipped_ms" if tiles is None else label(tiles)] = round(ms, 4)
            row["shipped_vs_cublas"] = round(row["cublas_ms"] / row["shipped_ms"], 3)
            best = min((v, key) for key, v in row.items() if key.startswith(("persistent", "pointer")))\
                if m > 512 else (row["shipped_ms"], "shipped")
            row.update(best=best[1], best_vs_cublas=round(row["cublas_ms"] / best[0], 3),
                       cublas_tflop_s=round(2 * m * n * k / row["cublas_ms"] / 1e9, 1),
                       cublas_tb_s=round((weight_bytes + (m * k + m * n) * 2) / row["cublas_ms"] / 1e9, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del inputs
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"command": "python " + " ".join(a if a != args.out else Path(args.out).name for a in sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    report["neutrality"] = neutrality()
    bad = [r for r in report["neutrality"] if not r["bitwise"]]
    print(f"neutrality: {len(report['neutrality']) - len(bad)} of {len(report['neutrality'])} bitwise", flush=True)
    for r in bad:
        print("  differs:", r["shape"], "M", r["M"], r["tiles"], flush=True)
    report["timing"] = timing()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
