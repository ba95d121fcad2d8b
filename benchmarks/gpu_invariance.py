"""The invariance matrix on a CUDA device, with throughput of both numerics modes side by side.

    python benchmarks/gpu_invariance.py --preset small --dtype bfloat16 --out results.json

Runs the standard request set under every standard variant (with the preset's own draft model at
1, 3 and 5 drafts, under a confidence threshold, and under throughput-aware verification, whose plain
steps run asynchronously between speculative ones, where it stores one), one with CUDA graphs off (the
others replay decode steps from graphs, in whichever step-shape bucket their batches land) and one
with async scheduling off (the others queue each step before reading the one before), and one
whose prefill steps take up to 4096 tokens (more than 512 rows: the persistent matmul), in
`batch_invariant` and `fast` modes; reports which requests diverge from the all-at-once reference,
and the wall time of the all-at-once variant in each mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLM, NUMERICS
from deepinfer.checkpoint import preset_config
from deepinfer.harness.invariance import STANDARD_VARIANTS, matrix_variant, model_variants, run_matrix, run_variant, standard_requests
from deepinfer.harness.sweep import Variant, checkpoint_drafter

GPU_VARIANTS = (Variant.of("graphs-off", cuda_graphs=False), Variant.of("async-off", async_scheduling=False),
                Variant.of("budget-4096", max_num_batched_tokens=4096))


def timed_reference(llm: LLM, requests, dtype: str, numerics: str) -> float:
    reference = matrix_variant(STANDARD_VARIANTS[0], dtype=dtype, numerics=numerics, device="cuda")
    run_variant(llm, requests[:2], reference)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run_variant(llm, requests, reference)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", nargs="+", default=list(NUMERICS), choices=NUMERICS)
    parser.add_argument("--requests", type=int, default=24, help="size of the standard request set")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = f"preset:{args.preset}"
    requests = standard_requests(preset_config(args.preset).vocab_size, count=args.requests)
    command = " ".join(arg if arg != args.out else Path(args.out).name for arg in sys.argv)  # no machine paths
    report = {"command": f"python {command}", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype, "requests": len(requests),
              "modes": {}}
    for numerics in args.modes:
        start = time.perf_counter()
        reference = matrix_variant(STANDARD_VARIANTS[0], dtype=args.dtype, numerics=numerics, device="cuda")
        llm = LLM(model, reference.engine)  # loaded once: every variant is an engine over it (LLM.with_engine)
        load_seconds = time.perf_counter() - start
        print(numerics, f"loaded in {load_seconds:.1f}s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
        drafter = checkpoint_drafter(model)
        planned = (Variant.of("draft-k5-throughput", speculation=drafter, draft_tokens=5, verify_policy="throughput"),
                   ) if drafter is not None else ()
        result = run_matrix(llm, requests, model_variants(model) + planned + GPU_VARIANTS, dtype=args.dtype,
                            numerics=numerics, device="cuda")
        seconds = timed_reference(llm, requests, args.dtype, numerics)
        storage = llm.engine_config.weight_storage
        del llm
        report["modes"][numerics] = {"diverged": result.diverged, "invariant": result.invariant,
                                     "all_at_once_seconds": round(seconds, 3), "load_seconds": round(load_seconds, 1),
                                     "weight_storage": storage}
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
