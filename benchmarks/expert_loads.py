"""Per-layer expert loads of a preset's router over shipped suites: how many (token, top-k) slots each
routed expert received, prompt and output tokens alike. `scale_sim.py` reads them.

    python benchmarks/expert_loads.py --preset flash-4l --device cuda --dtype bfloat16 --out loads.json

Steps run eagerly (no CUDA graphs) so that the counting hooks on the routers see every step; they count
a step's tokens only, not the rows padding it to its bucket (as `LLM.expert_loads` does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLM
from deepinfer.model.moe import MoE
from deepinfer.harness.suite_registry import load_suite

SUITES = ("smoke", "traces:harness/suites/traces/sample.jsonl")


def count_loads(llm: LLM) -> list[torch.Tensor]:
    """One counter per MoE layer (in forward order), added to by a hook on its router over the step's
    first rows, its tokens (the scheduler's output says how many)."""
    layers = [module for module in llm.model.modules() if isinstance(module, MoE)]
    counters = [torch.zeros(llm.config.n_routed_experts, dtype=torch.int64, device=llm.device) for _ in layers]
    step_rows = [0]
    schedule = llm.core.scheduler.schedule

    def scheduling():
        scheduled = schedule()
        step_rows[0] = sum(chunk.num_tokens for chunk in scheduled.chunks)
        return scheduled

    llm.core.scheduler.schedule = scheduling
    for moe, counter in zip(layers, counters):
        def count(_module, _inputs, output, counter=counter) -> None:
            counter.add_(torch.bincount(output[0][:step_rows[0]].reshape(-1), minlength=counter.shape[0]))

        moe.gate.register_forward_hook(count)
    return counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash-4l")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--suites", nargs="+", default=list(SUITES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    llm = LLM(f"preset:{args.preset}", device=args.device, dtype=args.dtype, cuda_graphs=False)
    counters = count_loads(llm)
    command = " ".join(arg if arg != args.out else Path(args.out).name for arg in sys.argv)  # no machine paths
    report = {"command": f"python {command}", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "preset": args.preset, "dtype": args.dtype, "n_routed_experts": llm.config.n_routed_experts,
              "top_k": llm.config.num_experts_per_tok, "mlp_layer_types": list(llm.config.mlp_layer_types),
              "suites": {}}
    for spec in args.suites:
        suite = load_suite(spec)
        for counter in counters:
            counter.zero_()
        start = time.perf_counter()
        outputs = llm.generate([item.prompt_ids(llm) for item in suite.requests],
                               [item.params(0) for item in suite.requests])
        tokens = sum(len(item.prompt_ids(llm)) + len(o.token_ids) for item, o in zip(suite.requests, outputs))
        report["suites"][spec] = {"requests": len(outputs), "prompt_and_output_tokens": tokens,
                                  "seconds": round(time.perf_counter() - start, 2),
                                  "loads": [counter.tolist() for counter in counters]}
        print(spec, len(outputs), "requests", tokens, "tokens", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
