"""The seeds' GEMM kernels (DeepGEMM, the `deepinfer-gemm` package, imported as `deep_gemm`) on this GPU:
do they run, do they give a row the same bits whatever the batch, and how fast are they beside ours
and cuBLAS at a preset's matmul shapes (issue 35, item 4). One command, one JSON.

    python benchmarks/seed_kernels.py --preset v41-flash-5l --out results.json

DeepGEMM is built from its sdist where it runs (`python -m pip install --no-build-isolation --no-deps
deepinfer_gemm-2.8.2.tar.gz` by the Python that has torch: the GPU image's `pip` command belongs to
another; elfutils' headers on the include path; about 2.5 minutes on 16 cores; the distribution it
installs is named `deepgemm`); its kernels are compiled at their first call. On SM90 its FP8 GEMM
takes FP32 scales, the activations' per token and 128 columns (1 x 128) and the weights' per 128 x 128
block, and the call must name that recipe, `(1, 128, 128)` (without it the binding reads an empty
optional). So V4's FP8 weights (128 x 128 tiles, E8M0 scales,
which FP32 holds exactly) fit it as stored, but its activations must be quantized to FP8 per token,
which our engine does not do (its matmuls take bf16 activations): a different model numerically.
V4.1's dense weights use 32 x 32 tiles and its experts MXFP4, neither of which the SM90 kernels take.

- `runtime`: first calls into its device runtime, each in a process of its own (their exit codes), so
  that a crash there is recorded rather than fatal; the rest runs only where they all returned;
- `invariance`: per kernel, the rows M in `--rows` of `x @ w.T` computed alone (the first M rows of a
  batch) against the same rows in a batch of the largest M; bitwise, with `use_deterministic_algorithms`
  on and off; also the error against an fp32 reference (the FP8 one against its own dequantized operands);
- `speed`: at the preset's shapes (`gpu_bench.kernel_shapes`), M = 1, 64, 256 and 2048, median ms of
  each kernel replayed from a CUDA graph over enough weight copies that L2 holds none (`gpu_bench.timed_ms`):
  ours (`triton_ops.linear`: bf16, and the weight kept as FP8 in 128 x 128 tiles), cuBLAS bf16, DeepGEMM
  bf16 (deterministic and not) and DeepGEMM FP8 (its activation quantization timed apart).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from deepinfer.checkpoint import preset_config
from deepinfer.kernels import triton_ops
from deepinfer.kernels.quant import QuantizedWeight, fp8_block_encode
from gpu_bench import kernel_shapes, timed_ms

FP8_TILE = (128, 128)  # V4's stored FP8 weights, and DeepGEMM's SM90 weight-scale block
RECIPE = (1, 128, 128)  # DeepGEMM's SM90 FP8 recipe: activations per token x 128, weights per 128 x 128


def deep_gemm_bf16(deep_gemm) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=torch.bfloat16)
        deep_gemm.bf16_gemm_nt(x, w, out)
        return out
    return call


def fp8_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[tuple, tuple]:
    """(activations, weight) as DeepGEMM's SM90 FP8 GEMM takes them: E4M3 values and FP32 scales."""
    from deep_gemm.utils.math import per_block_cast_to_fp8

    return per_token_cast_to_fp8(x, False), per_block_cast_to_fp8(w, use_ue8m0=False)


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from deep_gemm.utils.math import per_token_cast_to_fp8 as cast

    return cast(x, use_ue8m0)


def deep_gemm_fp8(deep_gemm, a: tuple, b: tuple) -> torch.Tensor:
    out = torch.empty(a[0].shape[0], b[0].shape[0], device=a[0].device, dtype=torch.bfloat16)
    deep_gemm.fp8_gemm_nt(a, b, out, recipe=RECIPE)
    return out


OUT = "torch.empty(64, 256, device='cuda', dtype=torch.bfloat16)"
PROBES = {"get_num_sms": "deep_gemm.get_num_sms()", "bf16_gemm_nt": f"deep_gemm.bf16_gemm_nt(x, w, {OUT})",
          "cublaslt_gemm_nt": f"deep_gemm.cublaslt_gemm_nt(x, w, {OUT})"}


