"""The invariance matrix of expert parallelism at one launch's degree: every rank serves the standard
request set with the experts spread over all ranks, under several configurations and two EPLB
placements, and with every expert on every rank (EP = 1, the reference); rank 0 writes which requests
diverge from the reference, and the wall time of each configuration.

    torchrun --nproc-per-node 8 benchmarks/ep_invariance.py --preset tiny --device cpu --out ep8.json

On GPUs each rank takes the GPU of its local rank (NCCL); on CPU the ranks are processes (gloo).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer import LLM, EngineConfig
from deepinfer.parallel import balanced_placement, placement_digest
from deepinfer.harness.invariance import signature, standard_requests
from deepinfer.harness.sweep import FACTORS

# (name, engine settings over the EP engine's) served after the first placement: the engine-level
# factors of harness.sweep.FACTORS that change how the ranks' steps are cut
CONFIGURATIONS = (("all-at-once", {}), *((name, factor) for name, factor in FACTORS
                                         if name in ("batch-1", "batch-3", "chunk-16", "sync-steps")))


def serve(llm: LLM, requests) -> tuple[list[tuple], float]:
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    return [signature(o) for o in outputs], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data-parallel", type=int, default=None, help="1 or the world size (default: the world)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    base = {"device": args.device, "dtype": args.dtype}
    reference_llm = LLM(f"preset:{args.preset}", **base)  # every rank holds every expert (EP = 1)
    world, rank = reference_llm.layout.world, reference_llm.layout.rank
    requests = standard_requests(reference_llm.config.vocab_size, count=args.requests)
    reference, reference_s = serve(reference_llm, requests)
    del reference_llm
    llm = LLM(f"preset:{args.preset}", **base, expert_parallel=world, data_parallel=args.data_parallel or world)
    report = {"command": "torchrun --nproc-per-node {} ".format(world) + " ".join(
                  arg if arg != args.out else Path(args.out).name for arg in sys.argv),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (gloo processes)",
              "torch": torch.__version__, "world": world, "layout": llm.layout.describe(), "preset": args.preset,
              "dtype": args.dtype, "requests": len(requests), "reference_seconds": round(reference_s, 3),
              "placements": {}}
    for placement_name in ("contiguous", "eplb"):
        if placement_name == "eplb":  # one spare slot per rank, fitted to what the first placement served
            per_rank = llm.expert_placements[0].per_rank + 1
            llm.place_experts([balanced_placement(loads, world, per_rank) for loads in llm.expert_loads()])
        results = {}
        for name, settings in CONFIGURATIONS:
            engine = llm.with_engine(EngineConfig(**{**base, "expert_parallel": world,
                                                     "data_parallel": args.data_parallel or world, **settings}))
            signatures, seconds = serve(engine, requests)
            diverged = [i for i, (a, b) in enumerate(zip(reference, signatures)) if a != b]
            results[name] = {"diverged": diverged, "seconds": round(seconds, 3)}
        report["placements"][placement_name] = {"digest": placement_digest(llm.expert_placements),
                                                "configurations": results}
    report["invariant"] = all(not r["diverged"] for p in report["placements"].values()
                              for r in p["configurations"].values())
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({"invariant": report["invariant"], "world": world}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
