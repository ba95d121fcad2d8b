"""Which Triton matmul tile shapes give the same bits, and what each costs against cuBLAS (CUDA only).

    python benchmarks/gemm_tiles.py --out results.json

The invariant matmul (`kernels.triton_ops._matmul_kernel`) fixes a row's reduction order by BLOCK_K
and the dot instruction. This measures, on random inputs, whether other (BLOCK_M, BLOCK_N, BLOCK_K,
warps, stages) give each output element the same bits as the shipped configuration, and times each
configuration and K splits at decode and prefill shapes of V4-Flash next to cuBLAS
(`torch.nn.functional.linear`), rotating over enough weight copies that L2 holds none of them.
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
from kernels.triton_ops import _matmul_kernel, _sum_splits_kernel

BASE = (64, 64, 32, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages: the shipped kernel's
CONFIGS = [BASE, (64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (64, 32, 64, 4, 4), (64, 16, 128, 4, 4),
           (16, 64, 32, 4, 3), (32, 32, 32, 2, 3), (128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)]
SHAPES = {  # name: (N, K, dtype), V4-Flash widths
    "q_b 4096x1024": (32768, 1024, torch.bfloat16),
    "wq_a 1024x4096": (1024, 4096, torch.bfloat16),
    "square 4096": (4096, 4096, torch.bfloat16),
    "expert w13 4096x4096": (4096, 4096, torch.bfloat16),
    "hc fn 24x16384 fp32": (24, 16384, torch.float32),
    "head 129280x4096": (129280, 4096, torch.bfloat16),
}


def run_config(x: torch.Tensor, w: torch.Tensor, config: tuple, splits: int = 1) -> torch.Tensor:
    """x @ w.T by `_matmul_kernel` launched as `config`, its K in `splits` chunks of K_CHUNK (added in
    order by `_sum_splits_kernel`, as `kernels.triton_ops` does for skinny weights)."""
    bm, bn, bk, warps, stages = config
    rows, depth = x.shape
    width = w.shape[0]
    out = torch.empty(rows, width, dtype=w.dtype, device=x.device)
    target = out if splits == 1 else torch.empty(splits, rows, width, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, bm), triton.cdiv(width, bn), splits)
    _matmul_kernel[grid](x, w, w, target, rows, width, depth, depth, width, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         FORMAT="plain", TILE_N=1, TILE_K=1, SPLITS=splits, K_CHUNK=depth // splits,
                         num_warps=warps, num_stages=stages)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(out.numel(), 1024),)](target, out, out.numel(), SPLITS=splits, BLOCK=1024)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    a32, b32 = a.float(), b.float()
    return bool(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                            b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32))), \
        float((a32 - b32).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"command": "python " + " ".join(a if a != args.out else Path(args.out).name for a in sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "neutrality": [], "timing": []}
    for name, (n, k, dtype) in SHAPES.items():
        if n > 40000:
            continue
        for m in (1, 5, 64, 333):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
            base = run_config(x, w, BASE)
            for config in CONFIGS[1:]:
                equal, diff = same_bits(base, run_config(x, w, config))
                report["neutrality"].append({"shape": name, "M": m, "config": config, "bitwise": equal, "max_diff": diff})
            for split in (2, 8):
                if k % split == 0:
                    equal, diff = same_bits(base, run_config(x, w, BASE, split))
                    report["neutrality"].append({"shape": name, "M": m, "config": f"split{split}", "bitwise": equal,
                                                 "max_diff": diff})
    bad = [r for r in report["neutrality"] if not r["bitwise"]]
    print(f"neutrality: {len(report['neutrality']) - len(bad)} of {len(report['neutrality'])} bitwise", flush=True)
    for r in bad:
        print("  differs:", r["shape"], "M", r["M"], r["config"], f"{r['max_diff']:.3g}", flush=True)
    for name, (n, k, dtype) in SHAPES.items():
        weight_bytes = n * k * torch.tensor([], dtype=dtype).element_size()
        n_copies = max(2, min(8, int(240e6 // weight_bytes) + 1))
        for m in (1, 16, 2048):
            copies = [(torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype))
                      for _ in range(n_copies)]
            flops, moved = 2 * m * n * k, weight_bytes + (m * k + m * n) * copies[0][0].element_size()
            row = {"shape": name, "M": m, "N": n, "K": k, "dtype": str(dtype).split(".")[-1]}
            row["cublas_ms"] = timed_ms(lambda x, w: F.linear(x, w), copies)
            for config in CONFIGS:
                row[f"triton{config}_ms"] = timed_ms(lambda x, w, c=config: run_config(x, w, c), copies)
            if n < 256:
                for split in (4, 16, 32):
                    row[f"split{split}_ms"] = timed_ms(lambda x, w, s=split: run_config(x, w, (64, 32, 64, 4, 4), s), copies)
            best = min((v, key) for key, v in row.items() if key.endswith("_ms") and key != "cublas_ms")
            row.update(best=best[1], best_vs_cublas=round(row["cublas_ms"] / best[0], 3),
                       base_vs_cublas=round(row["cublas_ms"] / row[f"triton{BASE}_ms"], 3),
                       cublas_tflops=round(flops / row["cublas_ms"] / 1e9, 1),
                       cublas_gbs=round(moved / row["cublas_ms"] / 1e6, 1))
            report["timing"].append(row)
            print(f"{name:24s} M={m:5d} cublas {row['cublas_ms']:.4f} ms ({row['cublas_gbs']} GB/s, "
                  f"{row['cublas_tflops']} TF) base x{row['base_vs_cublas']} best {best[1]} x{row['best_vs_cublas']}",
                  flush=True)
            del copies
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