def probe_runtime() -> dict:
    """Each of PROBES in a process of its own, first calls into DeepGEMM's device runtime: on an H100 with
    torch 2.11 / CUDA 13.0, 2.8.2 built but every one of them died of a segfault (no Python error), which
    would take this whole benchmark down with it. Per probe its exit code (negative: the signal)."""
    setup = ("import torch, deep_gemm; x = torch.randn(64, 512, device='cuda', dtype=torch.bfloat16); "
             "w = torch.randn(256, 512, device='cuda', dtype=torch.bfloat16); ")
    codes = {name: subprocess.run([sys.executable, "-c", setup + call + "; torch.cuda.synchronize()"],
                                  capture_output=True, timeout=600).returncode for name, call in PROBES.items()}
    return {"exit_codes": codes, "runs": not any(codes.values())}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def invariance(deep_gemm, n: int, k: int, rows: list[int]) -> list[dict]:
    """Whether each kernel's rows keep their bits from a batch of max(rows) to each smaller one."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = max(rows)
    x = torch.randn(big, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    reference = x.float() @ w.float().T
    a, b = fp8_operands(x, w)
    a_values = a[0].float().unflatten(1, (-1, 128)) * a[1].unsqueeze(-1)
    b_values = (b[0].float().unflatten(1, (-1, 128)).unflatten(0, (-1, 128))
                * b[1].unsqueeze(1).unsqueeze(-1)).flatten(2).flatten(0, 1)
    fp8_reference = a_values.flatten(1) @ b_values.T
    kernels = {"ours bf16": (lambda m: triton_ops.linear(x[:m], w), reference),
               "cublas bf16": (lambda m: F.linear(x[:m], w), reference),
               "deep_gemm bf16": (lambda m: deep_gemm_bf16(deep_gemm)(x[:m], w), reference),
               "deep_gemm fp8": (lambda m: deep_gemm_fp8(deep_gemm, (a[0][:m], a[1][:m]), b), fp8_reference)}
    results = []
    for deterministic in (True, False):
        deep_gemm.use_deterministic_algorithms(deterministic)
        for name, (run, want) in kernels.items():
            if deterministic is False and not name.startswith("deep_gemm"):
                continue
            full = run(big)
            differs = [m for m in rows if m != big and not torch.equal(run(m), full[:m])]
            results.append({"kernel": name, "N": n, "K": k, "deterministic": deterministic,
                            "rows_differ_at_M": differs, "batch_invariant": not differs,
                            "relative_error": round(relative_error(full, want), 6)})
            print(json.dumps(results[-1]), flush=True)
    deep_gemm.use_deterministic_algorithms(True)
    return results


def speed(deep_gemm, config, ms: list[int]) -> list[dict]:
    rows = []
    for name, (n, k, dtype) in kernel_shapes(config).items():
        if dtype != torch.bfloat16 or k % 128 or n % 128 or name == "head":
            continue  # DeepGEMM's FP8 blocks need whole 128-wide tiles; the head is not stored in FP8
        copies = max(2, min(8, int(256e6 // (n * k * 2)) + 1))
        weights = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
        stored = [QuantizedWeight(*fp8_block_encode(w.float().cpu(), FP8_TILE), "fp8", FP8_TILE, torch.bfloat16).to("cuda")
                  for w in weights]
        for m in ms:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            operands = [fp8_operands(x, w) for x, w in zip(xs, weights)]
            row = {"matmul": name, "M": m, "N": n, "K": k,
                   "ours_bf16_ms": timed_ms(triton_ops.linear, list(zip(xs, weights))),
                   "ours_fp8_stored_ms": timed_ms(triton_ops.linear, list(zip(xs, stored))),
                   "cublas_bf16_ms": timed_ms(F.linear, list(zip(xs, weights)))}
            for deterministic in (True, False):
                deep_gemm.use_deterministic_algorithms(deterministic)
                label = "deterministic" if deterministic else "default"
                row[f"deep_gemm_bf16_{label}_ms"] = timed_ms(deep_gemm_bf16(deep_gemm), list(zip(xs, weights)))
                row[f"deep_gemm_fp8_{label}_ms"] = timed_ms(lambda a, b: deep_gemm_fp8(deep_gemm, a, b), operands)
            deep_gemm.use_deterministic_algorithms(True)
            row["deep_gemm_fp8_activation_quant_ms"] = timed_ms(per_token_cast_to_fp8, [(x, False) for x in xs])
            rows.append({key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v41-flash-5l")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 16, 64, 129, 256])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 64, 256, 2048])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    command = " ".join(a if a != args.out else Path(args.out).name for a in sys.argv)
    report: dict = {"command": f"python {command}", "device": torch.cuda.get_device_name(),
                    "capability": list(torch.cuda.get_device_capability()), "torch": torch.__version__,
                    "preset": args.preset}
    try:
        import deep_gemm

        # the deepinfer-gemm sdist builds a distribution named "deepgemm"
        version = getattr(deep_gemm, "__version__", None) or importlib.metadata.version("deepgemm")
        report["deep_gemm"] = {"package": "deepinfer-gemm", "version": version, "imports": True,
                               "runtime": probe_runtime()}
    except Exception as err:  # the record says why it could not run, whatever the reason
        report["deep_gemm"] = {"imports": False, "error": f"{type(err).__name__}: {err}"}
    if not report["deep_gemm"].get("runtime", {}).get("runs"):
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        return 1
    config = preset_config(args.preset)
    for part, run in (("invariance", lambda: invariance(deep_gemm, 2 * config.moe_intermediate_size,
                                                        config.hidden_size, args.rows)),
                      ("speed", lambda: speed(deep_gemm, config, args.ms))):
        try:
            report[part] = run()
        except Exception as err:
            report[f"{part}_error"] = "".join(traceback.format_exception_only(err)).strip()[-2000:]
            print(report[f"{part}_error"], flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")  # what ran is kept if a later part dies
    return 0


if __name__ == "__main__":
    sys.exit(main())
