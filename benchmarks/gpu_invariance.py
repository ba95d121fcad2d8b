"""The invariance matrix on a CUDA device, with throughput of both numerics modes side by side.

    python benchmarks/gpu_invariance.py --preset small --dtype bfloat16 --out results.json

Runs the standard request set under every standard variant in `batch_invariant` and `fast`
modes, reports which requests diverge from the all-at-once reference, and the wall time of the
all-at-once variant in each mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from deepinfer import NUMERICS
from deepinfer.checkpoint import preset_config
from harness.invariance import STANDARD_VARIANTS, run_matrix, run_variant, standard_requests


def timed_reference(model: str, requests, dtype: str, numerics: str) -> float:
    run_variant(model, requests[:2], STANDARD_VARIANTS[0], dtype=dtype, numerics=numerics, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    run_variant(model, requests, STANDARD_VARIANTS[0], dtype=dtype, numerics=numerics, device="cuda")
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", nargs="+", default=list(NUMERICS), choices=NUMERICS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = f"preset:{args.preset}"
    requests = standard_requests(preset_config(args.preset).vocab_size, count=24)
    command = " ".join(arg if arg != args.out else Path(args.out).name for arg in sys.argv)  # no machine paths
    report = {"command": f"python {command}", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype, "modes": {}}
    for numerics in args.modes:
        result = run_matrix(model, requests, STANDARD_VARIANTS, dtype=args.dtype, numerics=numerics, device="cuda")
        seconds = timed_reference(model, requests, args.dtype, numerics)
        report["modes"][numerics] = {"diverged": result.diverged, "invariant": result.invariant,
                                     "all_at_once_seconds": round(seconds, 3)}
        print(numerics, "invariant" if result.invariant else f"DIVERGED {result.diverged}",
              f"all-at-once {seconds:.2f}s", flush=True)
    modes = report["modes"]
    if len(modes) == 2:
        report["invariant_slowdown"] = round(modes["batch_invariant"]["all_at_once_seconds"]
                                             / modes["fast"]["all_at_once_seconds"], 2)
        print("slowdown", report["invariant_slowdown"], flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
