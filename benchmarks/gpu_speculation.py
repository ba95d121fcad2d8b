"""Speculative decoding on a CUDA device: outputs bitwise equal to plain decoding, and what it buys.

    python benchmarks/gpu_speculation.py --preset small --dtype bfloat16 --out results.json

Runs the standard request set (greedy and seeded sampling, logprobs) without speculation, then with
drafts taken from those outputs (`harness.invariance.ReferenceDrafter`: every `--wrong-every`-th
position wrong, so steps keep some drafts and reject others) at 1, 3 and 5 drafts per step, and
with prompt-lookup drafts; per configuration the requests whose token ids or logprob bits differ
from plain decoding (there must be none), drafts made and kept, engine steps and wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from deepinfer import LLM, EngineConfig
from deepinfer.checkpoint import preset_config
from harness.invariance import ReferenceDrafter, signature, standard_requests


def run(llm: LLM, requests) -> tuple[list, int, float]:
    """(signatures in request order, engine steps, seconds)."""
    ids = [llm.add_request(r.prompt, r.params) for r in requests]
    outputs, steps = {}, 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while llm.has_unfinished():
        outputs.update((out.request_id, out) for out in llm.step())
        steps += 1
    torch.cuda.synchronize()
    return [signature(outputs[i]) for i in ids], steps, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--wrong-every", type=int, default=4, help="every n-th drafted position is wrong")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    requests = standard_requests(preset_config(args.preset).vocab_size, count=args.requests)
    llm = LLM(f"preset:{args.preset}", EngineConfig(device="cuda", dtype=args.dtype))
    run(llm, requests)  # warm-up: kernels compiled and decode graphs captured outside the timed runs
    reference, steps, seconds = run(llm, requests)
    streams = [r.prompt + list(sig[0]) for r, sig in zip(requests, reference)]
    command = " ".join(a if a != args.out else Path(args.out).name for a in sys.argv)
    report = {"command": f"python {command}", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "preset": args.preset, "dtype": args.dtype, "requests": len(requests),
              "runs": [{"speculation": "off", "steps": steps, "seconds": round(seconds, 3)}]}
    drafters = [(f"reference-{k}", k, ReferenceDrafter(streams, args.wrong_every)) for k in (1, 3, 5)]
    for name, k, drafter in drafters + [("ngram-5", 5, None)]:
        spec = llm.with_engine(replace(llm.engine_config, speculation="ngram", draft_tokens=k))
        if drafter is not None:
            spec.scheduler.drafter = drafter
        run(spec, requests)  # warm-up, as for the reference
        drafted, kept = spec.scheduler.num_drafted, spec.scheduler.num_draft_kept
        got, steps, seconds = run(spec, requests)
        diverged = [i for i, (a, b) in enumerate(zip(reference, got)) if a != b]
        report["runs"].append({"speculation": name, "draft_tokens": k, "diverged": diverged, "steps": steps,
                               "seconds": round(seconds, 3), "drafted": spec.scheduler.num_drafted - drafted,
                               "kept": spec.scheduler.num_draft_kept - kept})
        print(json.dumps(report["runs"][-1]), flush=True)
    report["bitwise_equal"] = all(not r.get("diverged") for r in report["runs"])
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("bitwise equal with speculation on and off:", report["bitwise_equal"], flush=True)


if __name__ == "__main__":
    main()
